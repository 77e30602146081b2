"""The engine itself: `engine` (generated TileLang kernels) and `reference` (its reference
executor, plain torch on any device). Both also run decode cases (attnbench.decode) through the
module's cache call, `mod(q, k_cache, v_cache, *customs, cache_seqlens=, block_table=)`, and
linear cases (attnbench.linear) through the variant's LinearAttentionEngine,
`mod(q, k, v, decay, *customs)` (a continuation with `initial_state=` and
`output_final_state=True`)."""

from __future__ import annotations

import dataclasses
import inspect
import time

from attnbench.cases import Case
from attnbench.decode import DECODE_TENSORS, decode_customs
from attnbench.impls.base import (
    ALL_DTYPES,
    GRAD_MODES,
    HALF,
    TORCH_DTYPES,
    Capabilities,
    DeviceInfo,
    Impl,
    Prepared,
    Unsupported,
    grad_leaves,
    learnable_customs,
    learnable_leaves,
)
from attnbench.linear import STATE, build_linear, linear_args


def _decode_refusal(exc: BaseException) -> str | None:
    # the engine says NotImplementedError for a spec its decode kernels cannot run yet
    return f"engine decode: {exc}" if isinstance(exc, NotImplementedError) else None


def _linear_refusal(exc: BaseException) -> str | None:
    # NotImplementedError: a linear kernel (e.g. the backward) that has not been built yet
    return f"engine linear: {exc}" if isinstance(exc, NotImplementedError) else None


