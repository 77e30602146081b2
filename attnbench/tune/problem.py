"""What one study tunes (Problem) and the study's name, which keys it in Optuna storage."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from attnbench.metrics import linear_flops
from engine.dtypes import elem_bytes
from engine.kernels.linear_fwd.tune_shape import keyed
from engine.kernels.registry import KernelKind, kind_for
from engine.problem import SIZE_KEYS
from engine.problem import Problem as Sizes
from engine.tuning.select import decode_shape
from engine.tuning.tune_file import gpu_slug, normalize_dtype, shape_tag, tilelang_version

MODES = ("fwd", "bwd")


@dataclass(frozen=True)
class Problem(Sizes):
    """One problem to tune: variant, the sizes (keyword arguments: engine.problem.Problem),
    dtype and pass (fwd, or fwd+bwd for 'bwd').

    family "decode" (a decode suite case, attnbench.decode): seqlen_q is the new tokens per
    sequence, seqlen_kv the cache's capacity, `ragged` draws the valid lengths, `page_size`
    pages the cache (0: contiguous); the mode is "fwd".

    family "linear" (a linear suite case, attnbench.linear): heads_q and heads_kv are q's and
    k's heads (HQ, HK), `heads` the value and output heads H they divide, seqlen_q = seqlen_kv
    the length T; 'bwd' times forward and backward at the trial's config."""

    variant: str
    dtype: str = "bf16"
    mode: str = "fwd"
    family: str = "attention"  # a suite case's kind: with the mode, it picks the kernel kind
    ragged: bool = False
    page_size: int = 0
    heads: int = 0  # linear problems: the value heads H (0 for the other families)

    def __post_init__(self) -> None:
        for name in SIZE_KEYS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r}: expected a positive int")
        if self.linear:
            self._check_linear()
        elif self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q={self.heads_q}, heads_kv={self.heads_kv}: heads_q must be a multiple "
                "of heads_kv"
            )
        elif self.heads:
            raise ValueError(f"heads={self.heads}: the value heads of a linear problem, not of "
                             f"family {self.family!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: expected one of {MODES}")
        kind_for(self.family, self.mode)  # ValueError naming the kinds there are
        self._check_cache()
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    def _check_cache(self) -> None:
        if not isinstance(self.ragged, bool):
            raise ValueError(f"ragged={self.ragged!r}: expected a bool")
        p = self.page_size
        if isinstance(p, bool) or not isinstance(p, int) or p < 0 or (p and self.seqlen_kv % p):
            raise ValueError(f"page_size={p!r}: expected 0 (contiguous) or a positive divisor "
                             f"of the capacity seqlen_kv={self.seqlen_kv}")
        if self.family != "decode" and (self.ragged or p):
            raise ValueError(f"ragged={self.ragged}, page_size={p}: KV-cache fields of a decode "
                             f"problem, not of family {self.family!r}")

    def _check_linear(self) -> None:
        h = self.heads
        if isinstance(h, bool) or not isinstance(h, int) or h <= 0 or h % self.heads_q \
                or h % self.heads_kv:
            raise ValueError(f"heads={h!r}: expected the value heads, a positive multiple of "
                             f"heads_q={self.heads_q} and heads_kv={self.heads_kv}")
        if self.seqlen_q != self.seqlen_kv:
            raise ValueError(f"seqlen_q={self.seqlen_q}, seqlen_kv={self.seqlen_kv}: a linear "
                             "problem has one length")

    @property
    def kind(self) -> KernelKind:
        """The kernel kind this problem's study tunes (engine.kernels.registry)."""
        return kind_for(self.family, self.mode)

    @property
    def template(self) -> str:
        return self.kind.name

    @property
    def decode(self) -> bool:
        return self.family == "decode"

    @property
    def linear(self) -> bool:
        return self.family == "linear"

    def validity_args(self) -> dict[str, int]:
        """What the kind's validity model and default take beyond (D, Dv, elem_bytes): decode's
        tile rows (the query heads of one kv head times the new tokens)."""
        return {"rows": self.groups * self.seqlen_q} if self.decode else {}

    @property
    def elem_bytes(self) -> int:
        return elem_bytes(self.dtype)

    def engine_default(self, spec=None):
        """The kind's default config for this problem (and `spec`, its TracedSpec, when
        known; at its shape where the kind's default depends on it): what the engine runs
        without a tune entry. ValueError where no config fits."""
        kind = self.kind
        if kind.at_shape is not None:
            return kind.at_shape(self.shape(), self.dtype)
        rows = ({"seqlen_q": self.seqlen_q, "seqlen_kv": self.seqlen_kv}
                if kind.default_rows else {})
        return kind.default(self.head_dim, self.head_dim_v, self.elem_bytes, spec=spec,
                            **self.validity_args(), **rows)

    def shape(self) -> dict[str, int]:
        """The sizes as tune files key them (decode: with the page size; linear: with the
        value heads)."""
        if self.linear:
            return keyed(self.sizes(), self.heads)
        return decode_shape(self.sizes(), self.page_size) if self.decode else self.sizes()

    def flops(self, unmasked_fraction: float = 1.0) -> float:
        """FLOPs by FlashAttention's convention (engine.problem): the forward, or in 'bwd' mode
        forward and backward (3.5x the forward at D = Dv), times the unmasked fraction; a
        linear problem's by the chunked algorithm's count (attnbench.metrics.linear_flops)."""
        mode = "fwd+bwd" if self.mode == "bwd" else "fwd"
        if self.linear:
            return linear_flops(self.batch, self.heads, self.seqlen_q, self.head_dim,
                                self.head_dim_v, mode)
        return self.flops_of(mode, unmasked_fraction)


def study_name(problem: Problem, *, spec_hash: str, gpu: str, kind: str = "tpe") -> str:
    """One study per (template, spec hash, shape, dtype, mode, GPU, TileLang version), and per
    ragged or full cache lengths for decode. `kind` separates the grid baseline and comparison
    runs from the main TPE study."""
    spec = str(spec_hash)
    if len(spec) > 16:
        spec = hashlib.sha256(spec.encode()).hexdigest()[:16]
    parts = [
        problem.template, problem.variant, spec, shape_tag(problem.shape()), problem.dtype,
        problem.mode, gpu_slug(gpu), f"tl{tilelang_version()}",
    ]
    if problem.ragged:  # other inputs, the same tune-file entry (the engine sees no lengths)
        parts.append("ragged")
    if kind != "tpe":
        parts.append(kind)
    return ":".join(parts)
