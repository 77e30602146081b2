"""What every implementation declares (capabilities) and returns (a prepared call).

An implementation is checked against a case *before* any tensor is made: `Impl.check_modes`
returns, per mode of the case, the reason it cannot run it (that reason goes into a `skipped`
row) or None; by default the case-wide `Impl.check` and then `Capabilities.check_mode`. A
problem only visible with inputs or a built module in hand (e.g. a variant with no
FlexAttention form, an SDPA backend that refuses the shapes, no backward kernel for a head dim)
raises `Unsupported` from `prepare`, which the runner also records as `skipped`: in every mode,
or only in `Unsupported.modes` when given (the runner then prepares again for the other modes,
so a forward that runs is measured although the backward cannot be). Any other exception is an
`error` row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from attnbench.cases import Case

PLAIN_SOFTMAX = frozenset({"softmax", "softmax_causal", "softmax_gqa"})
HALF = frozenset({"float16", "bfloat16"})
ALL_DTYPES = frozenset({"float16", "bfloat16", "float32"})
ALL_MODES = frozenset({"fwd", "bwd", "fwd+bwd"})
GRAD_MODES = frozenset({"bwd", "fwd+bwd"})  # the modes that run a backward
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class Unsupported(Exception):
    """Raised by `prepare` when a case turns out to be unsupported; becomes a `skipped` row.

    `modes`: the modes the reason rules out (e.g. GRAD_MODES for a missing backward); None: all.
    """

    def __init__(self, reason: str, modes: frozenset[str] | None = None) -> None:
        super().__init__(reason)
        self.modes = None if modes is None else frozenset(modes)

    def rules_out(self, mode: str) -> bool:
        return self.modes is None or mode in self.modes


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" | "cuda"
    name: str = "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability


@dataclass(frozen=True)
class Capabilities:
    devices: frozenset[str]
    dtypes: frozenset[str]
    modes: frozenset[str] = ALL_MODES
    kinds: frozenset[str] = frozenset({"attention"})
    variants: frozenset[str] | None = None  # None: any variant
    max_head_dim: int | None = None
    equal_head_dims: bool = False  # needs D == Dv
    gqa: bool = True
    min_capability: tuple[int, int] | None = None  # e.g. (9, 0): Hopper
    max_score_elems: int | None = None  # B*Hq*Sq*Skv bound for implementations that materialise
    cuda_reason: str = "needs a CUDA GPU"  # the skip reason on a machine without CUDA

    def check(self, case: Case, device: DeviceInfo) -> str | None:
        """The reason this declaration rules the case out, or None."""
        if device.type not in self.devices:
            return self.cuda_reason if "cuda" in self.devices else f"runs on {sorted(self.devices)}"
        if self.min_capability and device.capability and device.capability < self.min_capability:
            need = ".".join(map(str, self.min_capability))
            have = ".".join(map(str, device.capability))
            return f"needs compute capability >= {need} ({device.name} is {have})"
        if case.kind not in self.kinds:
            return f"{case.kind} cases not supported (supports: {', '.join(sorted(self.kinds))})"
        if self.variants is not None and case.variant not in self.variants:
            known = ", ".join(sorted(self.variants))
            return f"variant {case.variant} not supported (supports: {known})"
        if case.dtype not in self.dtypes:
            return f"dtype {case.dtype} not supported (supports: {', '.join(sorted(self.dtypes))})"
        if self.max_head_dim and max(case.head_dim, case.head_dim_v) > self.max_head_dim:
            return f"head dim {max(case.head_dim, case.head_dim_v)} > {self.max_head_dim}"
        if self.equal_head_dims and case.head_dim != case.head_dim_v:
            return f"needs head_dim == head_dim_v (got {case.head_dim}, {case.head_dim_v})"
        if not self.gqa and case.heads_q != case.heads_kv:
            return f"GQA not supported (heads_q {case.heads_q} != heads_kv {case.heads_kv})"
        if self.max_score_elems is not None:
            n = case.batch * max(case.heads_q, case.heads) * case.seqlen_q * case.seqlen_kv
            if n > self.max_score_elems:
                return (f"materialises B*H*Sq*Skv = {n:.3g} scores (limit "
                        f"{self.max_score_elems:.3g})")
        return None

    def check_mode(self, mode: str) -> str | None:
        if mode not in self.modes:
            return f"mode {mode} not supported (supports: {', '.join(sorted(self.modes))})"
        return None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class Prepared:
    """One implementation made ready for one case.

    `forward()` computes the output in the implementation's own layout from inputs already
    arranged for it (layout changes happen in `prepare`, outside the timed region); `leaves`
    are its q, k, v tensors (requiring grad when a backward mode is run); `to_common` maps its
    layout to the common one ([B, S, H, D]; linear cases [B, H, T, D]) for outputs and
    gradients (a linear continuation's forward returns (o, final state), and its `to_common`
    maps the pair), and `from_common` maps the other way
    (for the output gradient); `context()` is entered around warm-up and timing.
    """

    forward: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, ...] = ()
    to_common: Callable[[torch.Tensor], torch.Tensor] = _identity
    from_common: Callable[[torch.Tensor], torch.Tensor] = _identity
    context: Callable[[], AbstractContextManager] = nullcontext
    compile_s: float = math.nan
    # exception -> skip reason when the backend refused the call (else None: an error row)
    refusal: Callable[[BaseException], str | None] = lambda exc: None  # noqa: E731
    # (tflops, flops) -> reason to fail the row (e.g. a compiled path that fell back), or None;
    # None: nothing to check. Checked on one call first, then on the measured median.
    verify: Callable[[float, float], str | None] | None = None
    # (dq, dk, dv) of `leaves` -> the common layout's; None: `to_common` on each. For an
    # implementation whose leaves are a mapping of the case's q, k, v (fla's Mamba2: q and k
    # broadcast over heads, v * dt), the chain rule back to them.
    grad_map: Callable[[tuple], tuple] | None = None
    # what an implementation exposes beyond the call (the engine's linear module: scripts
    # that time it at other configs, scripts/linear_breakdown.py)
    extra: dict = field(default_factory=dict)

    def grads_to_common(self, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.grad_map is not None:
            return tuple(self.grad_map(grads))
        return tuple(self.to_common(g) for g in grads)

    def timed_call(self, mode: str, grad_out: torch.Tensor | None = None
                   ) -> Callable[[], object]:
        """What a row of `mode` times: "fwd", the forward without autograd; "fwd+bwd", the
        forward and the gradients of `leaves` for `grad_out` (in this implementation's
        layout)."""
        if mode == "fwd":
            def forward():
                with torch.no_grad():
                    return self.forward()
            return forward
        if mode != "fwd+bwd":
            raise ValueError(f"mode: expected 'fwd' or 'fwd+bwd', got {mode!r}")
        return lambda: torch.autograd.grad(self.forward(), self.leaves, grad_out)


def learnable_customs(variant, inputs: dict, needs_grad: bool) -> dict[str, torch.Tensor]:
    """The custom tensors of `inputs`; in the gradient modes the variant's learnable ones are
    fresh leaves that require grad, so that their gradients (an ALiBi slope's, a bias table's)
    are computed and timed with q, k and v's, as training computes them."""
    return {n: t.detach().clone().requires_grad_(True) if needs_grad and n in variant.learnable
            else t for n, t in inputs.items() if n not in ("q", "k", "v")}


