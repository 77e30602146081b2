"""Kernel templates by name, as used in search spaces and tune files, with their validity
models: what the tuner prunes with before anything compiles."""

from __future__ import annotations

from collections.abc import Callable

from engine.plan.backward import backward_config_problems
from engine.plan.config import KernelConfig, config_problems

Problems = Callable[[KernelConfig, int, int, int], list[str]]

TEMPLATES: dict[str, Problems] = {
    "attention_fwd": config_problems,  # the forward kernel
    "attention_bwd": backward_config_problems,  # the backward's main kernel
}


def template_problems(template: str) -> Problems:
    """The validity model of `template`: (cfg, head_dim, head_dim_v, elem_bytes) -> reasons."""
    try:
        return TEMPLATES[template]
    except KeyError:
        raise ValueError(f"template={template!r}: expected one of {sorted(TEMPLATES)}") from None
