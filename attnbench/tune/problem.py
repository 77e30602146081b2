"""What one study tunes (Problem) and the study's name, which keys it in Optuna storage."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from engine.kernels.registry import kind_for
from engine.tuning.tune_file import gpu_slug, normalize_dtype, shape_tag, tilelang_version

MODES = ("fwd", "bwd")
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@dataclass(frozen=True)
class Problem:
    """One attention problem: variant, shape, dtype and pass (fwd, or fwd+bwd for 'bwd')."""

    variant: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str = "bf16"
    mode: str = "fwd"
    family: str = "attention"  # a suite case's kind: with the mode, it picks the kernel kind

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim",
                     "head_dim_v"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r}: expected a positive int")
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q={self.heads_q}, heads_kv={self.heads_kv}: heads_q must be a multiple "
                "of heads_kv"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: expected one of {MODES}")
        kind_for(self.family, self.mode)  # ValueError naming the kinds there are
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def template(self) -> str:
        """The kernel kind this problem's study tunes (engine.kernels.registry)."""
        return kind_for(self.family, self.mode).name

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    def shape(self) -> dict[str, int]:
        d = asdict(self)
        return {k: d[k] for k in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv",
                                  "head_dim", "head_dim_v")}

    def flops(self, unmasked_fraction: float = 1.0) -> float:
        """FLOPs by FlashAttention's convention: fwd 2·B·Hq·Sq·Skv·(D+Dv) times the unmasked
        fraction; 'bwd' mode times forward+backward, 3.5x the forward."""
        fwd = (
            2.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_kv
            * (self.head_dim + self.head_dim_v) * unmasked_fraction
        )
        return fwd * (3.5 if self.mode == "bwd" else 1.0)


def study_name(problem: Problem, *, spec_hash: str, gpu: str, kind: str = "tpe") -> str:
    """One study per (template, spec hash, shape, dtype, mode, GPU, TileLang version). `kind`
    separates the grid baseline and comparison runs from the main TPE study."""
    spec = str(spec_hash)
    if len(spec) > 16:
        spec = hashlib.sha256(spec.encode()).hexdigest()[:16]
    parts = [
        problem.template, problem.variant, spec, shape_tag(problem.shape()), problem.dtype,
        problem.mode, gpu_slug(gpu), f"tl{tilelang_version()}",
    ]
    if kind != "tpe":
        parts.append(kind)
    return ":".join(parts)
