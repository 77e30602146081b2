"""The linear-attention kernels behind LinearAttentionEngine: chunked forward and backward,
and the recurrent step, as one autograd function of the core problem

    o_t = sum_{s <= t} (q_t . k_s) exp(G_t - G_s) v_s  (+ q_t exp(G_t) h0),  G = cumsum(g)

with q [B, HQ, T, D], k [B, HK, T, D], v [B, H, T, Dv] (HQ and HK divide H; output head h
reads q head h // (H // HQ) and k head h // (H // HK)), g [B, H, T] float32 (log decays,
after the decay mod), initial state h0 [N, H, D, Dv] float32 (N = B, or the number of packed
sequences when cu_seqlens, int32 [N + 1], is given and B == 1).
"""

from __future__ import annotations

import torch

from engine.dtypes import KERNEL_DTYPES
from engine.kernels.linear_bwd.launch import BackwardKernels, build_backward, launch_backward
from engine.kernels.linear_fwd.launch import ForwardKernels, build_forward, launch_forward
from engine.kernels.linear_fwd.plan import (
    NO_FOLDS,
    Folds,
    LinearConfig,
    LinearShape,
    config_for_shape,
)
from engine.kernels.linear_step.launch import StepKernels, build_step, launch_step
from engine.kernels.linear_step.plan import MAX_STEP_TOKENS, StepConfig, default_step_config
from engine.plan.config import ConfigError


class LinearKernelCache:
    """The kernels one LinearAttentionEngine has built, by shape and config; `deterministic`
    (settable: later backwards build and run their own kernels): backward kernels without
    atomics (engine.kernels.linear_bwd.plan)."""

    def __init__(self, deterministic: bool = False) -> None:
        self.kernels: dict = {}
        self.deterministic = deterministic

    def clear(self) -> None:
        self.kernels.clear()

    def forward(self, shape: LinearShape, cfg: LinearConfig, folds: Folds = NO_FOLDS
                ) -> ForwardKernels:
        key = ("fwd", shape, cfg, folds)
        if key not in self.kernels:
            self.kernels[key] = build_forward(shape, cfg, folds)
        return self.kernels[key]

    def backward(self, shape: LinearShape, cfg: LinearConfig, folds: Folds = NO_FOLDS
                 ) -> BackwardKernels:
        key = ("bwd", shape, cfg, folds, self.deterministic)
        if key not in self.kernels:
            self.kernels[key] = build_backward(shape, cfg, folds, self.deterministic)
        return self.kernels[key]

    def step(self, shape: LinearShape, cfg: StepConfig | None = None, folds: Folds = NO_FOLDS
             ) -> StepKernels:
        key = ("step", shape, cfg, folds)  # None: the default, not rebuilt per call
        if key not in self.kernels:
            self.kernels[key] = build_step(
                shape, cfg or default_step_config(shape.head_dim, shape.head_dim_v), folds)
        return self.kernels[key]


def linear_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_seqlens: torch.Tensor | None) -> LinearShape:
    B, HQ, T, D = q.shape
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q: dtype {q.dtype}; the linear kernels take float16 or bfloat16 "
                         "(backend='reference' runs any float dtype)")
    return LinearShape(batch=B, heads_q=HQ, heads_k=k.shape[1], heads=v.shape[1], seqlen=T,
                       head_dim=D, head_dim_v=v.shape[3], dtype=KERNEL_DTYPES[q.dtype],
                       sequences=0 if cu_seqlens is None else cu_seqlens.numel() - 1)


def configs(shape: LinearShape, config: LinearConfig | None,
            backward_config: LinearConfig | None) -> tuple[LinearConfig, LinearConfig]:
    """The forward's config and the backward's (which must share its chunk: the kernels read
    the forward's per-chunk decay sums and states; a ConfigError, as a config that does not
    fit)."""
    fwd = config or config_for_shape(shape)
    bwd = backward_config or fwd
    if bwd.chunk != fwd.chunk:
        raise ConfigError(f"backward_config: chunk {bwd.chunk} must equal the forward's "
                         f"chunk {fwd.chunk}")
    return fwd, bwd


