"""Default kernel configs when no tune file has an entry: the first valid config, by the
validity model, from a preference order measured on the H100 (see results/)."""

from __future__ import annotations

import os

from engine.plan.config import KernelConfig, config_problems

# Forward kernels with batch and sequence lengths as runtime symbols (one compile serves every
# length; engine.plan.shape.KernelShape.dynamic). Off until the H100 shows it costs no speed
# (the `engine-dynamic` implementation measures it beside `engine` in the same run);
# ATTNBENCH_DYNAMIC_SHAPES=1 turns it on, as does setting a module's `dynamic_shapes`.
DYNAMIC_SHAPES = os.environ.get("ATTNBENCH_DYNAMIC_SHAPES", "0") == "1"

# Preference order: large tiles first (they amortise the softmax per wgmma best), then
# smaller tiles / fewer stages as head dims grow and shared memory runs out.
PREFERENCE: tuple[KernelConfig, ...] = (
    KernelConfig(192, 128, 2, 384),  # 3 consumer warpgroups: 648-656 TFLOP/s at D=128 (H100)
    KernelConfig(128, 128, 2, 256),
    KernelConfig(128, 64, 2, 256),
    KernelConfig(128, 64, 1, 256),
    KernelConfig(64, 64, 2, 128),
    KernelConfig(64, 64, 1, 128),
    KernelConfig(64, 32, 1, 128),
)


def default_forward_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> KernelConfig:
    for cfg in PREFERENCE:
        if not config_problems(cfg, head_dim, head_dim_v, elem_bytes):
            return cfg
    raise ValueError(f"no valid forward kernel config for head dims D={head_dim}, Dv={head_dim_v}")
