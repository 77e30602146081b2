"""An attention problem's sizes (and a linear attention's: LinearProblem): the one record of
them. The reference executor and the module use it as is; kernel shapes
(engine.plan.shape.KernelShape) and the harness's suite cases and tuning problems extend it.
FLOPs by FlashAttention's convention (counting query heads):

    forward  = 2 * B * Hq * Sq * Skv * (D + Dv)  * f     (QK^T: 2*D, PV: 2*Dv per (q, kv) pair)
    backward = 2 * B * Hq * Sq * Skv * (3D + 2Dv) * f    (dS recompute + dQ + dK: 3 x D,
                                                          dP + dV: 2 x Dv) = 2.5 x forward at D=Dv
    fwd+bwd  = forward + backward

with f the unmasked fraction of (q, kv) pairs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

SIZE_KEYS = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim", "head_dim_v")


def attention_flops(batch: int, heads_q: int, seqlen_q: int, seqlen_kv: int, head_dim: int,
                    head_dim_v: int, mode: str, fraction: float = 1.0) -> float:
    pairs = 2.0 * batch * heads_q * seqlen_q * seqlen_kv * fraction
    return of_mode(mode, pairs * (head_dim + head_dim_v), pairs * (3 * head_dim + 2 * head_dim_v))


def of_mode(mode: str, fwd: float, bwd: float) -> float:
    """The work of `mode` ("fwd", "bwd", "fwd+bwd") from the forward's and the backward's."""
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return bwd
    if mode == "fwd+bwd":
        return fwd + bwd
    raise ValueError(f"mode must be one of fwd, bwd, fwd+bwd; got {mode!r}")


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Sizes of the runtime tensors q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv]
    (keyword-only, so that records extending it keep their own positional fields)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    head_dim_v: int

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Problem:
        return cls(batch=q.shape[0], heads_q=q.shape[2], heads_kv=k.shape[2], seqlen_q=q.shape[1],
                   seqlen_kv=k.shape[1], head_dim=q.shape[3], head_dim_v=v.shape[3])

    @property
    def groups(self) -> int:
        return self.heads_q // self.heads_kv

    def sizes(self) -> dict[str, int]:
        """The seven sizes by name (as tune files and shapes key them)."""
        return {k: getattr(self, k) for k in SIZE_KEYS}

    def named_sizes(self) -> dict[str, int]:
        """The sizes a CustomIO dim names."""
        return {"batch": self.batch, "heads": self.heads_q, "seq_len": self.seqlen_q,
                "seq_len_kv": self.seqlen_kv}

    def flops_of(self, mode: str, fraction: float = 1.0) -> float:
        """FLOPs of `mode` ("fwd", "bwd", "fwd+bwd") with `fraction` of the pairs unmasked."""
        return attention_flops(self.batch, self.heads_q, self.seqlen_q, self.seqlen_kv,
                               self.head_dim, self.head_dim_v, mode, fraction)


@dataclass(frozen=True)
class LinearProblem:
    """The sizes qkv_meta declares: q (B, HQ, T, D), k (B, HK, T, D), v (B, H, T, Dv). B and T
    are the expected ones; a call may bring others (a one-token generation step)."""

    batch: int
    heads_q: int
    heads_k: int
    heads: int
    seqlen: int
    head_dim: int
    head_dim_v: int

    def sizes(self, batch: int | None = None, seqlen: int | None = None) -> dict[str, int]:
        """The sizes by name, with a call's batch and length where given."""
        out = asdict(self)
        out["batch"] = self.batch if batch is None else batch
        out["seqlen"] = self.seqlen if seqlen is None else seqlen
        return out

    def named_sizes(self, batch: int, seqlen: int) -> dict[str, int]:
        """The sizes a CustomIO dim names, at a call's batch and length ("heads" is H)."""
        return {"batch": batch, "heads": self.heads, "seq_len": seqlen}
