"""AttentionEngine: the user-facing module (API of the seed documents)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.dsl.io import CustomIO
from engine.dsl.online import OnlineFunc, OnlineSoftmax
from engine.dtypes import KERNEL_DTYPES
from engine.ir.merge import trace_merge
from engine.ir.spec import TracedSpec
from engine.ir.tensor_mods import mod_only_customs, trace_qkv_mods
from engine.ir.trace import trace_spec
from engine.kernels.attention_bwd.launch import BackwardKernels
from engine.kernels.attention_decode.launch import DecodeKernels, launch_decode
from engine.kernels.attention_decode.plan import DecodeConfig, DecodeShape
from engine.kernels.attention_fwd.launch import ForwardKernel
from engine.logs import log_once
from engine.plan.config import KernelConfig
from engine.plan.request import KernelOptions, KernelRequest
from engine.problem import Problem
from engine.reference.decode import decode_forward
from engine.reference.tensor_mods import apply_qkv_mods
from engine.runtime.arg_checks import (
    bind_customs,
    check_meta_tensors,
    check_placement,
    expect_tensor,
)
from engine.runtime.decode_inputs import check_decode_args, check_decode_values
from engine.runtime.device import choose_backend
from engine.runtime.device import sm_count as gpu_sm_count
from engine.runtime.kernel_cache import KernelCache
from engine.runtime.ops import compiled_forward, register

BACKENDS = ("auto", "reference", "tilelang")


def _check_meta(qkv_meta: Any) -> tuple[Problem, torch.dtype]:
    dtype = check_meta_tensors(qkv_meta, "B, H, S, D")
    qm, km, vm = qkv_meta
    (B, Hq, Sq, D), (Bk, Hkv, Skv, Dk), (Bv, Hv, Sv, Dv) = qm.shape, km.shape, vm.shape
    if not (B == Bk == Bv):
        raise ValueError(f"qkv_meta: batch sizes differ (q {B}, k {Bk}, v {Bv})")
    if Dk != D:
        raise ValueError(f"qkv_meta: k head dim {Dk} != q head dim {D}")
    if (Hv, Sv) != (Hkv, Skv):
        raise ValueError(f"qkv_meta: v (H={Hv}, S={Sv}) must match k (H={Hkv}, S={Skv})")
    if Hq % Hkv:
        raise ValueError(f"qkv_meta: q heads {Hq} must be a multiple of kv heads {Hkv} (GQA)")
    return Problem(batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Sq, seqlen_kv=Skv, head_dim=D,
                   head_dim_v=Dv), dtype


class AttentionEngine(torch.nn.Module):
    """A compiled attention variant.

    qkv_meta: (q, k, v) meta tensors in (B, H, S, D) order (see `meta_tensor`). The module is
    called with runtime tensors laid out q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv]
    (Hq a multiple of Hkv for GQA), plus the CustomIO tensors, positionally in declaration
    order or by name. It returns o [B, Sq, Hq, Dv]; gradients flow to q, k, v and to CustomIO
    tensors that require grad (through score_mod).

    backend: "auto" (TileLang kernels on a Hopper GPU, else the reference executor),
    "reference", or "tilelang". config: a KernelConfig overriding defaults and tune files;
    backward_config: the same for the backward's main kernel (kind attention_bwd).
    tune_file: the tune file to read (default results/tune/<gpu>/<kind>.json); a shape it
    lacks uses its nearest tuned shape. tune=True: on the first call on a Hopper GPU, a shape
    with no exact entry is tuned first by the installed tuner (attnbench's, a few minutes at
    most; see engine.tuning.autotune) and the result is written to that file.
    deterministic: True runs the atomic-free backward kernels (bitwise identical gradients
    run to run): dK/dV stored per query head and summed per group, custom gradients per key
    row, and dQ from a second kernel that recomputes the scores per query block.
    Attribute `dynamic_shapes` (default engine.kernels.attention_fwd.plan.DYNAMIC_SHAPES):
    compile the forward with batch and lengths as runtime symbols, one kernel for every
    length. Changing an option after construction selects new kernels. tune=True
    tunes the forward kernel; the backward's config comes from its tune file (attnbench tune
    --mode bwd) or backward_config=.

    query_mod, key_mod, value_mod (seed 001; None: the identity): functions applied elementwise
    to q, k, v before the attention, as `mod(x)` or `mod(x, custom_fwd_inputs, b, h, pos)`,
    where x is one element (a DSL expression), b the batch index, pos the query position for
    query_mod and the key position for key_mod and value_mod, and h the query head for
    query_mod but the kv head for key_mod and value_mod: with GQA a "heads" CustomIO input
    read in a key or value mod is read at h < Hkv (index it explicitly to choose otherwise).
    They run as a pre-pass of torch ops (one more read and write of each modded tensor, not
    fused into the kernels' loads), so the kernels do not change; autograd gives q, k, v and
    the CustomIO tensors they read their gradients, on every backend and under torch.compile.

    Decode: called with `cache_seqlens=` (int32 [B]) the module runs the decode kernels
    (engine.kernels.attention_decode): k and v are KV caches [B, capacity, Hkv, D] (capacity =
    qkv_meta's k length), or paged caches [num_pages, page_size, Hkv, D] with
    `block_table=` (int32 [B, capacity // page_size]); the Sq new tokens of q sit at positions
    cache_seqlens[b] - Sq .. cache_seqlens[b] - 1 (already written into the cache), which is
    what score_mod and mask_mod see as q_idx. Keys are split across thread blocks and merged
    by the normaliser's rule (OnlineFunc.combine_online or combine); decode_config (a
    DecodeConfig) fixes the kernels' tiles and splits. The lengths and the block table are
    checked against the capacity and the pages (a host synchronisation; skipped during CUDA
    graph capture, and when the attribute `check_cache_values` is False: the kernels then
    clamp every index). Decode computes no gradients.
    """

    def __init__(
        self,
        qkv_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        custom_fwd_inputs: CustomIO | None = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        online_func: OnlineFunc | None = None,
        tune: bool = False,
        tune_file: str | None = None,
        *,
        block_mask: Any = None,
        backend: str = "auto",
        config: KernelConfig | None = None,
        backward_config: KernelConfig | None = None,
        deterministic: bool = False,
        query_mod: Callable | None = None,
        key_mod: Callable | None = None,
        value_mod: Callable | None = None,
        decode_config: DecodeConfig | None = None,
    ):
        super().__init__()
        self.problem, self.dtype = _check_meta(qkv_meta)
        p = self.problem  # q's, k's and v's shapes, kept: built per call they cost host time
        self._qkv_shapes = ((p.batch, p.seqlen_q, p.heads_q, p.head_dim),
                            (p.batch, p.seqlen_kv, p.heads_kv, p.head_dim),
                            (p.batch, p.seqlen_kv, p.heads_kv, p.head_dim_v))
        if block_mask is not None and mask_mod is not None:
            raise ValueError(
                "give the mask once: mask_mod= or block_mask= (seed 002's name), not both"
            )
        if block_mask is not None:
            mask_mod = getattr(block_mask, "mask_mod", block_mask)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        for what, cfg in (("config", config), ("backward_config", backward_config)):
            if cfg is not None and not isinstance(cfg, KernelConfig):
                raise ValueError(f"{what}: expected a KernelConfig, got {type(cfg).__name__}")
        if decode_config is not None and not isinstance(decode_config, DecodeConfig):
            raise ValueError(f"decode_config: expected a DecodeConfig, got "
                             f"{type(decode_config).__name__}")
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic: expected a bool, got {deterministic!r}")
        if not isinstance(tune, bool):
            raise ValueError(f"tune: expected a bool, got {tune!r}")
        if tune and config is not None:
            raise ValueError("tune=True and config= exclude each other: config fixes the kernel "
                             "config that tuning would choose")
        self.custom_io = custom_fwd_inputs if custom_fwd_inputs is not None else CustomIO({})
        self.online_func = online_func if online_func is not None else OnlineSoftmax()
        self.spec: TracedSpec = trace_spec(score_mod, mask_mod, self.online_func, self.custom_io)
        self.merge = trace_merge(self.online_func, self.spec)  # decode's split merge (or None)
        self.qkv_mods = trace_qkv_mods(query_mod, key_mod, value_mod, self.custom_io)
        self._mod_only_customs = (mod_only_customs(self.qkv_mods, self.spec)
                                  if self.qkv_mods is not None else frozenset())
        self.backend_name = backend
        self.config = config
        self.backward_config = backward_config
        self.decode_config = decode_config
        self.check_cache_values = True
        self.tune = tune
        self.tune_file = tune_file
        self.deterministic = deterministic
        from engine.kernels.attention_fwd.plan import DYNAMIC_SHAPES

        self.dynamic_shapes = DYNAMIC_SHAPES  # see engine.kernels.attention_fwd.plan
        self._kernel_cache = KernelCache()
        self._request: KernelRequest | None = None  # kernel_request()'s, while options stay
        self._request_values: tuple | None = None
        self._decode_last: tuple | None = None  # (request, paging, decode kernels) of the last call
        self._op_handle = register(self)  # names the module in the custom ops (torch.compile)

    def __setstate__(self, state: dict) -> None:
        # a copy (deepcopy, unpickling) is a module of its own in the custom ops
        super().__setstate__(state)
        self._op_handle = register(self)

    @classmethod
    def from_traced(
        cls,
        qkv_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        spec: TracedSpec,
        custom_fwd_inputs: CustomIO | None = None,
        *,
        backend: str = "auto",
        config: KernelConfig | None = None,
        backward_config: KernelConfig | None = None,
        tune_file: str | None = None,
    ) -> AttentionEngine:
        """A module for an already traced spec. The tuner's worker processes receive the spec
        by pickling (the user's hook functions may not pickle) and build modules with this."""
        if not isinstance(spec, TracedSpec):
            raise ValueError(f"spec: expected a TracedSpec, got {type(spec).__name__}")
        mod = cls(qkv_meta, custom_fwd_inputs, backend=backend, config=config,
                  backward_config=backward_config, tune_file=tune_file)
        mod.spec = spec
        return mod

    # ------------------------------------------------------------------ introspection
    @property
    def spec_hash(self) -> str:
        return self.spec.hash

    @property
    def ir_text(self) -> str:
        """The traced IR: the spec, then the q/k/v mods (not part of the spec or its hash)."""
        text = self.spec.describe()
        return text if self.qkv_mods is None else f"{text}\n{self.qkv_mods.describe()}"

    @property
    def kernel_source(self) -> str:
        """The generated TileLang program of the forward kernel (generated on demand)."""
        return self.forward_kernel().source

    # ------------------------------------------------------------------ kernels
    @property
    def kernel_cache(self) -> KernelCache:
        """The kernels this module has built (engine.runtime.kernel_cache)."""
        return self._kernel_cache

    def kernel_request(self) -> KernelRequest:
        """What selects this module's kernels now: its spec, problem, dtype and options (the
        request is kept while they stay the same: building it per call cost host time)."""
        values = (self.config, self.backward_config, self.tune_file, bool(self.dynamic_shapes),
                  bool(self.deterministic), self.decode_config)
        req = self._request
        if req is None or self._request_values != values or req.spec is not self.spec:
            req = self._request = KernelRequest(self.spec, self.problem, self.dtype,
                                                KernelOptions(*values))
            self._request_values = values
        return req

    def forward_kernel(self) -> ForwardKernel:
        """The forward kernel (generated, not compiled): its source, config and tables."""
        return self._kernel_cache.forward(self.kernel_request())

    def backward_kernels(self, config: KernelConfig | None = None,
                         custom_grads: tuple[str, ...] = (),
                         deterministic: bool | None = None) -> BackwardKernels:
        """The backward's kernels (generated, not compiled), also producing the gradients of
        the CustomIO tensors in `custom_grads`; `config` and `deterministic` default to the
        module's (its backward_config, tune file or default; its deterministic)."""
        return self._kernel_cache.backward(self.kernel_request(), config, tuple(custom_grads),
                                           deterministic)

    def backward_problem(self, custom_grads: tuple[str, ...] = ()) -> str | None:
        """Why this module's backward (with the gradients of `custom_grads`) would not run as
        generated kernels but by the reference rules (None: it runs the kernels)."""
        from engine.runtime.tilelang_backend import backward_problem

        return backward_problem(self._kernel_cache, self.kernel_request(), tuple(custom_grads))

    def kernel_sources(self, modes: tuple[str, ...] = ("fwd",)) -> list[str]:
        """The TileLang sources this module runs for `modes` ("fwd", "bwd"): the forward, and
        the backward's kernels where they can run."""
        sources = self.forward_kernel().sources()
        if "bwd" in modes and self.backward_problem() is None:
            sources += self.backward_kernels().sources()
        return sources

    def compile_kernels(self, modes: tuple[str, ...] = ("fwd",)) -> None:
        """nvcc-compile the kernels of `modes` now (no GPU needed; the first call then only
        loads them). A "bwd" mode whose backward cannot run as kernels raises ValueError."""
        self.forward_kernel().compile()
        if "bwd" in modes:
            reason = self.backward_problem()
            if reason is not None:
                raise ValueError(f"modes: no backward kernels to compile ({reason})")
            self.backward_kernels().compile()

    def extra_repr(self) -> str:
        p = self.problem
        return (
            f"spec={self.spec.hash}, online={self.spec.online_name}, B={p.batch}, Hq={p.heads_q}, "
            f"Hkv={p.heads_kv}, Sq={p.seqlen_q}, Skv={p.seqlen_kv}, D={p.head_dim}, "
            f"Dv={p.head_dim_v}, dtype={self.dtype}, backend={self.backend_name}"
        )

    # ------------------------------------------------------------------ call
    def _check_inputs(self, q, k, v, args, kwargs) -> list[torch.Tensor]:
        device = None
        for name, t, want in zip("qkv", (q, k, v), self._qkv_shapes, strict=True):
            expect_tensor(name, t)
            if t.shape != want:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} does not match qkv_meta; expected "
                    f"{want} (runtime layout [B, S, H, D])"
                )
            device = device or t.device
            check_placement(name, t, self.dtype, device)
        return self._check_customs(args, kwargs, device)

    def _check_customs(self, args, kwargs, device: torch.device) -> list[torch.Tensor]:
        """The CustomIO tensors, positional or by name, in declaration order (checked)."""
        if not args and not kwargs and not self.custom_io.decls:
            return []  # none declared, none given: the common call, kept cheap
        return bind_customs(self.custom_io, args, kwargs, self.problem.named_sizes(), device)

    def resolved_backend(self, device: torch.device) -> str:
        backend, fallback = choose_backend(self.backend_name, device, self.dtype)
        if fallback is not None:
            log_once(f"engine: running the reference executor ({fallback})")
            if self.tune:
                log_once("engine: tune=True has nothing to tune on the reference executor")
        return backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *custom: torch.Tensor,
        return_lse: bool = False,
        cache_seqlens: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        **named: torch.Tensor,
    ):
        if cache_seqlens is not None or block_table is not None:
            if return_lse:
                raise ValueError("return_lse: decode (cache_seqlens=) returns o only")
            return self.decode(q, k, v, *custom, cache_seqlens=cache_seqlens,
                               block_table=block_table, **named)
        customs = self._check_inputs(q, k, v, custom, named)
        if self.qkv_mods is not None:
            q, k, v, customs = self._apply_mods(q, k, v, customs)
        if torch.compiler.is_compiling():  # one opaque op for the compiler (engine.runtime.ops)
            o, finals = compiled_forward(self, q, k, v, customs)
        else:
            o, finals = self.eager_forward(q, k, v, customs)
        return (o, finals) if return_lse else o

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               *custom: torch.Tensor, cache_seqlens: torch.Tensor | None = None,
               block_table: torch.Tensor | None = None, **named: torch.Tensor) -> torch.Tensor:
        """o [B, Sq, Hq, Dv] of the Sq new tokens of q against the KV cache (see the class
        docstring); what `mod(q, k_cache, v_cache, cache_seqlens=...)` runs."""
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: required for decode (int32 [B], the cache lengths)")
        if self.qkv_mods is not None:
            raise NotImplementedError("query_mod/key_mod/value_mod with a KV cache: apply them "
                                      "to q and to the keys and values as they enter the cache")
        page_size, num_pages = check_decode_args(self.problem, self.dtype, q, k_cache, v_cache,
                                                 cache_seqlens, block_table)
        customs = self._check_customs(custom, named, q.device)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache,
                                                                      *customs)):
            raise ValueError("decode computes no gradients: call it under torch.no_grad() or "
                             "torch.inference_mode(), or detach the inputs")
        if self.check_cache_values:
            check_decode_values(cache_seqlens, block_table, self.problem.seqlen_q,
                                self.problem.seqlen_kv, page_size, num_pages)
        cd = dict(zip(self.custom_io.names(), customs, strict=True))
        if self.resolved_backend(q.device) == "reference":
            return decode_forward(self.spec, q, k_cache, v_cache, cd, cache_seqlens,
                                  block_table).to(q.dtype)
        dk = self.decode_kernels(page_size, num_pages, gpu_sm_count(q.device))
        return launch_decode(dk, q, k_cache, v_cache, cd, cache_seqlens, block_table)

    def decode_kernels(self, page_size: int = 0, num_pages: int = 0,
                       sm_count: int = 132) -> DecodeKernels:
        """The decode kernels (generated, not compiled) for a contiguous cache, or a paged one
        of `num_pages` pages of `page_size`, on a GPU of `sm_count` SMs (an H100's 132)."""
        req = self.kernel_request()
        key = (page_size, num_pages, sm_count, self._kernel_cache.generation)
        last = self._decode_last
        if last is not None and last[0] is req and last[1] == key:
            return last[2]  # the call path's fast lookup (host time per decode step)
        if self.merge is None:
            log_once(f"engine: {self.spec.online_name} has no merge rule (combine_online or "
                      "combine): decode runs one split per (batch, kv head)")
        shape = DecodeShape(**self.problem.sizes(), dtype=KERNEL_DTYPES[self.dtype],
                            page_size=page_size, num_pages=num_pages)
        dk = self._kernel_cache.decode(req, shape, self.merge, sm_count)
        self._decode_last = (req, key, dk)
        return dk

    def _apply_mods(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    customs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, list[torch.Tensor]]:
        """The q/k/v mods' pre-pass: modded q, k, v, and the custom tensors for the attention,
        those only the mods differentiate detached (engine.ir.tensor_mods.mod_only_customs)."""
        names = self.custom_io.names()
        q, k, v = apply_qkv_mods(self.qkv_mods, q, k, v, dict(zip(names, customs, strict=True)))
        customs = [c.detach() if n in self._mod_only_customs else c
                   for n, c in zip(names, customs, strict=True)]
        return q, k, v, customs

    def eager_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      customs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """(o, final row scales) of checked inputs, through the module's autograd Function."""
        if self.resolved_backend(q.device) == "tilelang":
            from engine.runtime.tilelang_backend import run as run_kernels

            if self.tune and not self._kernel_cache.tune_checked:
                self._tune_first(q, k, v, customs)
            o, finals = run_kernels(self._kernel_cache, self.kernel_request(), q, k, v, customs)
        else:
            from engine.runtime.reference_backend import run as run_reference

            o, finals = run_reference(self.spec, tuple(self.custom_io.names()), q, k, v, customs)
        return o, finals

    def _tune_first(self, q, k, v, customs: list[torch.Tensor]) -> None:
        """tune=True: once per module, before its kernels are built, tune a shape without an
        exact tune-file entry; the kernels then pick the new entry up like any other."""
        from engine.tuning.autotune import ensure_tuned

        self._kernel_cache.tune_checked = True
        ensure_tuned(self.kernel_request(), q, k, v, customs)
        self._kernel_cache.clear()
