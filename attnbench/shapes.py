"""Shape presets: the attention geometry (heads, head dims) of known models.

The numbers live in `attnbench/data/shapes.toml`, each preset with the `source` of its numbers.
Sequence length and batch are not part of a preset: suites choose them per case.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from attnbench.resources import package_file

SHAPES_FILE = package_file("shapes.toml")

_KEYS = {"heads_q", "heads_kv", "head_dim", "head_dim_v", "state_dim", "source", "linear"}
LINEAR_KEYS = ("heads_q", "heads_k", "heads", "head_dim", "head_dim_v")


@dataclass(frozen=True)
class ShapePreset:
    name: str
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    source: str
    state_dim: int | None = None
    linear: tuple[tuple[str, int], ...] = ()  # the shapes file's `linear` table, if any

    @property
    def gqa(self) -> bool:
        return self.heads_kv != self.heads_q

    def linear_sizes(self) -> dict[str, int]:
        """The model read as linear attention: q heads, k heads, value (output) heads and the
        q/k and value head dims (LINEAR_KEYS); the preset's `linear` table overrides the
        default reading (heads_q, heads_kv, heads_q, head_dim, head_dim_v)."""
        sizes = dict(zip(LINEAR_KEYS, (self.heads_q, self.heads_kv, self.heads_q, self.head_dim,
                                       self.head_dim_v), strict=True))
        return {**sizes, **dict(self.linear)}


def _positive_int(name: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"shape preset {name!r}: {key} must be a positive integer, got {value!r}")
    return value


def parse_shapes(data: dict) -> dict[str, ShapePreset]:
    """Validate the parsed TOML of a shapes file and build the presets."""
    presets: dict[str, ShapePreset] = {}
    for name, entry in data.items():
        if not isinstance(entry, dict):
            raise ValueError(f"shape preset {name!r}: expected a table, got {entry!r}")
        unknown = set(entry) - _KEYS
        if unknown:
            raise ValueError(
                f"shape preset {name!r}: unknown keys {sorted(unknown)}; expected {sorted(_KEYS)}"
            )
        for key in ("heads_q", "head_dim", "source"):
            if key not in entry:
                raise ValueError(f"shape preset {name!r}: missing required key {key!r}")
        source = entry["source"]
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"shape preset {name!r}: source must be a non-empty string")
        hq = _positive_int(name, "heads_q", entry["heads_q"])
        hkv = _positive_int(name, "heads_kv", entry.get("heads_kv", hq))
        if hq % hkv:
            raise ValueError(
                f"shape preset {name!r}: heads_q ({hq}) must be a multiple of heads_kv ({hkv})"
            )
        d = _positive_int(name, "head_dim", entry["head_dim"])
        dv = _positive_int(name, "head_dim_v", entry.get("head_dim_v", d))
        state = entry.get("state_dim")
        if state is not None:
            state = _positive_int(name, "state_dim", state)
        presets[name] = ShapePreset(name, hq, hkv, d, dv, source, state,
                                    _linear_table(name, entry.get("linear", {})))
    return presets


def _linear_table(name: str, table: object) -> tuple[tuple[str, int], ...]:
    if not isinstance(table, dict):
        raise ValueError(f"shape preset {name!r}: linear must be a table, got {table!r}")
    unknown = set(table) - set(LINEAR_KEYS)
    if unknown:
        raise ValueError(f"shape preset {name!r}: linear has unknown keys {sorted(unknown)}; "
                         f"expected {list(LINEAR_KEYS)}")
    sizes = {k: _positive_int(name, f"linear.{k}", v) for k, v in table.items()}
    heads = sizes.get("heads")
    for key in ("heads_q", "heads_k"):
        if heads is not None and key in sizes and heads % sizes[key]:
            raise ValueError(f"shape preset {name!r}: linear.heads ({heads}) must be a multiple "
                             f"of linear.{key} ({sizes[key]})")
    return tuple(sizes.items())


def load_shapes(path: Path | str | None = None) -> dict[str, ShapePreset]:
    """All presets of a shapes file (default: the packaged one)."""
    if path is None:
        return dict(_default_shapes())
    with open(path, "rb") as f:
        return parse_shapes(tomllib.load(f))


@functools.cache
def _default_shapes() -> dict[str, ShapePreset]:
    with open(SHAPES_FILE, "rb") as f:
        return parse_shapes(tomllib.load(f))


def shape_names() -> list[str]:
    return sorted(_default_shapes())


def get_shape(name: str) -> ShapePreset:
    """The preset called `name`; a ValueError lists the known names otherwise."""
    shapes = _default_shapes()
    if name not in shapes:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(sorted(shapes))}")
    return shapes[name]
