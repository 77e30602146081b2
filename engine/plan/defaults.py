"""Default kernel configs when no tune file has an entry: the first valid config, by the
validity model, from a preference order measured on the H100 (see results/)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from engine.plan.config import KernelConfig, config_problems, masked_body_fits

if TYPE_CHECKING:
    from engine.ir.spec import TracedSpec

# Forward kernels with batch and sequence lengths as runtime symbols (one compile serves every
# length; engine.plan.shape.KernelShape.dynamic). Off until the H100 shows it costs no speed
# (the `engine-dynamic` implementation measures it beside `engine` in the same run);
# ATTNBENCH_DYNAMIC_SHAPES=1 turns it on, as does setting a module's `dynamic_shapes`.
DYNAMIC_SHAPES = os.environ.get("ATTNBENCH_DYNAMIC_SHAPES", "0") == "1"

# Preference order: large tiles first (they amortise the softmax per wgmma best), then
# smaller tiles / fewer stages as head dims grow and shared memory runs out. A spec whose
# partial blocks do more than the register model allows beside the accumulators skips the
# tiles that would spill (engine.plan.config.masked_body_fits).
PREFERENCE: tuple[KernelConfig, ...] = (
    KernelConfig(192, 128, 2, 384),  # 3 consumer warpgroups: 648-656 TFLOP/s at D=128 (H100)
    # Rasterised in panels of 8 blocks: on the H100 at D = 128, 4k, masked variants ran
    # 3-6% faster than unrasterised (sliding window and document within 2%).
    KernelConfig(128, 128, 2, 256, "FullRow", 8),
    KernelConfig(128, 64, 2, 256),
    KernelConfig(128, 64, 1, 256),
    KernelConfig(64, 64, 2, 128),
    KernelConfig(64, 64, 1, 128),
    KernelConfig(64, 32, 1, 128),
)


def default_forward_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                           spec: TracedSpec | None = None) -> KernelConfig:
    """The first valid config of PREFERENCE; with `spec`, the first whose partial blocks also
    keep within the consumer's registers (the first valid one if none does)."""
    ops = spec.masked_block_ops() if spec is not None else 0
    valid = [c for c in PREFERENCE if not config_problems(c, head_dim, head_dim_v, elem_bytes)]
    if not valid:
        raise ValueError(
            f"no valid forward kernel config for head dims D={head_dim}, Dv={head_dim_v}"
        )
    fits = [c for c in valid if masked_body_fits(c, head_dim, head_dim_v, ops, elem_bytes)]
    return (fits or valid)[0]
