"""scripts/test.sh's PostgreSQL (scripts/ci.d/pre-postgres.sh): the server it starts is stopped
when test.sh exits, however it exits; a server that was already running is left running.

Each test runs the two sourced steps in a bash driver, as test.sh does, on a private cluster
(its own data folder and port)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
INITDB = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))


def _driver(with_exit_hooks: bool, wait: bool) -> str:
    """Bash that sources the steps as test.sh does, proves the server answers, prints "ready",
    then exits (wait=False) or waits to be terminated (wait=True)."""
    lines = ["set -euo pipefail"]
    if with_exit_hooks:
        lines.append("source scripts/ci.d/on-exit.sh")
    lines += [
        "source scripts/ci.d/pre-postgres.sh",
        "python -c \"import os, psycopg; url = os.environ['ATTNBENCH_TEST_PG_URL']; "
        "print(psycopg.connect(url.replace('+psycopg', '')).execute('SELECT 41 + 1').fetchone()[0])\"",
        "echo ready",
    ]
    if wait:
        lines += ["sleep 60 & sleeper=$!", 'attnbench_on_exit kill "$sleeper"', 'wait "$sleeper"']
    return "\n".join(lines) + "\n"


@pytest.fixture
def cluster():
    """(env, status) for a private cluster; whatever still runs at the end is stopped."""
    if not INITDB:
        if os.environ.get("ATTNBENCH_REQUIRE_PG"):
            pytest.fail("PostgreSQL is not installed (scripts/ci.d/pre-postgres.sh installs it)")
        pytest.skip("PostgreSQL is not installed")
    if os.geteuid() != 0:
        pytest.skip("pre-postgres.sh runs the server as the postgres user, which needs root")
    pg_dir = Path(tempfile.mkdtemp(prefix="attnbench-pg-test-", dir="/tmp"))  # postgres reads it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNBENCH_")}
    env.update(ATTNBENCH_PG_DIR=str(pg_dir), ATTNBENCH_PG_PORT=str(port),
               PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}")
    pg_ctl = ["runuser", "-u", "postgres", "--", str(Path(INITDB[-1]).parent / "pg_ctl"),
              "-D", str(pg_dir / "data")]

    def running() -> bool:
        return subprocess.run([*pg_ctl, "status"], capture_output=True).returncode == 0

    yield env, running
    if running():
        subprocess.run([*pg_ctl, "stop", "-m", "immediate"], capture_output=True)
    shutil.rmtree(pg_dir, ignore_errors=True)


def _start_driver(env: dict, with_exit_hooks: bool, wait: bool) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "-c", _driver(with_exit_hooks, wait)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "ready":
            break
    assert lines[-2:] == ["42", "ready"], (lines, proc.stderr.read() if proc.poll() else "")
    return proc


def test_the_server_it_started_is_stopped_when_the_script_ends(cluster):
    env, running = cluster
    proc = _start_driver(env, with_exit_hooks=True, wait=False)
    assert proc.wait(timeout=60) == 0
    assert not running()


def test_the_server_it_started_is_stopped_when_the_script_is_terminated(cluster):
    env, running = cluster
    proc = _start_driver(env, with_exit_hooks=True, wait=True)
    assert running()
    proc.send_signal(signal.SIGTERM)  # Ctrl-C or a CI time limit
    assert proc.wait(timeout=60) == 143
    assert not running()


def test_a_server_already_running_is_left_running(cluster):
    env, running = cluster
    first = _start_driver(env, with_exit_hooks=False, wait=False)  # someone else's server
    assert first.wait(timeout=60) == 0 and running()
    second = _start_driver(env, with_exit_hooks=True, wait=False)  # test.sh reusing it
    assert second.wait(timeout=60) == 0
    assert running()
