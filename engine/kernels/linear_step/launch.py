"""Build and launch the recurrent step (equal-length rows, no packed sequences)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kernels.linear_fwd.plan import NO_FOLDS, Folds, LinearShape
from engine.kernels.linear_step.codegen import generate_step
from engine.kernels.linear_step.plan import StepConfig, config_problems
from engine.plan.config import ConfigError
from engine.runtime.kernel import Kernel


@dataclass
class StepKernels:
    shape: LinearShape
    config: StepConfig
    folds: Folds = NO_FOLDS
    _kernels: dict[bool, Kernel] = field(default_factory=dict)

    def kernel(self, initial: bool) -> Kernel:
        if initial not in self._kernels:
            self._kernels[initial] = Kernel(generate_step(self.shape, self.config, initial,
                                                          self.folds))
        return self._kernels[initial]

    def sources(self, initial: bool = True) -> list[str]:
        return [self.kernel(initial).source]

    def compile(self, initial: bool = True) -> None:
        self.kernel(initial).compiled()


def build_step(shape: LinearShape, cfg: StepConfig, folds: Folds = NO_FOLDS) -> StepKernels:
    problems = config_problems(cfg, shape.head_dim, shape.head_dim_v)
    if problems:
        raise ConfigError(f"StepConfig {cfg.key()}: " + "; ".join(problems))
    if shape.sequences:
        raise ValueError("the recurrent step takes equal-length rows (no cu_seqlens)")
    return StepKernels(shape, cfg, folds)


def launch_step(sk: StepKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, initial_state: torch.Tensor | None,
                v_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, T, Dv], the state after the T positions [B, H, D, Dv] fp32); `v_weight`
    [B, H, T] float32 where the kernels fold value weights (sk.folds)."""
    s = sk.shape
    o = torch.empty(s.batch, s.heads, s.seqlen, s.head_dim_v, dtype=q.dtype, device=q.device)
    ht = torch.empty(s.batch, s.heads, s.head_dim, s.head_dim_v, dtype=torch.float32,
                     device=q.device)
    args = {"Q": q, "K": k, "V": v, "G": g, "O": o, "Ht": ht}
    if initial_state is not None:
        args["H0"] = initial_state
    if sk.folds.v_weight:
        args["W"] = v_weight
    sk.kernel(initial_state is not None)(**args)
    return o, ht