def learnable_leaves(variant, customs: dict) -> tuple[torch.Tensor, ...]:
    """The custom tensors that require grad, in the variant's order (after q, k, v)."""
    return tuple(customs[n] for n in variant.learnable
                 if n in customs and customs[n].requires_grad)


def grad_leaves(inputs: dict, needs_grad: bool) -> tuple[torch.Tensor, ...]:
    """Fresh leaf copies of q, k, v in [B, S, H, D] (never views of the shared inputs)."""
    return tuple(
        inputs[n].detach().clone().requires_grad_(needs_grad) for n in ("q", "k", "v")
    )


class Impl:
    """Base class: `name`, `caps` and `prepare`; override `check` for variant-specific rules."""

    name: str = ""
    description: str = ""
    gpu_only: bool = True

    @property
    def caps(self) -> Capabilities:  # pragma: no cover - every impl overrides
        raise NotImplementedError

    def unavailable(self) -> str | None:
        """Why the implementation cannot run here at all (a missing package), or None."""
        return None

    def check(self, case: Case, variant, device: DeviceInfo) -> str | None:
        reason = self.caps.check(case, device)
        if reason is None:
            reason = self.unavailable()
        return reason

    def check_modes(self, case: Case, variant, device: DeviceInfo) -> dict[str, str | None]:
        """Per mode of `case`: why this implementation cannot run it here, or None.

        Override for a rule that holds in some modes only; the case-wide reasons of `check`
        apply to every mode."""
        reason = self.check(case, variant, device)
        return {m: reason or self.caps.check_mode(m) for m in case.modes}

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        raise NotImplementedError
