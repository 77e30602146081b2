"""`attnbench tune` as separate processes (fake objective, no GPU): resume after SIGKILL, two
tuners sharing one study on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from engine.plan.config import KernelConfig

REPO = Path(__file__).resolve().parents[1]
SHAPE = ["--heads-q", "8", "--heads-kv", "2", "--head-dim", "128", "--seqlens", "2k",
         "--batch", "2"]


def _cmd(storage: str, trials: int, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "attnbench", "tune", *SHAPE, "--objective", "fake",
            "--trials", str(trials), "--storage", storage, "--compile-jobs", "1",
            "--tune-file", str(tmp_path / "tune.json"), "--no-progress", *extra]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _only_study(storage: str) -> optuna.Study:
    summaries = optuna.get_all_study_summaries(storage)
    assert len(summaries) == 1
    return optuna.load_study(study_name=summaries[0].study_name, storage=storage)


def _evaluated(study: optuna.Study):
    # Finished and counted. A trial killed between writing its attributes and telling the
    # study is still RUNNING: not finished, whatever its attributes say.
    return [t for t in study.get_trials()
            if t.state.is_finished() and t.user_attrs.get("evaluated")]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return
        except Exception:  # the study may not exist yet
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_resume_after_sigkill_loses_no_finished_trial(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    slow = ["--fake-options", json.dumps({"delay_s": 0.6})]
    proc = _start(_cmd(storage, 10, tmp_path, *slow), tmp_path / "run1.log")
    try:
        _wait_for(lambda: len(_evaluated(_only_study(storage))) >= 1, 120, "a finished trial")
        workers = _children(proc.pid)
        assert workers, "the tuner runs its compiles and benchmarks in worker processes"
        # Late in the study, so that its best config is (almost surely) among the killed
        # run's trials and the resumed run's own few trials do not reach it.
        _wait_for(lambda: len(_evaluated(_only_study(storage))) >= 7, 120, "7 finished trials")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Workers die with the tuner: nothing keeps running against the study.
    _wait_for(lambda: not [p for p in workers if _alive(p)], 15, "orphaned workers to exit")
    before = {t.number: (t.state, t.value) for t in _evaluated(_only_study(storage))}
    assert 7 <= len(before) < 10

    done = subprocess.run(_cmd(storage, 10, tmp_path), cwd=REPO, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    study = _only_study(storage)
    after = {t.number: (t.state, t.value) for t in _evaluated(study)}
    assert len(after) == 10
    assert all(after[n] == before[n] for n in before)  # finished trials kept as they were
    assert not [t for t in study.get_trials() if t.state == TrialState.RUNNING]
    reaped = [t for t in study.get_trials() if "died" in t.user_attrs.get("fail_reason", "")]
    assert all(t.state == TrialState.FAIL and not t.user_attrs.get("evaluated") for t in reaped)
    # The tune file holds the best of the whole study, the killed run's trials included.
    _assert_entry_is_the_study_best(tmp_path)


def _assert_entry_is_the_study_best(tmp_path: Path) -> None:
    best = _only_study(f"sqlite:///{tmp_path / 's.db'}").best_trial
    (entry,) = json.loads((tmp_path / "tune.json").read_text())["entries"].values()
    # (the config as the tune file holds it: TileLang's pipeline is the unwritten schedule)
    assert KernelConfig.from_dict(entry["config"]) == KernelConfig.from_dict(best.params)
    assert entry["best_trial"] == best.number
    assert entry["trial_latency_ms"] == best.value
    # The fake objective is deterministic, so the A/B rounds re-time the winner exactly.
    assert entry["latency_ms"] == pytest.approx(best.value)
    assert entry["outcome"] == "tuned" and entry["confirm"]["faster"]
    assert entry["latency_ms"] < entry["default_latency_ms"]


def test_ctrl_c_writes_the_best_so_far_then_exits_130(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    slow = ["--fake-options", json.dumps({"delay_s": 0.4})]
    log = tmp_path / "run.log"
    # Its own process group, which a terminal's Ctrl-C signals as a whole (workers included),
    # with SIGINT handled as a terminal's process has it: a test run started in the background
    # (`cmd &` without job control) passes SIGINT on ignored, and the tuner keeps it so.
    proc = subprocess.Popen(_cmd(storage, 40, tmp_path, *slow), cwd=REPO, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: len(_evaluated(_only_study(storage))) >= 3, 120, "3 finished trials")
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 130, out
    assert "interrupted" in out and "wrote" in out
    study = _only_study(storage)
    assert 3 <= len(_evaluated(study)) < 40
    assert not [t for t in study.get_trials() if t.state == TrialState.RUNNING]
    _assert_entry_is_the_study_best(tmp_path)


def _two_tuners_share_one_study(storage: str, tmp_path: Path) -> None:
    slow = ["--fake-options", json.dumps({"delay_s": 0.2})]
    procs = [_start(_cmd(storage, 8, tmp_path, *slow, "--seed", str(i)), tmp_path / f"w{i}.log")
             for i in range(2)]
    try:
        for i, p in enumerate(procs):
            assert p.wait(timeout=300) == 0, (tmp_path / f"w{i}.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    study = _only_study(storage)
    ev = _evaluated(study)
    assert 8 <= len(ev) <= 10  # the last in-flight trial of each tuner may overshoot
    owners = {t.user_attrs["owner"] for t in ev}
    assert len(owners) == 2, f"both tuners should have evaluated trials, got {owners}"
    numbers = [t.number for t in study.get_trials()]
    assert len(numbers) == len(set(numbers))
    assert not [t for t in study.get_trials() if t.state == TrialState.RUNNING]
    # Search configs are never measured twice. The one designed exception: every tuner run
    # measures the engine's default config itself (its same-run baseline for the tune-file
    # rule), so two runs started together may both measure it, once each.
    keys = [t.user_attrs["config"] for t in ev if not t.user_attrs.get("baseline")]
    assert len(keys) == len(set(keys)), "no search config is measured twice"
    baselines = [t for t in ev if t.user_attrs.get("baseline")]
    runs = [t.user_attrs["run"] for t in baselines]
    assert len(runs) == len(set(runs)), "at most one baseline measurement per run"
    assert len({t.user_attrs["config"] for t in baselines}) <= 1, "baselines measure the default only"


def test_two_tuners_share_one_sqlite_study(tmp_path):
    _two_tuners_share_one_study(f"sqlite:///{tmp_path / 's.db'}", tmp_path)


@pytest.fixture
def pg_url():
    url = os.environ.get("ATTNBENCH_TEST_PG_URL")
    if not url:
        if os.environ.get("ATTNBENCH_REQUIRE_PG") == "1":
            pytest.fail("ATTNBENCH_REQUIRE_PG=1 but ATTNBENCH_TEST_PG_URL is not set")
        pytest.skip("ATTNBENCH_TEST_PG_URL is not set (scripts/ci.d/pre-postgres.sh sets it)")
    # A fresh database per test so the study list starts empty.
    import sqlalchemy

    name = f"attnbench_t{os.getpid()}_{time.monotonic_ns() % 10**9}"
    admin = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    base = url.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with admin.connect() as c:
        c.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def test_two_tuners_share_one_postgresql_study(tmp_path, pg_url):
    _two_tuners_share_one_study(pg_url, tmp_path)


def test_bad_tune_arguments_are_clear_errors(capsys, monkeypatch):
    from attnbench import cli
    from engine.runtime import tilelang_backend

    assert cli.main(["tune", "--seqlens", "2k"]) == 2
    assert "--shape" in capsys.readouterr().err  # no head geometry
    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", False)
    assert cli.main(["tune", "--shape", "llama3-8b", "--mode", "bwd", "--seqlens", "1k"]) == 2
    assert "ATTNBENCH_KERNEL_BACKWARD=0" in capsys.readouterr().err


def _tune(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnbench", "tune", "--shape", "llama3-8b",
                           "--seqlens", "1k", "--tune-file", str(tmp_path / "tune.json"),
                           *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, expected", [
    (["--variant", "nosuch", "--objective", "fake"],
     "attnbench tune: --variant: unknown variant 'nosuch'; known: alibi, "),
    (["--storage", "notaurl", "--objective", "fake"],
     "attnbench tune: --storage: 'notaurl' is not a storage URL; expected a SQLAlchemy URL"),
    (["--storage", "sqlite:////proc/nope/s.db", "--objective", "fake"],
     "attnbench tune: --storage: 'sqlite:////proc/nope/s.db': cannot create the database file"),
])
def test_bad_arguments_fail_in_one_line_before_any_file_is_written(tmp_path, args, expected):
    if "--storage" not in args:
        args = [*args, "--storage", f"sqlite:///{tmp_path / 's.db'}"]
    done = _tune(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(expected) and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no study, no tune file


def test_tuning_the_engine_without_a_gpu_is_a_one_line_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = _tune(tmp_path, "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "no CUDA GPU found" in done.stderr and "--objective fake" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_bad_seqlens_names_its_flag_once(tmp_path):
    done = _tune(tmp_path, "--seqlens", "abc", "--objective", "fake")
    assert done.returncode == 2
    assert "argument --seqlens: 'abc' is not a positive length" in done.stderr
    assert "--seqlens: --seqlens" not in done.stderr


@pytest.mark.parametrize("spelling, name", [("bf16", "bf16"), ("bfloat16", "bf16"),
                                            ("fp16", "fp16"), ("float16", "fp16")])
def test_dtype_takes_both_spellings(spelling, name):
    from attnbench import cli

    args = cli.build_parser().parse_args(["tune", "--dtype", spelling])
    assert args.dtype == name


def test_dtype_outside_the_kernels_is_an_argument_error(capsys):
    from attnbench import cli

    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["tune", "--dtype", "float32"])
    assert exc.value.code == 2
    assert "argument --dtype: 'float32': expected bf16 or fp16" in capsys.readouterr().err


def test_tune_a_suites_engine_cases(tmp_path, capsys):
    """--suite: one study per half-precision engine case of the suite (here smoke's bf16
    cases; its float32 ones are not kernel dtypes), each written to the tune file."""
    from attnbench import cli

    rc = cli.main(["tune", "--suite", "smoke", "--filter", "s128", "--objective", "fake",
                   "--trials", "2", "--no-progress", "--compile-jobs", "1",
                   "--storage", f"sqlite:///{tmp_path / 's.db'}",
                   "--tune-file", str(tmp_path / "tune.json"),
                   "--json-out", str(tmp_path / "out.json")])
    assert rc == 0, capsys.readouterr().err
    studies = json.loads((tmp_path / "out.json").read_text())
    names = [s["study_name"] for s in studies]
    assert len(names) == len(set(names)) == 2  # softmax and softmax_causal at smoke-gqa, bf16
    assert all(":b2_hq4_hkv2_sq128_skv128_d32_dv32:bf16:fwd:" in n for n in names)
    assert len(optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 's.db'}")) == 2
    assert cli.main(["tune", "--suite", "smoke", "--shape", "llama3-8b"]) == 2
    assert "drop --shape" in capsys.readouterr().err
    assert cli.main(["tune", "--shape", "llama3-8b", "--filter", "s128"]) == 2
    assert "--filter selects cases of --suite" in capsys.readouterr().err
