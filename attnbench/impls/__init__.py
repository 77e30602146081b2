"""The implementations registry: name (as written in result rows) -> implementation.

Each implementation declares its `Capabilities` (devices, dtypes, modes, case kinds, variants,
head dims, GQA); the runner skips a case an implementation does not support with that reason in
the row. Modules with CUDA-only dependencies import them inside `prepare`, so importing this
registry is safe on any machine. A new implementation (e.g. a new engine kernel family) is one
more entry in `_build()`.
"""

from __future__ import annotations

import functools

from attnbench.impls.base import (
    Capabilities,
    DeviceInfo,
    Impl,
    Prepared,
    Unsupported,
)

IMPL_NAMES: tuple[str, ...] = (
    "engine", "engine-dynamic", "engine-deterministic", "engine-flex", "engine-compiled",
    "engine-saved-states", "flash-attention-3",
    "sdpa-cudnn",
    "sdpa-flash", "sdpa-efficient", "sdpa-math",
    "flex", "reference", "fla", "mamba_ssm",
)

__all__ = ["IMPL_NAMES", "Capabilities", "DeviceInfo", "Impl", "Prepared", "Unsupported",
           "get_impl", "registry"]


@functools.cache
def registry() -> dict[str, Impl]:
    from attnbench.impls.engine import (
        EngineCompiledImpl,
        EngineDeterministicImpl,
        EngineDynamicImpl,
        EngineFlexImpl,
        EngineImpl,
        EngineSavedStatesImpl,
        ReferenceImpl,
    )
    from attnbench.impls.fa3 import FA3Impl
    from attnbench.impls.fla import FlaImpl
    from attnbench.impls.flex import FlexImpl
    from attnbench.impls.mamba_ssm import MambaSsmImpl
    from attnbench.impls.sdpa import sdpa_impls

    impls: list[Impl] = [EngineImpl(), EngineDynamicImpl(), EngineDeterministicImpl(),
                         EngineFlexImpl(), EngineCompiledImpl(), EngineSavedStatesImpl(),
                         FA3Impl(),
                         *sdpa_impls(), FlexImpl(), ReferenceImpl(), FlaImpl(),
                         MambaSsmImpl()]
    reg = {i.name: i for i in impls}
    assert tuple(reg) == IMPL_NAMES, "IMPL_NAMES out of sync with the registry"
    return reg


def get_impl(name: str) -> Impl:
    reg = registry()
    if name not in reg:
        raise ValueError(f"unknown implementation {name!r}; known implementations: "
                         f"{', '.join(IMPL_NAMES)}")
    return reg[name]
