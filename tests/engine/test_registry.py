"""The kernel-kind registry names each kind once: its search space, validity model, default,
generator, builder, launcher and reference; nothing else in the code spells a kind's name."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from engine.kernels.registry import KINDS, get_kind, kind_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_kind_is_complete(name):
    kind = KINDS[name]
    space = tomllib.loads(kind.search_space.read_text())
    assert space["template"] == name
    cfg = kind.default(128, 128, 2)
    assert isinstance(cfg, kind.config_type) and kind.problems(cfg, 128, 128, 2) == []
    assert set(space["params"]) <= set(cfg.to_dict())
    assert kind_for(kind.family, kind.mode) is kind
    assert all(callable(f) for f in (kind.generate, kind.build, kind.launch, kind.reference))


def test_unknown_kinds_are_named():
    with pytest.raises(ValueError, match="attention_fwd"):
        get_kind("attention")
    with pytest.raises(ValueError, match="family='linear', mode='decode'"):
        kind_for("linear", "decode")


def test_kind_names_are_spelled_only_in_the_registry():
    spelled = []
    for pkg in ("engine", "attnbench"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "engine" / "kernels" / "registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in KINDS:
                    spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not spelled, f"kind names as literals outside the registry: {spelled}"
