"""FlexAttention (`flex`): `torch.compile`d `flex_attention` with the variant's block mask.

Compiled afresh for every case (`torch._dynamo.reset()`, `dynamic=False`, `fullgraph=True`),
and the compile (first calls of every grad mode the case needs) is timed into `compile_s`, not
into latency. shared/ANCHORS.md records the pitfall this guards against: one compiled function
reused across shapes hit the recompile limit and silently ran the unfused eager path at a few
percent of the fused speed. Three checks turn that into a failed row instead of a bogus number:
the compile must have produced a graph (dynamo's `unique_graphs` counter), warm-up and timing
run under `torch.compiler.set_stance("fail_on_recompile")` (any recompile or fallback raises),
and a large problem (>= 1e11 FLOPs) measured below 20 TFLOP/s on a GPU is rejected.

The block mask is built with `create_block_mask` (not timed) for the full B x Hq grid, so
masks that depend on the batch (document ids) or head stay exact; past 2^32 mask elements it is
built compiled (`_compile=True`), as FlexAttention advises for long sequences: eagerly it
materialises the whole mask (256 GiB at 32 x 32k x 32k).

Decode cases (contiguous caches; FlexAttention's paged attention is experimental and not run):
the same compiled `flex_attention`, which takes its decoding kernel for short queries, on the
cache as [B, Hkv, capacity, D], with a block mask of each sequence's valid keys (so only those
blocks are read) and the variant's functions seeing absolute positions (q_idx + len - Sq).
"""

from __future__ import annotations

import math
import time

from attnbench.cases import Case
from attnbench.decode import decode_customs
from attnbench.impls.base import (
    ALL_DTYPES,
    GRAD_MODES,
    Capabilities,
    DeviceInfo,
    Impl,
    Prepared,
    Unsupported,
    learnable_customs,
    learnable_leaves,
)

MIN_PLAUSIBLE_TFLOPS = 20.0
MIN_CHECKED_FLOPS = 1e11


def flex_functions(case: Case, variant, inputs: dict) -> tuple:
    """The variant's (score_mod, mask_mod) as FlexAttention takes them (None: absent); shared
    with `engine-flex`, which runs the same functions through engine.flex_attention."""
    mods = variant.flex_mods(inputs)
    plain = variant.sdpa_kwargs(inputs)
    if mods is None and plain is not None and not plain.get("is_causal"):
        mods = (None, None)  # plain softmax without a mask needs no mods
    if mods is None:
        raise Unsupported(f"variant {case.variant} has no FlexAttention form "
                          "(its row normaliser is not softmax)")
    return mods


def decode_functions(case: Case, variant, customs: dict, cache_seqlens) -> tuple:
    """(score_mod, mask_mod) of a decode case: the variant's, at the new tokens' absolute
    positions, and the mask keeping each sequence's valid keys."""
    sizes = variant.sizes(case.batch, case.heads_q, case.heads_kv, case.seqlen_q,
                          case.seqlen_kv, case.head_dim, case.head_dim_v)
    if variant.flex_fn is not None:
        score_fn, mask_fn = variant.flex_fn(customs, sizes)
    elif variant.sdpa_causal is False:  # plain softmax: no mods
        score_fn = mask_fn = None
    else:
        raise Unsupported(f"variant {case.variant} has no FlexAttention form "
                          "(its row normaliser is not softmax)")
    lens = cache_seqlens
    start = cache_seqlens - case.seqlen_q  # position of each sequence's first new token

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx < lens[b]
        return keep if mask_fn is None else keep & mask_fn(b, h, q_idx + start[b], kv_idx)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score_fn(score, b, h, q_idx + start[b], kv_idx)

    return (score_mod if score_fn is not None else None), mask_mod


LARGE_MASK_ELEMS = 2**32


def _large(case: Case) -> bool:
    """Whether the eager block-mask build would materialise too much (see the docstring)."""
    return case.batch * case.heads_q * case.seqlen_q * case.seqlen_kv > LARGE_MASK_ELEMS


