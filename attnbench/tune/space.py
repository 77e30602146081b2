"""Search spaces as data: `search_spaces/<template>.toml` -> SearchSpace. A space's params are
fields of its kind's config type (engine.kernels.registry: KernelConfig, DecodeConfig, ...)."""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from attnbench.resources import data_dir
from engine.kernels.registry import KINDS, get_kind
from engine.plan.config import KernelConfig

SPACES_DIR = data_dir("search_spaces")  # the checkout's search_spaces/, or the wheel's copy


def config_type(template: str) -> type:
    """The config type of kind `template`; KernelConfig for a name the registry lacks (an
    ad-hoc space in a test)."""
    return KINDS[template].config_type if template in KINDS else KernelConfig


class SearchSpaceError(ValueError):
    """A malformed search-space file."""


@dataclass(frozen=True)
class SearchSpace:
    template: str
    params: tuple[tuple[str, tuple[Any, ...]], ...]  # ordered (name, choices)
    seeds: tuple[Any, ...]  # configs of config_type
    exhaustive_max_valid: int = 32
    n_startup_trials: int = 8
    source: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.params)

    @property
    def config_type(self) -> type:
        return config_type(self.template)

    def choices(self, name: str) -> tuple[Any, ...]:
        return dict(self.params)[name]

    def config(self, params: dict[str, Any]) -> Any:
        return self.config_type(**{n: params[n] for n in self.names if n in params})

    def params_of(self, cfg) -> dict[str, Any]:
        return {n: getattr(cfg, n) for n in self.names}

    def contains(self, cfg) -> bool:
        if not isinstance(cfg, self.config_type):
            return False
        default = self.config_type()
        for f in fields(self.config_type):
            if f.name in self.names:
                if getattr(cfg, f.name) not in self.choices(f.name):
                    return False
            elif getattr(cfg, f.name) != getattr(default, f.name):
                return False
        return True

    def all_configs(self) -> list:
        combos = itertools.product(*(c for _, c in self.params))
        return [self.config_type(**dict(zip(self.names, combo, strict=True))) for combo in combos]

    def problems(self, cfg, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                 **extra: int) -> list[str]:
        """Why the template's validity model rejects `cfg` (empty list: valid); `extra`: what
        the kind's model takes beyond the head dims (decode: rows, Problem.validity_args)."""
        return get_kind(self.template).problems(cfg, head_dim, head_dim_v, elem_bytes, **extra)

    def valid_configs(self, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                      **extra: int) -> list:
        """Every config of the space the validity model accepts, in a stable order."""
        return [c for c in self.all_configs()
                if not self.problems(c, head_dim, head_dim_v, elem_bytes, **extra)]


def space_path(template: str, spaces_dir: Path | None = None) -> Path:
    """A kind's search space file (as the registry names it, else `template`.toml) in
    `spaces_dir`, by default the checkout's search_spaces/ or the wheel's copy of it."""
    name = KINDS[template].search_space.name if template in KINDS else f"{template}.toml"
    return (spaces_dir or SPACES_DIR) / name


def load_space(template: str, spaces_dir: Path | None = None) -> SearchSpace:
    path = space_path(template, spaces_dir)
    if not path.exists():
        have = sorted(p.stem for p in path.parent.glob("*.toml"))
        raise SearchSpaceError(
            f"template={template!r}: no search space {path}; known templates: {have}"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SearchSpaceError(f"{path}: not valid TOML ({exc})") from exc
    return parse_space(data, source=str(path), template=template)


def parse_space(data: dict, *, source: str = "<data>", template: str | None = None) -> SearchSpace:
    unknown = set(data) - {"template", "description", "params", "search", "seed"}
    if unknown:
        raise SearchSpaceError(f"{source}: unknown top-level key(s) {sorted(unknown)}")
    tmpl = data.get("template", template)
    if not isinstance(tmpl, str) or (template is not None and tmpl != template):
        raise SearchSpaceError(f"{source}: template={tmpl!r}, expected {template!r}")
    ctype = config_type(tmpl)
    defaults = ctype()  # each field's type: its default's (ints, and KernelConfig's gemm_policy)
    known = sorted(f.name for f in fields(ctype))
    raw = data.get("params")
    if not isinstance(raw, dict) or not raw:
        raise SearchSpaceError(f"{source}: [params] must map {ctype.__name__} fields to lists")
    params = []
    for name, choices in raw.items():
        if name not in known:
            raise SearchSpaceError(
                f"{source}: params.{name} is not a {ctype.__name__} field; known: {known}"
            )
        want = type(getattr(defaults, name))
        if (
            not isinstance(choices, list)
            or not choices
            or any(type(c) is not want for c in choices)
            or len(set(choices)) != len(choices)
        ):
            raise SearchSpaceError(
                f"{source}: params.{name}={choices!r}: expected a non-empty list of distinct "
                f"{want.__name__} values"
            )
        params.append((name, tuple(choices)))
    search = data.get("search", {})
    bad = set(search) - {"exhaustive_max_valid", "n_startup_trials"}
    if bad:
        raise SearchSpaceError(f"{source}: unknown [search] key(s) {sorted(bad)}")
    space = SearchSpace(
        template=tmpl,
        params=tuple(params),
        seeds=(),
        exhaustive_max_valid=int(search.get("exhaustive_max_valid", 32)),
        n_startup_trials=int(search.get("n_startup_trials", 8)),
        source=source,
    )
    seeds = []
    for i, s in enumerate(data.get("seed", [])):
        try:
            cfg = ctype.from_dict(dict(s))
        except (TypeError, ValueError) as exc:
            raise SearchSpaceError(f"{source}: seed #{i}: {exc}") from exc
        if not space.contains(cfg):
            raise SearchSpaceError(f"{source}: seed #{i} {cfg.key()} is outside [params]")
        seeds.append(cfg)
    return SearchSpace(**{**space.__dict__, "seeds": tuple(seeds)})
