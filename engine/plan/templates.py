"""Kernel templates by name, as used in search spaces and tune files: each with its validity
model (what the tuner prunes with before anything compiles) and its default config (what
every tuning run measures first, as its same-run baseline)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.plan.backward import backward_config_problems, default_backward_config
from engine.plan.config import KernelConfig, config_problems
from engine.plan.defaults import default_forward_config


@dataclass(frozen=True)
class Template:
    # (cfg, head_dim, head_dim_v, elem_bytes) -> reasons the config is invalid
    problems: Callable[[KernelConfig, int, int, int], list[str]]
    # (head_dim, head_dim_v, elem_bytes, spec) -> the engine's default config for a TracedSpec
    # (ValueError: none)
    default: Callable[..., KernelConfig]


TEMPLATES: dict[str, Template] = {
    "attention_fwd": Template(config_problems, default_forward_config),  # the forward kernel
    "attention_bwd": Template(backward_config_problems, default_backward_config),  # its backward
}


def get_template(name: str) -> Template:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"template={name!r}: expected one of {sorted(TEMPLATES)}") from None
