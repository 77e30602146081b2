"""A real install: the wheel built from this tree, installed into a fresh virtual environment
outside the checkout, runs the main job and the tuner from a directory outside the checkout.

The package's own files (attnbench, engine, the suites, search spaces and shape presets) come from
the wheel. Its dependencies (torch, TileLang, Optuna, ...) are borrowed from this interpreter's
site-packages through a path file, which puts those folders on sys.path without running their
own .pth hooks: the checkout's editable install, if any, cannot leak into the fresh environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from attnbench.resources import DATA_DIRS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _source_tree(dst: Path) -> Path:
    """The files git would commit (tracked, and untracked but not ignored), copied to `dst`:
    a build in the checkout would leave build/ there, and reuse a stale one."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the wheel is built from the files git knows)")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():  # a tracked file deleted in the worktree is not part of the tree
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def _run(cmd: list, cwd: Path, env: dict | None = None, timeout: float = 300) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_tree(tmp / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", tmp / "dist", src], cwd=tmp)
    (found,) = (tmp / "dist").glob("attnbench-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh environment with the wheel installed; python at venv/bin/python."""
    env_dir = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=env_dir.parent)
    python = env_dir / "bin" / "python"
    # Installed before the dependencies become visible: pip must not see the checkout's own
    # (editable) attnbench in this interpreter's site-packages.
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          "-q", wheel], cwd=env_dir.parent)
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=env_dir.parent).strip()
    borrowed = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(purelib, "borrowed-dependencies.pth").write_text("\n".join(borrowed) + "\n")
    return env_dir


@pytest.fixture
def user_env(tmp_path) -> dict:
    """A user's environment: nothing pointing at the checkout or at this session's settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("ATTNBENCH_")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_wheel_carries_the_package_and_its_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in DATA_DIRS:
        files = sorted(p.name for p in (REPO / folder).iterdir() if p.is_file())
        assert files, f"{folder}/ is empty"
        missing = [f for f in files if f"attnbench/data/{folder}/{f}" not in names]
        assert not missing, f"{folder}/ files missing from the wheel: {missing}"
    assert "attnbench/data/shapes.toml" in names
    tracked = subprocess.run(["git", "ls-files", "attnbench", "engine"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    # Developers' notes beside the code (engine/kernels/README.md) are not read at run time.
    missing = [f for f in tracked
               if (REPO / f).is_file() and not f.endswith(".md") and f not in names]
    assert not missing, f"package files missing from the wheel: {missing}"


def test_installed_wheel_reads_its_own_files(venv, tmp_path, user_env):
    probe = (
        "import json, attnbench, engine, attnbench.shapes as sh, attnbench.suites as su, "
        "attnbench.tune.space as sp; print(json.dumps([attnbench.__file__, engine.__file__, "
        "str(sh.SHAPES_FILE), str(su.SUITES_DIR), str(sp.SPACES_DIR)]))"
    )
    out = _run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, env=user_env)
    paths = json.loads(out.strip().splitlines()[-1])
    for p in paths:
        assert Path(p).resolve().is_relative_to(venv.resolve()), f"{p} is not from the wheel"
        assert Path(p).exists(), p
    version = _run([venv / "bin" / "attnbench", "--version"], cwd=tmp_path, env=user_env)
    assert "attnbench 0.1.0 (installed at" in version and "torch " in version


def test_installed_wheel_runs_the_smoke_suite(venv, tmp_path, user_env):
    # Every case, few repetitions: this checks the install, not the timings.
    out = _run([venv / "bin" / "attnbench", "run", "suite", "smoke", "--repeat", "3",
                "--warmup", "1"], cwd=tmp_path, env=user_env)
    (rows_file,) = (tmp_path / "results").rglob("*smoke*.csv")  # under the working directory
    import pandas as pd

    from attnbench.suites import load_suite

    rows = pd.read_csv(rows_file)
    assert set(rows["case"]) == {c.name for c in load_suite("smoke").cases}, out
    assert (rows["status"] == "ok").sum() > 0, out


def test_installed_wheel_tunes_with_the_fake_objective(venv, tmp_path, user_env):
    tune_file = tmp_path / "tune.json"
    out = _run([venv / "bin" / "attnbench", "tune", "--objective", "fake", "--shape", "llama3-8b",
                "--seqlens", "1k", "--trials", "6", "--compile-jobs", "1", "--no-progress",
                "--tune-file", tune_file], cwd=tmp_path, env=user_env)
    assert (tmp_path / "results" / "tune" / "studies.db").is_file(), out  # default storage, cwd
    (entry,) = json.loads(tune_file.read_text())["entries"].values()
    assert entry["shape"]["heads_q"] == 32 and entry["shape"]["seqlen_q"] == 1024, entry  # llama3-8b
    assert entry["trials"] >= 6, entry
