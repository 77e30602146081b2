"""`attnbench run suite` as a user runs it (a subprocess, no GPU): bad arguments and bad day
files are one-line errors before any measurement; a cut-off day file is repaired; the dry run
says what this machine skips; the table marks noisy rows; CPU runs stay out of results/runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from attnbench.results.read import read_results
from attnbench.results.schema import columns_of
from attnbench.results.store import append_rows, result_path

REPO = Path(__file__).resolve().parents[1]
TINY = ["--filter", "softmax/smoke-gqa/b2/s128/float32", "--impl", "reference",
        "--repeat", "2", "--warmup", "0", "--device", "cpu"]


def run(*args: str) -> subprocess.CompletedProcess:
    """The real entry point in a subprocess (~2 s of imports each: used sparingly)."""
    return subprocess.run([sys.executable, "-m", "attnbench", "run", "suite", "smoke", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def run_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """The same command through attnbench.cli.main in this process (no import cost)."""
    from attnbench import cli

    rc = cli.main(["run", "suite", "smoke", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("error: ")
    for needle in needles:
        assert needle in err, err
    assert "rows (" not in res.stdout  # nothing was measured
    return err


def test_bad_arguments_are_one_line_errors_from_the_entry_point():
    one_line_error(run("--sleep", "-5", "--impl", "", "--out", "/proc/nope"), "--sleep", "-5")
    one_line_error(run("--impl", ""), "--impl", "''")


@pytest.mark.parametrize("args, needles", [
    (["--sleep", "nan"], ["--sleep"]),
    (["--impl", "reference,"], ["--impl"]),
    (["--noise-threshold", "0"], ["--noise-threshold"]),
    (["--noise-threshold", "inf"], ["--noise-threshold"]),
    (["--attempts", "0"], ["--attempts"]),
    (["--retry-pause", "-1"], ["--retry-pause"]),
    (["--impl-timeout", "-1"], ["--impl-timeout"]),
    (["--filter", ""], ["--filter"]),
    (["--seed", "-1"], ["--seed"]),
    (["--repeat", "0"], ["--repeat"]),
])
def test_bad_numbers_and_names_are_one_line_errors(capsys, args, needles):
    one_line_error(run_here(capsys, *args), *needles)


def test_out_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys):
    one_line_error(run("--out", "/proc/nope", *TINY), "--out", "/proc/nope")
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    one_line_error(run_here(capsys, "--out", str(afile), *TINY), "--out", str(afile),
                   "not a folder")
    assert afile.read_text() == "keep me"


def test_day_file_of_another_schema_is_refused_with_its_name(tmp_path):
    day = result_path(tmp_path, "smoke", "cpu")
    day.write_text(",".join(columns_of(1)) + "\n")
    one_line_error(run("--out", str(tmp_path), *TINY), str(day), "header")
    assert day.read_text() == ",".join(columns_of(1)) + "\n"


def test_half_written_day_file_is_repaired_and_the_run_appends(tmp_path):
    from tests.test_results_store import row

    day = result_path(tmp_path, "smoke", "cpu")
    append_rows(day, [row(1), row(2)])
    day.write_text(day.read_text() + "2,smoke,softmax/smoke-gqa/b2/s1")  # a crashed writer
    res = run("--out", str(tmp_path), *TINY)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout.replace("\n", " ")
    assert "dropped a half-written last line" in out and "2 whole rows are kept" in out
    back = read_results(day)
    assert back["case"].tolist()[:2] == ["c1", "c2"] and len(back) == 2 + 3  # + fwd/bwd/both
    assert set(back["impl"][2:]) == {"reference"}
    assert "eta" in res.stdout  # the progress line carries its estimate


def test_dry_run_says_what_this_machine_skips_and_why(capsys):
    res = run_here(capsys, "--dry-run", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "softmax_causal/smoke-gqa/b2/s256/bfloat16" in out
    assert "on this machine (cpu)" in out
    assert "engine (every row): needs a Hopper GPU" in out
    assert "sdpa-flash (every row): needs a CUDA GPU" in out
    assert "sdpa-math (3 of 27 rows): variant sliding_window not supported" in out
    assert "reference (" not in out  # runs everywhere


def test_eta_text():
    from attnbench.commands.run import eta_text

    assert eta_text(0.0, 0, 10) == "eta --"
    assert eta_text(30.0, 1, 5) == "eta 2m00s"
    assert eta_text(10.0, 2, 3) == "eta 5s"
    assert eta_text(3600.0, 1, 3) == "eta 2h00m"
    assert eta_text(5.0, 3, 3) == "eta 0s"


def table_text(rows) -> str:
    from rich.console import Console

    from attnbench.commands.run import print_table

    console = Console(record=True, width=250, file=open("/dev/null", "w"))
    print_table(rows, console)
    return console.export_text()


def mk(impl: str, status: str, ms: float, spread: float) -> dict:
    return {"case": "c", "mode": "fwd", "impl": impl, "status": status, "latency_ms": ms,
            "latency_spread_ms": spread, "tflops": 1.0, "mfu": float("nan"), "speedup": 1.0,
            "rel_err": 1e-6, "reason": ""}


def test_table_marks_wide_spreads_and_noisy_rows_and_says_why_once():
    text = table_text([mk("tight", "ok", 1.0, 0.02), mk("wide", "ok", 2.0, 0.3),
                       mk("shaky", "noisy", 3.0, 0.12)])
    lines = {ln.split("│")[3].strip(): ln for ln in text.splitlines() if ln.count("│") > 4}
    assert "1*" not in lines["tight"] and " 2*" in lines["wide"] and " 3*" in lines["shaky"]
    assert text.count("interquartile spread above 10% of the median") == 1
    assert "* 2 rows" in text
    quiet = table_text([mk("tight", "ok", 1.0, 0.02)])
    assert "*" not in quiet and "interquartile" not in quiet


def test_cpu_runs_default_to_results_local(variants, tmp_path, monkeypatch):
    from attnbench.runner import CPU_OUT, GPU_OUT, Runner, RunOptions
    from tests.test_runner import FakeImpl, small_suite

    impls = {"base": FakeImpl("base")}
    runner = Runner(small_suite(impls, "base"), RunOptions(device="cpu"),
                    get_variant=variants.__getitem__, impls=impls)
    assert runner.path.parent == CPU_OUT == Path("results/local")
    assert GPU_OUT == Path("results/runs")
    ignored = subprocess.run(["git", "check-ignore", "-q", "results/local/x.csv"], cwd=REPO)
    assert ignored.returncode == 0, "results/local/ must be git-ignored"
    tracked = subprocess.run(["git", "check-ignore", "-q", "results/runs/x.csv"], cwd=REPO)
    assert tracked.returncode == 1


@pytest.mark.parametrize("name, content, needle", [
    ("bad.yaml", b"a: [", "not valid YAML"),
    ("bad.toml", b"\xff\xfe", "cannot read the suite file"),
    ("bad2.toml", b"x = [", "not valid TOML"),
])
def test_unreadable_suite_files_are_one_line_errors(tmp_path, capsys, name, content, needle):
    from attnbench import cli

    path = tmp_path / name
    path.write_bytes(content)
    rc = cli.main(["run", "suite", str(path), "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and needle in err and str(path) in err
