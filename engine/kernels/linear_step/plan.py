"""The recurrent step kind: a few new positions of a linear attention against its state (the
linear counterpart of decode). Memory-bound: each (sequence, head)'s [D, Dv] fp32 state is
read and written once; the new tokens' q, k, v are small beside it.

One thread block per (value tile, sequence x head); thread (c, ks) of it holds rows
ks * D / key_splits .. (ks + 1) * D / key_splits of the state's column c in registers, so a
warp's loads of one state row are one coalesced 128-byte line. Each step updates the rows
(S = exp(g) S + k v^T) and sums q . S over them; the key splits' partial sums meet in shared
memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.plan.config import ConfigError, config_from_dict

MAX_STEP_TOKENS = 8  # longer calls run the chunked kernels
MAX_ROWS = 64  # state rows a thread holds (registers)


@dataclass(frozen=True)
class StepConfig:
    """block_V: state columns per block (one per thread of a key split); key_splits: threads
    sharing one column (0: the fewest that keep a thread's rows within MAX_ROWS)."""

    block_V: int = 64
    key_splits: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepConfig:
        return config_from_dict(cls, data)

    def key(self) -> str:
        return f"V{self.block_V}_ks{self.key_splits}"


def key_splits(cfg: StepConfig, head_dim: int) -> int:
    if cfg.key_splits:
        return cfg.key_splits
    return max(1, -(-head_dim // MAX_ROWS))


def config_problems(cfg: StepConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                    spec=None) -> list[str]:
    out = []
    if cfg.block_V not in (32, 64, 128) or head_dim_v % cfg.block_V:
        out.append(f"block_V={cfg.block_V}: expected 32, 64 or 128 dividing {head_dim_v}")
    ks = key_splits(cfg, head_dim)
    if ks < 1 or head_dim % ks or head_dim // ks > MAX_ROWS:
        out.append(f"key_splits={cfg.key_splits}: expected a divisor of {head_dim} leaving at "
                   f"most {MAX_ROWS} rows per thread")
    elif cfg.block_V * ks > 1024:
        out.append(f"block_V x key_splits = {cfg.block_V * ks} threads > 1024")
    return out


def default_step_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2, spec=None
                        ) -> StepConfig:
    cfg = StepConfig(block_V=64 if head_dim_v % 64 == 0 else 32)
    problems = config_problems(cfg, head_dim, head_dim_v, elem_bytes)
    if problems:
        raise ConfigError(f"StepConfig at D={head_dim}, Dv={head_dim_v}: " + "; ".join(problems))
    return cfg
