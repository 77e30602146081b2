"""Build and launch the chunked backward: the forward's state pass again (the per-chunk
states are recomputed unless the forward kept them: they hold chunks x D x Dv per head), the
reverse state pass and the dV kernel (or, where the config has single_pass, the reverse single
pass doing both: linear_bwd.reverse), and the dQ/dK kernel (which gives the decays' gradient
too); then the sums over key tiles, value tiles and heads that share q or k."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from engine.dtypes import elem_bytes
from engine.kernels.linear_bwd.codegen import (
    GradOutput,
    dqk_outputs,
    generate_dqk,
    generate_dstates,
    generate_dv,
)
from engine.kernels.linear_bwd.plan import reverse_config, shared_heads_by_atomics
from engine.kernels.linear_bwd.reverse import generate_reverse
from engine.kernels.linear_fwd.launch import (
    ForwardKernels,
    ForwardState,
    run_states,
    seq_state_buffer,
)
from engine.kernels.linear_fwd.plan import (
    NO_FOLDS,
    Folds,
    LinearConfig,
    LinearShape,
    backward_config_problems,
    check_config,
    runs_single_pass,
)
from engine.runtime.kernel import Kernel


@dataclass
class BackwardKernels:
    shape: LinearShape
    config: LinearConfig
    # the forward's folds: value weights W (the kernels take them, dV's writes dW) and the q
    # scale (folded where the kernels meet q or dO: the output gradient is read as given)
    folds: Folds = NO_FOLDS
    # shared q/k heads' gradients by float32 atomics into them (plan.shared_heads_by_atomics)
    atomic: bool = False
    _dstates: dict[tuple[bool, bool], Kernel] = field(default_factory=dict)
    _reverse: dict[tuple[bool, bool], Kernel] = field(default_factory=dict)
    _dqk: dict[bool, Kernel] = field(default_factory=dict)

    @property
    def v_weight(self) -> bool:
        return self.folds.v_weight

    @property
    def single_pass(self) -> bool:
        """Whether dS and dV come from the reverse single pass (else the reverse state pass
        and the dV kernel)."""
        return runs_single_pass(self.shape, self.config)

    def dstates(self, final_grad: bool, initial_grad: bool) -> Kernel:
        key = (final_grad, initial_grad)
        if key not in self._dstates:
            self._dstates[key] = Kernel(generate_dstates(self.shape, self.config, *key,
                                                         self.folds.q_scale))
        return self._dstates[key]

    def reverse(self, final_grad: bool, initial_grad: bool) -> Kernel:
        key = (final_grad, initial_grad)
        if key not in self._reverse:
            cfg = reverse_config(self.shape, self.config)
            self._reverse[key] = Kernel(generate_reverse(self.shape, cfg, *key, self.folds))
        return self._reverse[key]

    @functools.cached_property
    def dv(self) -> Kernel:
        return Kernel(generate_dv(self.shape, self.config, self.folds))

    def dqk(self, decay_grad: bool = True) -> Kernel:
        """The dQ/dK kernel, giving the decays' gradient too with `decay_grad`."""
        if decay_grad not in self._dqk:
            self._dqk[decay_grad] = Kernel(generate_dqk(self.shape, self.config, self.folds,
                                                        decay_grad, self.atomic))
        return self._dqk[decay_grad]

    def kernels(self, final_grad: bool = False, initial_grad: bool = False,
                decay_grad: bool = True) -> list[Kernel]:
        """The kernels a backward runs, in order."""
        first = ([self.reverse(final_grad, initial_grad)] if self.single_pass
                 else [self.dstates(final_grad, initial_grad), self.dv])
        return [*first, self.dqk(decay_grad)]

    def sources(self, final_grad: bool = False, initial_grad: bool = False,
                decay_grad: bool = True) -> list[str]:
        return [k.source for k in self.kernels(final_grad, initial_grad, decay_grad)]

    def compile(self, final_grad: bool = False, initial_grad: bool = False,
                decay_grad: bool = True) -> None:
        for k in self.kernels(final_grad, initial_grad, decay_grad):
            k.compiled()


def build_backward(shape: LinearShape, cfg: LinearConfig, folds: Folds = NO_FOLDS,
                   deterministic: bool = False) -> BackwardKernels:
    """The backward kernels at `shape` and `cfg` (checked; its chunk must be the forward's)
    of a forward with `folds` (value weights: they read v and the weights; a q scale);
    `deterministic`: no atomics (plan.shared_heads_by_atomics)."""
    check_config(cfg, shape.head_dim, shape.head_dim_v, elem_bytes(shape.dtype),
                 backward_config_problems)
    return BackwardKernels(shape, cfg, folds, shared_heads_by_atomics(shape, deterministic))


