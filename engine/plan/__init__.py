"""Kernel plans: a traced spec plus a kernel template and its KernelConfig."""

from engine.plan.config import (
    GEMM_POLICIES,
    ConfigError,
    KernelConfig,
    check_config,
    config_problems,
    estimate_resources,
)

__all__ = [
    "GEMM_POLICIES",
    "ConfigError",
    "KernelConfig",
    "check_config",
    "config_problems",
    "estimate_resources",
]
