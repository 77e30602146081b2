"""Arms of the probing scripts (scripts/kernel_probe.py, scripts/linear_breakdown.py): an
implementation, optionally with module constants patched while it builds its kernels and with
a linear module's configs set, written `IMPL[@PART...]`, each PART one of

    module.path:NAME=VALUE   a module constant (VALUE a Python literal), e.g.
                             engine.kernels.attention_bwd.plan:PERSISTENT_MAX_SQ=65536
    fwd=KEY / bwd=KEY        the engine's LinearAttentionEngine config / backward_config, as
                             kernel headers name them (C64_K128_V64_s2_t256_1p)
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import time
from collections.abc import Iterator
from typing import NamedTuple

from attnbench.linear import STATE, decay_needs_grad
from engine.kernels.linear_fwd.plan import LinearConfig
from engine.linear_api import LinearAttentionEngine
from engine.runtime.precompile import precompile

CONFIG_ATTRS = {"fwd": "config", "bwd": "backward_config"}  # LinearAttentionEngine's


class Arm(NamedTuple):
    """An implementation, the module constants patched while it builds ((module, name, value)
    each) and the module configs it runs ((attribute, LinearConfig) each)."""

    label: str
    impl: str
    patches: tuple[tuple[str, str, object], ...] = ()
    configs: tuple[tuple[str, LinearConfig], ...] = ()


def parse_arm(text: str) -> Arm:
    """The arm written `text` (module docstring); a malformed part is refused, naming it."""
    impl, *parts = text.split("@")
    if not impl:
        raise ValueError(f"arm {text!r}: no implementation named")
    patches, configs = [], []
    for part in parts:
        target, eq, value = part.partition("=")
        if target in CONFIG_ATTRS and value:
            configs.append((CONFIG_ATTRS[target], LinearConfig.from_key(value)))
            continue
        module, colon, name = target.partition(":")
        if not (eq and colon and module and name):
            raise ValueError(f"arm {text!r}: expected IMPL@module.path:NAME=VALUE, @fwd=KEY "
                             f"or @bwd=KEY, got {part!r}")
        try:
            patches.append((module, name, ast.literal_eval(value)))
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"arm {text!r}: {value!r} is not a Python literal") from exc
    return Arm(text, impl, tuple(patches), tuple(configs))


@contextlib.contextmanager
def patched(patches: tuple[tuple[str, str, object], ...]) -> Iterator[None]:
    """The constants set for the block's duration, restored after it (also on an error)."""
    saved = []
    try:
        for module, name, value in patches:
            mod = importlib.import_module(module)
            if not hasattr(mod, name):
                raise ValueError(f"patch {module}:{name}: the module has no {name!r}")
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, old in reversed(saved):
            setattr(mod, name, old)


def set_configs(p, configs: tuple[tuple[str, LinearConfig], ...]) -> None:
    """Set a prepared call's module configs (an implementation that exposes no module refuses
    them)."""
    if not configs:
        return
    module = p.extra.get("module")
    if not isinstance(module, LinearAttentionEngine):
        raise ValueError(f"{[a for a, _ in configs]}: set on a LinearAttentionEngine, and this "
                         f"implementation exposes {type(module).__name__}")
    for attr, cfg in configs:
        setattr(module, attr, cfg)


def arm_sources(p, case, variant, inputs: dict, mode: str) -> list[str]:
    """The engine kernels a prepared arm's first call in `mode` builds (read under its
    patches, so that every arm's compile together: compile_together); none for an
    implementation without a module or on the reference executor."""
    mod = p.extra.get("module")
    if mod is None or mod.backend_name == "reference":
        return []
    modes = ("fwd",) if mode == "fwd" else ("fwd", "bwd")
    if case.kind != "linear":
        return mod.kernel_sources(modes)
    state = STATE in inputs  # a continuation: from a state, returning the final one
    return mod.kernel_sources(modes, initial_state=state, final_state=state,
                              decay_grad=decay_needs_grad(variant))


def compile_together(sources: list[str]) -> None:
    """Compile the arms' kernels in parallel worker processes: TileLang's disk cache then
    serves each arm's first call, which would otherwise compile them one at a time."""
    if not sources:
        return
    t = time.perf_counter()
    errors = precompile(sources)
    failed = f", {len(errors)} failed (their first call says why)" if errors else ""
    print(f"compiled {len(set(sources))} kernels in {time.perf_counter() - t:.0f} s{failed}",
          flush=True)
