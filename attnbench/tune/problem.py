"""What one study tunes (Problem) and the study's name, which keys it in Optuna storage."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.dtypes import elem_bytes
from engine.kernels.registry import kind_for
from engine.problem import SIZE_KEYS
from engine.problem import Problem as Sizes
from engine.tuning.tune_file import gpu_slug, normalize_dtype, shape_tag, tilelang_version

MODES = ("fwd", "bwd")


@dataclass(frozen=True)
class Problem(Sizes):
    """One attention problem: variant, the sizes (keyword arguments: engine.problem.Problem),
    dtype and pass (fwd, or fwd+bwd for 'bwd')."""

    variant: str
    dtype: str = "bf16"
    mode: str = "fwd"
    family: str = "attention"  # a suite case's kind: with the mode, it picks the kernel kind

    def __post_init__(self) -> None:
        for name in SIZE_KEYS:
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
        return elem_bytes(self.dtype)

    def shape(self) -> dict[str, int]:
        return self.sizes()

    def flops(self, unmasked_fraction: float = 1.0) -> float:
        """FLOPs by FlashAttention's convention (engine.problem): the forward, or in 'bwd' mode
        forward and backward (3.5x the forward at D = Dv), times the unmasked fraction."""
        return self.flops_of("fwd+bwd" if self.mode == "bwd" else "fwd", unmasked_fraction)


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
