"""KernelRequest: what selects a module's kernels, the traced spec, the problem, the dtype and
the module's options (engine functions take this, not the module)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.ir.spec import TracedSpec
from engine.plan.config import KernelConfig
from engine.plan.shape import KernelShape
from engine.problem import Problem


@dataclass(frozen=True)
class KernelOptions:
    """A module's options that select its kernels."""

    config: KernelConfig | None = None  # the forward's, fixed by the user
    backward_config: KernelConfig | None = None  # the backward main kernel's
    tune_file: str | None = None  # None: results/tune/<gpu>/<kind>.json
    dynamic_shapes: bool = False  # the forward with batch and lengths as runtime symbols
    deterministic: bool = False  # the atomic-free backward
    decode_config: Any = None  # the decode kind's DecodeConfig, fixed by the user


@dataclass(frozen=True)
class KernelRequest:
    spec: TracedSpec
    problem: Problem
    dtype: torch.dtype
    options: KernelOptions = field(default_factory=KernelOptions)

    @property
    def shape(self) -> KernelShape:
        return KernelShape.for_problem(self.problem, self.dtype, self.spec.mask,
                                       self.options.dynamic_shapes)

    def key(self) -> tuple:
        return (self.spec.hash, self.problem, self.dtype, self.options)