class _ChunkedLinear(torch.autograd.Function):
    """o = core(q_scale * q, k, w * v, g, h0) with the folds (Folds) applied in the kernels,
    the backward's too (they read do as given and give dv and dw)."""

    @staticmethod
    def forward(ctx, cache, shape, fwd_cfg, bwd_cfg, folds, q, k, v, g, h0, w, cu_seqlens,
                want_final, save_states):
        fk = cache.forward(shape, fwd_cfg, folds)
        o, state = launch_forward(fk, q, k, v, g, h0, cu_seqlens, want_final, w, save_states)
        ctx.cache, ctx.shape, ctx.bwd_cfg, ctx.fk, ctx.state = cache, shape, bwd_cfg, fk, state
        ctx.save_for_backward(q, k, v, h0)  # the decays and weights: in state.slot_data
        ctx.set_materialize_grads(False)  # an unused final state sends no gradient
        return o, state.final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, h0 = ctx.saved_tensors
        if do is None:  # only the final state is used
            s = ctx.shape
            do = q.new_zeros(s.batch, s.heads, s.seqlen, s.head_dim_v)
        bk = ctx.cache.backward(ctx.shape, ctx.bwd_cfg, ctx.fk.folds)
        initial_grad = h0 is not None and ctx.needs_input_grad[9]
        dq, dk, dv, dg, dh0, dw = launch_backward(
            ctx.fk, bk, q, k, v, ctx.state, h0, do.contiguous(),
            None if dht is None else dht.contiguous(), initial_grad,
            decay_grad=ctx.needs_input_grad[8])
        dw = dw if ctx.needs_input_grad[10] else None
        return None, None, None, None, None, dq, dk, dv, dg, dh0, dw, None, None, None


def run(cache: LinearKernelCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        g: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
        output_final_state: bool, config: LinearConfig | None = None,
        backward_config: LinearConfig | None = None, step_config: StepConfig | None = None,
        q_scale: float = 1.0, v_weight: torch.Tensor | None = None, save_states: bool = False
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o [B, H, T, Dv] in q's dtype, final state [N, H, D, Dv] float32 or None), differentiable
    in q, k, v, g, initial_state and v_weight (inputs already checked and contiguous), of the
    problem with q_scale * q in place of q and v_weight[..., None] * v in place of v
    (v_weight [B, H, T] float32: a v mod that is a per-position factor), both folded into the
    forward's kernels. A call of at most MAX_STEP_TOKENS positions per row that needs no
    gradient runs the recurrent step. save_states: a training call's forward keeps its
    per-chunk states for the backward, which then skips its state pass."""
    shape = linear_shape(q, k, v, cu_seqlens)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    g = g.float().contiguous()
    w = None if v_weight is None else v_weight.float().contiguous()
    folds = Folds(q_scale=float(q_scale), v_weight=w is not None)
    if is_step(shape, q, k, v, g, h0, w):
        o, ht = launch_step(cache.step(shape, step_config, folds), q, k, v, g, h0, w)
        return o, (ht if output_final_state else None)
    fwd, bwd = configs(shape, config, backward_config)
    if not needs_grad(q, k, v, g, h0, w):  # inference: the kernels without the autograd Function
        o, state = launch_forward(cache.forward(shape, fwd, folds), q, k, v, g, h0, cu_seqlens,
                                  output_final_state, w)
        return o, state.final
    o, ht = _ChunkedLinear.apply(cache, shape, fwd, bwd, folds, q, k, v, g, h0, w, cu_seqlens,
                                 output_final_state, save_states)
    return o, (ht if output_final_state else None)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will differentiate a call on these tensors (a training step)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def is_step(shape: LinearShape, *tensors: torch.Tensor | None) -> bool:
    """Whether a call runs the recurrent step: few positions, equal rows, no gradient."""
    return not (shape.sequences or shape.seqlen > MAX_STEP_TOKENS or needs_grad(*tensors))


def kernel_sources(cache: LinearKernelCache, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, config: LinearConfig | None = None,
                   backward_config: LinearConfig | None = None,
                   modes: tuple[str, ...] = ("fwd",), *, initial_state: bool = False,
                   final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                   folds: Folds = NO_FOLDS, decay_grad: bool = True,
                   save_states: bool = False) -> list[str]:
    """The TileLang sources run for tensors shaped as q, k, v (meta tensors will do): the
    forward's, and with "bwd" in `modes` a training call's forward and backward, of a call
    with an initial state or not and returning the final state or not (the backward then
    takes that state's gradient and gives the initial state's), packed by `cu_seqlens` or
    not, whose decays need a gradient (`decay_grad`) or not, keeping the forward's states
    (`save_states`, training only) or not."""
    shape = linear_shape(q, k, v, cu_seqlens)
    fwd, bwd = configs(shape, config, backward_config)
    fk = cache.forward(shape, fwd, folds)
    training = "bwd" in modes
    out = fk.sources(initial_state, final_state, save_states and training)
    if training:  # the backward reruns the state pass (no final state) unless kept
        out += [*([] if save_states else [fk.states(initial_state, False).source]),
                *cache.backward(shape, bwd, folds).sources(final_state, initial_state,
                                                                     decay_grad)]
    return list(dict.fromkeys(out))
