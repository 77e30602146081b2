"""Where attnbench's data files are: the suites, the search spaces and the shape presets.

The top-level folders `suites/` and `search_spaces/` of the repository are the source of truth.
A checkout (run in place or installed editable) reads them there. A wheel carries copies made
at build time (`setup.py` copies them to `attnbench/data/<folder>/`), read through
`importlib.resources`. The shape presets live in the package already (`attnbench/data/`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# The top-level data folders a wheel carries as package data; setup.py copies the same list
# (it cannot import this module at build time), and tests/test_install_wheel.py checks both.
DATA_DIRS = ("suites", "search_spaces")
PACKAGE_DATA = "data"  # attnbench/data/: shapes.toml, plus the copies in a wheel


def checkout_root() -> Path | None:
    """The repository root when attnbench runs from a checkout, else None (an installed wheel).

    A checkout is recognised by its pyproject.toml beside the package; a wheel installs the
    package into site-packages, where there is none."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else None


def _package_dir() -> Path:
    found = resources.files("attnbench")
    if not isinstance(found, Path):
        # A zipped install: the runner and the tuner open these files by path.
        raise RuntimeError(f"attnbench's data files are not on disk ({found}); install attnbench "
                           "from a wheel or a checkout, not from a zip file")
    return found


def data_dir(name: str) -> Path:
    """The folder `name` (one of DATA_DIRS): the checkout's top-level folder, else the wheel's copy."""
    if name not in DATA_DIRS:
        raise ValueError(f"name={name!r}: expected one of {', '.join(DATA_DIRS)}")
    root = checkout_root()
    if root is not None and (root / name).is_dir():
        return root / name
    return _package_dir() / PACKAGE_DATA / name


def package_file(name: str) -> Path:
    """A data file that lives in the package itself (attnbench/data/<name>), e.g. shapes.toml."""
    return _package_dir() / PACKAGE_DATA / name