def _group_sum(x: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-output-head gradients [B, H, T, D] summed over the heads sharing one of `heads`."""
    B, H, T, D = x.shape
    return x.view(B, heads, H // heads, T, D).sum(2).to(dtype)


def launch_backward(fk: ForwardKernels, bk: BackwardKernels, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, fwd: ForwardState, initial_state: torch.Tensor | None,
                    do: torch.Tensor, dht: torch.Tensor | None, initial_grad: bool,
                    decay_grad: bool = True) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dg [B, H, T] fp32 (None without `decay_grad`), dh0 or None, dw or None)
    of the problem with bk's folds: with value weights w [B, H, T] float32 (folded into fk's
    and bk's kernels), w * v in place of v, and dw [B, H, T] float32; with a q scale,
    q_scale * q in place of q (`do` is the output's gradient as given). The kernels read the
    decays' chunk sums (and the value weights) by slot from the forward's decay kernel
    (fwd.slot_data: Gc, Wc), not the decays again."""
    s = bk.shape
    tb, dev = fwd.tables, q.device
    hs = fwd.states
    if hs is None:  # not kept by the forward (launch_forward's save_states): again
        hs, _ = run_states(fk, k, v, tb, fwd.slot_data, initial_state, False)
    common = {**fwd.slot_data, "Seqs": tb.seqs, "Chunks": tb.chunks}
    dhs = torch.empty_like(hs)
    dv, dh0, dw = _run_state_gradients(bk, q, k, v, common, do, dhs, dht, initial_grad)
    outs = dqk_outputs(s, bk.atomic)
    dq, dk = (_output(o, s, dev) for o in outs)
    nk = s.head_dim // bk.config.block_K
    dgp = (torch.empty(nk, s.batch, s.heads, s.seqlen, dtype=torch.float32, device=dev)
           if decay_grad else None)
    bk.dqk(decay_grad)(Q=q, K=k, V=v, dO=do, **common, Hs=hs, dHs=dhs,
                       **({"dG": dgp} if decay_grad else {}),
                       **{outs[0].name: dq, outs[1].name: dk})
    if s.heads_q != s.heads:
        dq = dq.to(q.dtype) if bk.atomic else _group_sum(dq, s.heads_q, q.dtype)
    if s.heads_k != s.heads:
        dk = dk.to(k.dtype) if bk.atomic else _group_sum(dk, s.heads_k, k.dtype)
    dg = None if dgp is None else _tile_sum(dgp)  # whole per key tile
    return dq, dk, dv, dg, dh0, dw


def _run_state_gradients(bk: BackwardKernels, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, common: dict, do: torch.Tensor,
                         dhs: torch.Tensor, dht: torch.Tensor | None, initial_grad: bool
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dv, dh0 or None, dw or None), writing dS leaving every chunk into `dhs`: the reverse
    single pass, or the reverse state pass then the dV kernel."""
    s, dev = bk.shape, q.device
    dv = torch.empty_like(v)
    args = {"dHt": dht} if dht is not None else {}
    dh0 = None
    if initial_grad:
        dh0 = args["dH0"] = seq_state_buffer(s, dev)
    if bk.single_pass:
        nv = s.head_dim_v // bk.config.block_V
        dwp = (torch.empty(nv, s.batch, s.heads, s.seqlen, dtype=torch.float32, device=dev)
               if bk.v_weight else None)
        bk.reverse(dht is not None, initial_grad)(
            Q=q, K=k, dO=do, **common, dHs=dhs, dV=dv, **args,
            **({"V": v, "dW": dwp} if bk.v_weight else {}))
        return dv, dh0, None if dwp is None else _tile_sum(dwp)
    dw = (torch.empty(s.batch, s.heads, s.seqlen, dtype=torch.float32, device=dev)
          if bk.v_weight else None)
    dstates = bk.dstates(dht is not None, initial_grad)  # pick: it takes no value weights
    dstates.launch(*dstates.pick({"Q": q, "dO": do, **common, "dHs": dhs, **args}))
    bk.dv(Q=q, K=k, dO=do, **common, dHs=dhs, dV=dv,
          **({"V": v, "dW": dw} if bk.v_weight else {}))
    return dv, dh0, dw


def _tile_sum(parts: torch.Tensor) -> torch.Tensor:
    """Per-tile shares [tiles, ...] (of dG by key tile, of dW by value tile) summed."""
    return parts.sum(0) if parts.shape[0] > 1 else parts[0]


def _output(out: GradOutput, s: LinearShape, device: torch.device) -> torch.Tensor:
    """The buffer the dQ/dK kernel writes `out` into (zeros for its atomics)."""
    alloc = torch.zeros if out.atomic else torch.empty
    return alloc(s.batch, out.heads, s.seqlen, s.head_dim, dtype=getattr(torch, out.dtype),
                 device=device)
