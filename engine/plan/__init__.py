"""What every kernel kind plans with: KernelConfig and the H100 facts its validity models share
(config.py), and KernelShape, the sizes a kernel is generated for (shape.py). Each kind's own
plan is in engine/kernels/<kind>/plan.py."""

from engine.plan.config import GEMM_POLICIES, ConfigError, KernelConfig

__all__ = ["GEMM_POLICIES", "ConfigError", "KernelConfig"]