class _EngineBase(Impl):
    backend = ""
    dynamic_shapes: bool | None = None  # None: the engine's default (engine.kernels.attention_fwd.plan)
    deterministic = False
    save_states = False  # linear: the forward keeps its states for the backward
    decode = False  # runs decode cases (the module's cache call)
    linear = False  # runs linear cases (the variant's LinearAttentionEngine)

    def kinds(self, base: frozenset[str]) -> frozenset[str]:
        """The case kinds of `base` plus decode and linear where this implementation runs them."""
        return (base | ({"decode"} if self.decode else set())
                | ({"linear"} if self.linear else set()))

    def check_modes(self, case: Case, variant, device: DeviceInfo) -> dict[str, str | None]:
        if case.kind != "linear":
            return super().check_modes(case, variant, device)
        # the modes this implementation times; a linear kernel not built yet refuses its
        # call (_linear_refusal) rather than a rule here
        reason = self.check(case, variant, device)
        return {m: reason or self.caps.check_mode(m) for m in case.modes}

    def check(self, case: Case, variant, device: DeviceInfo) -> str | None:
        reason = super().check(case, variant, device)
        if reason is None and case.kind != "linear":
            dims = dict(head_dim=case.head_dim, head_dim_v=case.head_dim_v,
                        heads_q=case.heads_q, heads_kv=case.heads_kv)
            if "seqlen_q" in inspect.signature(variant.supports).parameters:
                dims.update(seqlen_q=case.seqlen_q, seqlen_kv=case.seqlen_kv)
            reason = variant.supports(**dims)
        return reason

    def build(self, case: Case, variant):
        """The engine module for `case`, with this implementation's settings."""
        mod = variant.build(
            batch=case.batch, heads_q=case.heads_q, heads_kv=case.heads_kv,
            seqlen_q=case.seqlen_q, seqlen_kv=case.seqlen_kv, head_dim=case.head_dim,
            head_dim_v=case.head_dim_v, dtype=TORCH_DTYPES[case.dtype], backend=self.backend,
        )
        if self.dynamic_shapes is not None:
            mod.dynamic_shapes = self.dynamic_shapes
        mod.deterministic = self.deterministic
        return mod

    def checked_build(self, case: Case, variant, needs_grad: bool):
        """build(), refused (Unsupported) where the kernels cannot run the variant: never time
        the reference rules as if they were the engine's backward kernel."""
        try:
            mod = self.build(case, variant)
        except NotImplementedError as exc:  # kernels for this variant have not landed yet
            raise Unsupported(f"engine backend {self.backend!r} not implemented: {exc}") from exc
        if needs_grad and self.backend == "tilelang":
            reason = mod.backward_problem(tuple(variant.learnable))
            if reason is not None:
                raise Unsupported(f"engine backward: {reason}", modes=GRAD_MODES)
        return mod

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        if case.kind == "decode":
            return self.prepare_decode(case, variant, inputs)
        if case.kind == "linear":
            return self.prepare_linear(case, variant, inputs, needs_grad)
        return self.prepare_module(self.checked_build(case, variant, needs_grad), variant,
                                   inputs, needs_grad)

    def prepare_decode(self, case: Case, variant, inputs: dict) -> Prepared:
        """The module built for q of Sq tokens and K/V of the cache capacity, called on the
        cache; its first call (kernel compile) is timed into compile_s."""
        import torch

        mod = self.checked_build(case, variant, False)
        customs = decode_customs(inputs)
        args = [customs[n] for n in mod.custom_io.names()]
        q, k_cache, v_cache, lens, table = (inputs[n] for n in DECODE_TENSORS)

        def forward():
            return mod(q, k_cache, v_cache, *args, cache_seqlens=lens, block_table=table)

        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                forward()  # with the module's value check of the lengths and the table
        except NotImplementedError as exc:
            raise Unsupported(_decode_refusal(exc) or str(exc)) from exc
        if q.is_cuda:
            torch.cuda.synchronize()
        # Timed as a server runs it (a captured CUDA graph): the checked values do not change,
        # and the check's host synchronisation per call is not part of FA3's time either.
        mod.check_cache_values = False
        return Prepared(forward=forward, compile_s=time.perf_counter() - t0,
                        refusal=_decode_refusal)

    def prepare_linear(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        """The LinearAttentionEngine called on fresh leaves of q, k, v and of the variant's
        learnable inputs (attnbench.linear.linear_args)."""
        try:
            mod = build_linear(case, variant, self.backend)
        except NotImplementedError as exc:
            raise Unsupported(f"engine linear backend {self.backend!r} not implemented: {exc}"
                              ) from exc
        mod.save_states = self.save_states
        q, k, v = grad_leaves(inputs, needs_grad)
        args, learned = linear_args(variant, inputs, needs_grad)
        state = {} if STATE not in inputs else {"initial_state": inputs[STATE],
                                                "output_final_state": True}

        def forward():
            return mod(q, k, v, *args, **state)

        return Prepared(forward=forward, leaves=(q, k, v, *learned), refusal=_linear_refusal,
                        extra={"module": mod})

    @staticmethod
    def prepare_module(mod, variant, inputs: dict, needs_grad: bool) -> Prepared:
        """`mod` called on fresh leaves of q, k, v and of the variant's learnable inputs."""
        q, k, v = grad_leaves(inputs, needs_grad)
        others = learnable_customs(variant, inputs, needs_grad)

        def forward():
            return mod(q=q, k=k, v=v, **others)

        return Prepared(forward=forward, leaves=(q, k, v, *learnable_leaves(variant, others)),
                        extra={"module": mod})


class EngineImpl(_EngineBase):
    name = "engine"
    description = "the engine's generated TileLang kernels (variant.build(backend='tilelang'))"
    backend = "tilelang"
    decode = True
    linear = True

    @property
    def caps(self) -> Capabilities:
        # Backward modes only with the generated backward kernels on (prepare() also skips a
        # spec they cannot run): the reference rules must never be timed as the engine.
        from engine import kernel_backward_enabled

        modes = {"fwd", "bwd", "fwd+bwd"} if kernel_backward_enabled() else {"fwd"}
        return Capabilities(
            devices=frozenset({"cuda"}), dtypes=HALF, min_capability=(9, 0),
            cuda_reason="needs a Hopper GPU", modes=frozenset(modes),
            kinds=self.kinds(frozenset({"attention"})),
        )


class ReferenceImpl(_EngineBase):
    name = "reference"
    description = "the engine's reference executor (plain torch, any device)"
    backend = "reference"
    gpu_only = False
    decode = True
    linear = True

    @property
    def caps(self) -> Capabilities:
        # it may materialise the score matrix: bound it (2^31 fp32 scores = 8 GiB)
        return Capabilities(
            devices=frozenset({"cpu", "cuda"}), dtypes=ALL_DTYPES,
            kinds=self.kinds(frozenset({"attention"})), max_score_elems=2**31,
        )


class EngineDynamicImpl(EngineImpl):
    """The engine's forward with batch and sequence lengths as runtime symbols, timed beside
    `engine` (static shapes) to decide whether dynamic shapes cost speed."""

    name = "engine-dynamic"
    description = "the engine's kernels compiled once for every batch and sequence length"
    dynamic_shapes = True
    decode = False  # its own call path has no cache form
    linear = False


class EngineDeterministicImpl(EngineImpl):
    """The engine's atomic-free backward (bitwise repeatable gradients), timed beside `engine`
    to measure what determinism costs. Its forward is `engine`'s, so only backward modes."""

    name = "engine-deterministic"
    description = "the engine's kernels with deterministic=True (atomic-free backward)"
    deterministic = True
    decode = False  # its own call path has no cache form
    linear = False

    @property
    def caps(self) -> Capabilities:
        base = super().caps
        return dataclasses.replace(base, modes=base.modes - {"fwd"})


class EngineSavedStatesImpl(EngineImpl):
    """The linear engine keeping its forward's per-chunk states for the backward, which then
    skips its state pass (LinearAttentionEngine(save_states=True)), timed beside `engine`,
    which recomputes them as fla and mamba_ssm do: the rows' peak memory and latency give the
    trade. Its forward is `engine`'s, so only linear cases' backward modes."""

    name = "engine-saved-states"
    description = "the engine's linear kernels with save_states=True (no state pass again)"
    save_states = True
    decode = False

    @property
    def caps(self) -> Capabilities:
        base = super().caps
        return dataclasses.replace(base, modes=base.modes - {"fwd"},
                                   kinds=frozenset({"linear"}))


class EngineFlexImpl(EngineImpl):
    """The functions FlexAttention runs (the variant's flex form), through engine.flex_attention
    with engine.create_block_mask: what a user gets by changing one import, timed beside
    `engine` (the same spec through AttentionEngine)."""

    name = "engine-flex"
    description = "engine.flex_attention with the variant's FlexAttention functions"
    decode = False  # its own call path has no cache form
    linear = False

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        from attnbench.impls.flex import flex_functions
        from engine import create_block_mask, flex_attention

        customs = learnable_customs(variant, inputs, needs_grad)
        score_mod, mask_mod = flex_functions(case, variant, {**inputs, **customs})
        self.checked_build(case, variant, needs_grad)  # the same spec's refusals
        block_mask = None if mask_mod is None else create_block_mask(
            mask_mod, case.batch, case.heads_q, case.seqlen_q, case.seqlen_kv)
        scale = (variant.sdpa_kwargs(inputs) or {}).get("scale")
        gqa = case.heads_q != case.heads_kv
        q, k, v = grad_leaves(inputs, needs_grad)  # [B, S, H, D]: a model's q/k/v before
        # the transpose it makes for FlexAttention, so the views below copy nothing

        def forward():
            out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 score_mod=score_mod, block_mask=block_mask, scale=scale,
                                 enable_gqa=gqa)
            return out.transpose(1, 2)

        return Prepared(forward=forward, leaves=(q, k, v, *learnable_leaves(variant, customs)))


