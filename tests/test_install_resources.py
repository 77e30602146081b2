"""Where the data files are found: a checkout reads its top-level suites/ and search_spaces/
(the source of truth); an installed wheel its own copies (tests/test_install_wheel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnbench import resources
from attnbench.shapes import SHAPES_FILE
from attnbench.suites import SUITES_DIR
from attnbench.tune.space import SPACES_DIR

REPO = Path(__file__).resolve().parents[1]


def test_a_checkout_reads_its_top_level_folders():
    assert resources.checkout_root() == REPO
    assert SUITES_DIR == REPO / "suites" and (SUITES_DIR / "smoke.toml").is_file()
    assert SPACES_DIR == REPO / "search_spaces" and (SPACES_DIR / "attention_fwd.toml").is_file()
    assert SHAPES_FILE == REPO / "attnbench" / "data" / "shapes.toml" and SHAPES_FILE.is_file()


def test_outside_a_checkout_the_package_copies_are_read(monkeypatch):
    monkeypatch.setattr(resources, "checkout_root", lambda: None)
    assert resources.data_dir("suites") == REPO / "attnbench" / "data" / "suites"


def test_unknown_data_folder_is_refused():
    with pytest.raises(ValueError, match="name='results': expected one of suites, search_spaces"):
        resources.data_dir("results")