class FlexImpl(Impl):
    name = "flex"
    description = "torch.compile(flex_attention) with its block mask, compiled per case"

    @property
    def caps(self) -> Capabilities:
        return Capabilities(devices=frozenset({"cuda"}), dtypes=ALL_DTYPES,
                            kinds=frozenset({"attention", "decode"}))

    def check(self, case: Case, variant, device: DeviceInfo) -> str | None:
        reason = super().check(case, variant, device)
        if reason is None and case.kind == "decode" and case.page_size:
            reason = ("FlexAttention's paged attention (torch.nn.attention.experimental."
                      "_paged_attention) is experimental: not measured")
        return reason

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        from torch.nn.attention.flex_attention import create_block_mask

        if case.kind == "decode":
            return self._prepare_decode(case, variant, inputs)
        customs = learnable_customs(variant, inputs, needs_grad)
        score_mod, mask_mod = flex_functions(case, variant, {**inputs, **customs})
        block_mask = None
        if mask_mod is not None:
            block_mask = create_block_mask(mask_mod, case.batch, case.heads_q, case.seqlen_q,
                                           case.seqlen_kv, device=inputs["q"].device,
                                           _compile=_large(case))
        kw = variant.sdpa_kwargs(inputs) or {}
        scale = kw.get("scale")  # None: flex's default 1/sqrt(D)

        def arrange(t):
            return t.detach().transpose(1, 2).contiguous().requires_grad_(needs_grad)

        q, k, v = (arrange(inputs[n]) for n in ("q", "k", "v"))
        return self._compiled(case, (q, k, v), score_mod, block_mask, scale,
                              learnable_leaves(variant, customs), needs_grad)

    def _prepare_decode(self, case: Case, variant, inputs: dict) -> Prepared:
        from torch.nn.attention.flex_attention import create_block_mask

        score_mod, mask_mod = decode_functions(case, variant, decode_customs(inputs),
                                               inputs["cache_seqlens"])
        block_mask = create_block_mask(mask_mod, case.batch, case.heads_q, case.seqlen_q,
                                       case.seqlen_kv, device=inputs["q"].device)
        qkv = tuple(inputs[n].transpose(1, 2).contiguous() for n in ("q", "k_cache", "v_cache"))
        return self._compiled(case, qkv, score_mod, block_mask, 1.0 / math.sqrt(case.head_dim),
                              (), False)

    @staticmethod
    def _compiled(case: Case, qkv: tuple, score_mod, block_mask, scale, custom_leaves: tuple,
                  needs_grad: bool) -> Prepared:
        """flex_attention compiled afresh for the case, its first calls timed as compile_s,
        and the checks of the module docstring."""
        import torch
        from torch._dynamo.utils import counters
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = qkv
        device = q.device
        gqa = case.heads_q != case.heads_kv
        torch._dynamo.reset()  # a fresh compile per case: no reuse across shapes
        # The `bwd` mode times the backward alone by replaying it on one graph (retain_graph),
        # which compiled backwards with donated buffers refuse.
        torch._functorch.config.donated_buffer = False
        counters.clear()
        compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)

        def forward():
            return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            enable_gqa=gqa)

        t0 = time.perf_counter()
        with torch.no_grad():
            forward()
        if needs_grad:
            try:
                out = forward()
                torch.autograd.grad(out, (q, k, v, *custom_leaves), torch.randn_like(out))
            except Exception as exc:  # noqa: BLE001 - inductor could not build the backward
                # (e.g. a captured tensor's gradient: its Triton template ran out of shared
                # memory at D 128); the forward is still measured
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                raise Unsupported(f"flex backward did not compile: {type(exc).__name__}: "
                                  f"{first}", modes=GRAD_MODES) from exc
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        if counters["stats"]["unique_graphs"] < 1:
            raise RuntimeError("torch.compile produced no graph for flex_attention; the timing "
                               "would be of the unfused eager path")

        def context():
            return torch.compiler.set_stance("fail_on_recompile")

        def verify(tflops: float, flops: float) -> str | None:
            big = flops >= MIN_CHECKED_FLOPS
            if device.type == "cuda" and big and tflops < MIN_PLAUSIBLE_TFLOPS:
                return (f"implausibly slow ({tflops:.1f} TFLOP/s < {MIN_PLAUSIBLE_TFLOPS}): the "
                        "compiled FlexAttention path probably did not run")
            return None

        return Prepared(
            forward=forward, leaves=(q, k, v, *custom_leaves),
            to_common=lambda t: t.transpose(1, 2),
            from_common=lambda t: t.transpose(1, 2).contiguous(), context=context,
            compile_s=compile_s, verify=verify,
        )