class EngineCompiledImpl(EngineImpl):
    """The module inside torch.compile(fullgraph=True, mode="reduce-overhead"): its custom ops
    in one compiled graph, replayed as a CUDA graph (q, k, v and the custom tensors at static
    addresses, so no input copies), timed beside `engine`. A mask that reads tensors is
    classified inside the graph (engine.runtime.mask_tables), which its rows include. The
    `bwd` mode (a backward replayed on a kept graph) does not apply to a CUDA graph."""

    name = "engine-compiled"
    description = "the engine module under torch.compile(fullgraph=True, mode='reduce-overhead')"
    decode = False  # its own call path has no cache form
    linear = False

    @property
    def caps(self) -> Capabilities:
        base = super().caps
        return dataclasses.replace(base, modes=base.modes - {"bwd"})

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        import time

        import torch

        mod = self.checked_build(case, variant, needs_grad)
        p = self.prepare_module(mod, variant, inputs, needs_grad)
        for t in p.leaves:
            torch._dynamo.mark_static_address(t)
        torch._dynamo.reset()
        compiled = torch.compile(p.forward, fullgraph=True, mode="reduce-overhead")
        t0 = time.perf_counter()
        for _ in range(3):  # compile, then record the CUDA graph(s)
            out = compiled()
            if needs_grad:
                torch.autograd.grad(out, p.leaves, torch.ones_like(out))
        torch.cuda.synchronize()
        return dataclasses.replace(p, forward=compiled, compile_s=time.perf_counter() - t0)
