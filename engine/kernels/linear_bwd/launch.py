"""Build and launch the chunked backward: the forward's state pass again (the per-chunk
states are recomputed unless the forward kept them: they hold chunks x D x Dv per head), the
reverse state pass, the dV kernel and the dQ/dK kernel (which gives the decays' gradient
too); then the sums over key tiles and over heads that share q or k."""

from __future__ import annotations

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
from engine.kernels.linear_bwd.plan import shared_heads_by_atomics
from engine.kernels.linear_fwd.launch import (
    ForwardKernels,
    ForwardState,
    run_states,
    seq_state_buffer,
)
from engine.kernels.linear_fwd.plan import NO_FOLDS, Folds, LinearConfig, LinearShape, check_config
from engine.runtime.kernel import Kernel


@dataclass
class BackwardKernels:
    shape: LinearShape
    config: LinearConfig
    dv: Kernel
    # the forward's folds: value weights W (the kernels take them, dv writes dW) and the q
    # scale (folded where the kernels meet q or dO: the output gradient is read as given)
    folds: Folds = NO_FOLDS
    # shared q/k heads' gradients by float32 atomics into them (plan.shared_heads_by_atomics)
    atomic: bool = False
    _dstates: dict[tuple[bool, bool], Kernel] = field(default_factory=dict)
    _dqk: dict[bool, Kernel] = field(default_factory=dict)

    @property
    def v_weight(self) -> bool:
        return self.folds.v_weight

    def dstates(self, final_grad: bool, initial_grad: bool) -> Kernel:
        key = (final_grad, initial_grad)
        if key not in self._dstates:
            self._dstates[key] = Kernel(generate_dstates(self.shape, self.config, *key,
                                                         self.folds.q_scale))
        return self._dstates[key]

    def dqk(self, decay_grad: bool = True) -> Kernel:
        """The dQ/dK kernel, giving the decays' gradient too with `decay_grad`."""
        if decay_grad not in self._dqk:
            self._dqk[decay_grad] = Kernel(generate_dqk(self.shape, self.config, self.folds,
                                                        decay_grad, self.atomic))
        return self._dqk[decay_grad]

    def sources(self, final_grad: bool = False, initial_grad: bool = False,
                decay_grad: bool = True) -> list[str]:
        return [self.dstates(final_grad, initial_grad).source, self.dv.source,
                self.dqk(decay_grad).source]

    def compile(self, final_grad: bool = False, initial_grad: bool = False,
                decay_grad: bool = True) -> None:
        self.dstates(final_grad, initial_grad).compiled()
        self.dv.compiled()
        self.dqk(decay_grad).compiled()


def build_backward(shape: LinearShape, cfg: LinearConfig, folds: Folds = NO_FOLDS,
                   deterministic: bool = False) -> BackwardKernels:
    """The backward kernels at `shape` and `cfg` (checked; its chunk must be the forward's)
    of a forward with `folds` (value weights: they read v and the weights; a q scale);
    `deterministic`: no atomics (plan.shared_heads_by_atomics)."""
    check_config(cfg, shape.head_dim, shape.head_dim_v, elem_bytes(shape.dtype))
    return BackwardKernels(shape, cfg, Kernel(generate_dv(shape, cfg, folds)), folds,
                           shared_heads_by_atomics(shape, deterministic))


def _group_sum(x: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-output-head gradients [B, H, T, D] summed over the heads sharing one of `heads`."""
    B, H, T, D = x.shape
    return x.view(B, heads, H // heads, T, D).sum(2).to(dtype)


def launch_backward(fk: ForwardKernels, bk: BackwardKernels, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, g: torch.Tensor, fwd: ForwardState, initial_state: torch.Tensor | None,
                    do: torch.Tensor, dht: torch.Tensor | None, initial_grad: bool,
                    w: torch.Tensor | None = None, decay_grad: bool = True
                    ) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dg [B, H, T] fp32 (None without `decay_grad`), dh0 or None, dw or None)
    of the problem with bk's folds: with value weights w [B, H, T] float32 (folded into fk's
    and bk's kernels), w * v in place of v, and dw [B, H, T] float32; with a q scale,
    q_scale * q in place of q (`do` is the output's gradient as given)."""
    s = bk.shape
    tb, dev = fwd.tables, q.device
    hs = fwd.states
    if hs is None:  # not kept by the forward (launch_forward's save_states): again
        hs, _ = run_states(fk, k, v, tb, fwd.slot_data, initial_state, False)
    common = {"G": g, "Seqs": tb.seqs, "Chunks": tb.chunks}
    dw = (torch.empty(s.batch, s.heads, s.seqlen, dtype=torch.float32, device=dev)
          if bk.v_weight else None)
    weights = {"W": w} if bk.v_weight else {}  # both kernels read them; dV also v, writes dW
    dhs = torch.empty_like(hs)
    args = {"Q": q, "dO": do, **common, "dHs": dhs}
    if dht is not None:
        args["dHt"] = dht
    dh0 = None
    if initial_grad:
        dh0 = args["dH0"] = seq_state_buffer(s, dev)
    bk.dstates(dht is not None, initial_grad)(**args)
    dv = torch.empty_like(v)
    bk.dv(Q=q, K=k, dO=do, **common, dHs=dhs, dV=dv, **weights,
          **({"V": v, "dW": dw} if bk.v_weight else {}))
    outs = dqk_outputs(s, bk.atomic)
    dq, dk = (_output(o, s, dev) for o in outs)
    nk = s.head_dim // bk.config.block_K
    dgp = (torch.empty(nk, s.batch, s.heads, s.seqlen, dtype=torch.float32, device=dev)
           if decay_grad else None)
    bk.dqk(decay_grad)(Q=q, K=k, V=v, dO=do, **common, Hs=hs, dHs=dhs, **weights,
                       **({"dG": dgp} if decay_grad else {}),
                       **{outs[0].name: dq, outs[1].name: dk})
    if s.heads_q != s.heads:
        dq = dq.to(q.dtype) if bk.atomic else _group_sum(dq, s.heads_q, q.dtype)
    if s.heads_k != s.heads:
        dk = dk.to(k.dtype) if bk.atomic else _group_sum(dk, s.heads_k, k.dtype)
    dg = None if dgp is None else dgp.sum(0) if nk > 1 else dgp[0]  # whole per key tile
    return dq, dk, dv, dg, dh0, dw


def _output(out: GradOutput, s: LinearShape, device: torch.device) -> torch.Tensor:
    """The buffer the dQ/dK kernel writes `out` into (zeros for its atomics)."""
    alloc = torch.zeros if out.atomic else torch.empty
    return alloc(s.batch, out.heads, s.seqlen, s.head_dim, dtype=getattr(torch, out.dtype),
                 device=device)
