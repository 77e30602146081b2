"""A generated kernel's parameters, named: the generator returns them with the source, and the
launcher binds tensors to them by name (engine.runtime.kernel), never by position alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelParam:
    """One tensor parameter of `main`: its name, extents (numbers, or symbols of a dynamic
    shape, as source text) and TileLang dtype."""

    name: str
    shape: tuple[str, ...]
    dtype: str
    # CustomIO parameters have always been declared with a comma after their last extent
    # (the source is the compile cache's key, so it stays).
    trailing_comma: bool = False

    def declaration(self) -> str:
        extents = ", ".join(self.shape) + ("," if self.trailing_comma else "")
        return f'{self.name}: T.Tensor(({extents}), "{self.dtype}")'


def param(name: str, shape: tuple, dtype: str) -> KernelParam:
    """A parameter whose extents may be given as ints or texts."""
    return KernelParam(name, tuple(str(x) for x in shape), dtype)


def custom_param(name: str, dims: tuple, batch, heads, seq_len, seq_len_kv) -> KernelParam:
    """A CustomIO tensor declared with `dims` (names of the problem's axes, or sizes): fp32, one
    extent per dim (sizes as numbers or symbol texts)."""
    sizes = {"batch": batch, "heads": heads, "seq_len": seq_len, "seq_len_kv": seq_len_kv}
    extents = tuple(str(sizes[d]) if isinstance(d, str) else str(d) for d in dims)
    return KernelParam(name, extents, "float32", trailing_comma=True)


@dataclass(frozen=True)
class GeneratedKernel:
    """A kernel's TileLang source (defining `main`) and `main`'s parameters, in order."""

    source: str
    params: tuple[KernelParam, ...]

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)
