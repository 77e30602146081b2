"""A generated kernel at run time: compiled on first use, called with its tensors by name.

The generator returns `main`'s parameters with the source (engine.codegen.params); binding by
name ties the launcher to the generator by more than the order of a list. The first call also
checks every tensor's dtype and static extents against its parameter (then the layout is
proven: later calls only look the names up)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.codegen.params import GeneratedKernel, KernelParam
from engine.dtypes import TORCH
from engine.runtime.compile import compile_source, launcher

TORCH_DTYPES = TORCH  # a parameter's TileLang dtype is the torch name


def bind_arguments(params: Sequence[KernelParam], tensors: Mapping[str, Any],
                   names: Sequence[str] | None = None) -> list[Any]:
    """`tensors` in the order of `params` (whose names may be given: a kernel keeps them);
    ValueError naming what is missing or unexpected."""
    names = [p.name for p in params] if names is None else names
    if len(tensors) == len(names):
        try:
            return [tensors[n] for n in names]
        except KeyError:
            pass
    missing = [n for n in names if n not in tensors]
    extra = sorted(set(tensors) - set(names))
    raise ValueError(f"kernel arguments: missing {missing}, unexpected {extra}; "
                     f"the kernel takes {list(names)}")


def check_arguments(params: Sequence[KernelParam], args: Sequence[Any]) -> None:
    """ValueError unless each tensor has its parameter's dtype and extents (a symbol, such as
    a dynamic length, the same size wherever it appears)."""
    symbols: dict[str, int] = {}
    for p, t in zip(params, args, strict=True):
        want = TORCH_DTYPES[p.dtype]
        if t.dtype != want or t.dim() != len(p.shape):
            raise ValueError(f"kernel argument {p.name}: {t.dtype} {tuple(t.shape)}; expected "
                             f"{want} with extents {p.shape}")
        for extent, size in zip(p.shape, t.shape, strict=True):
            if extent.isdigit():
                ok = int(extent) == size
            else:
                ok = symbols.setdefault(extent, size) == size
            if not ok:
                raise ValueError(f"kernel argument {p.name}: shape {tuple(t.shape)}; expected "
                                 f"extents {p.shape} (symbols so far: {symbols})")


class Kernel:
    """One generated kernel; `kernel(**tensors)` launches it (`kernel.launch(*tensors)` with
    them in the order of `params`: the call paths' form, with no binding by name)."""

    def __init__(self, generated: GeneratedKernel):
        self.generated = generated
        self._compiled: Any = None
        self._launch: Callable[..., Any] | None = None  # after the first, checked, call

    @property
    def source(self) -> str:
        return self.generated.source

    @property
    def params(self) -> tuple[KernelParam, ...]:
        return self.generated.params

    def compiled(self) -> Any:
        if self._compiled is None:
            self._compiled = compile_source(self.source)
        return self._compiled

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def __call__(self, **tensors: Any) -> Any:
        return self.launch(*bind_arguments(self.params, tensors, self.names))

    def pick(self, named: Mapping[str, Any]) -> list[Any]:
        """This kernel's tensors from `named` (which may hold others'), in parameter order."""
        return [named[n] for n in self.names]

    def launch(self, *args: Any) -> Any:
        fn = self._launch
        if fn is None:
            check_arguments(self.params, args)
            fn = self._launch = launcher(self.compiled())
        return fn(*args)
