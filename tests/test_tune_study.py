"""The tuner's machinery with the deterministic fake objective (no GPU): constraint pruning,
seeding, exhaustive mode, failures and crash isolation, two GPU workers on one SQLite study,
and grid vs Optuna."""

from __future__ import annotations

import json

import optuna
import pytest
from optuna.trial import TrialState

from attnbench.tune.compare import compare_grid
from attnbench.tune.objective import FakeObjective, fake_latency_ms
from attnbench.tune.problem import Problem
from attnbench.tune.runner import TuneOptions, run_study
from attnbench.tune.space import SearchSpaceError, load_space, parse_space
from engine.kernels.attention_fwd.plan import config_problems
from engine.plan.config import KernelConfig
from engine.tuning.tune_file import lookup

# The tuner beats for its own trials (ask/tell); Optuna's hint about Study.optimize is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")

PROBLEM = Problem("softmax", batch=2, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_kv=4096,
                  head_dim=128, head_dim_v=128)
SMALL = {
    "template": "attention_fwd",
    "params": {"block_M": [64, 128, 256], "block_N": [32, 64, 128, 256], "num_stages": [2, 3],
               "threads": [256]},
    "seed": [{"block_M": 128, "block_N": 64, "num_stages": 2, "threads": 256}],
}


def _opts(tmp_path, **kw) -> TuneOptions:
    base = dict(storage=f"sqlite:///{tmp_path / 's.db'}", compile_jobs=2, progress=False,
                tune_file=tmp_path / "tune.json", bench_timeout_s=20, compile_timeout_s=20)
    base.update(kw)
    return TuneOptions(**base)


def _study(tmp_path, name) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 's.db'}")


def _evaluated(study):
    return [t for t in study.get_trials()
            if t.state.is_finished() and t.user_attrs.get("evaluated")]


def test_forward_space_is_data_and_big_enough():
    space = load_space("attention_fwd")
    valid = space.valid_configs(128, 128)
    assert len(valid) >= 48
    assert len(valid) < len(space.all_configs())  # the validity model prunes
    assert all(c in valid for c in space.seeds)
    assert KernelConfig() in space.seeds


def test_bad_space_files_are_clear_errors(tmp_path):
    with pytest.raises(SearchSpaceError, match="block_Q"):
        parse_space({"template": "t", "params": {"block_Q": [1]}})
    with pytest.raises(SearchSpaceError, match="distinct int"):
        parse_space({"template": "t", "params": {"block_M": [64, "128"]}})
    with pytest.raises(SearchSpaceError, match="outside"):
        parse_space({"template": "t", "params": {"block_M": [64]}, "seed": [{"block_M": 128}]})
    with pytest.raises(SearchSpaceError, match="known templates"):
        load_space("attention_nope")


def test_tpe_prunes_invalid_configs_and_starts_from_seeds(tmp_path):
    space = load_space("attention_fwd")
    res = run_study(FakeObjective(PROBLEM), space, _opts(tmp_path, trials=14, search="tpe"))
    assert res.evaluated == 14 and not res.exhaustive
    study = _study(tmp_path, res.study_name)
    trials = study.get_trials()
    # Seeds first, in the file's order.
    assert [t.params for t in trials[: len(space.seeds)]] == [
        space.params_of(c) for c in space.seeds
    ]
    for t in trials:
        cfg = KernelConfig(**t.params)
        problems = config_problems(cfg, 128, 128)
        if problems:  # invalid: pruned with a constraint, never compiled
            assert t.state == TrialState.PRUNED and "evaluated" not in t.user_attrs
            assert t.user_attrs["invalid"] and t.constraints["validity"] > 0
        if t.user_attrs.get("evaluated"):
            assert not problems
    # The fake's "compile failures" end as FAIL with their reason kept.
    for t in _evaluated(study):
        cfg = KernelConfig(**t.params)
        if cfg.block_N == 32 and cfg.num_stages == 3:
            assert t.state == TrialState.FAIL and "compile failed" in t.user_attrs["fail_reason"]
        else:
            assert t.state == TrialState.COMPLETE
            assert t.value == pytest.approx(fake_latency_ms(cfg, PROBLEM))
    # Best config went to the tune file and reads back.
    cfg, meta = lookup(tmp_path / "tune.json", template="attention_fwd", spec_hash="fake-spec",
                       dtype="bf16", mode="fwd", gpu="Fake GPU", shape=PROBLEM.shape())
    assert cfg.to_dict() == res.best_config and meta["latency_ms"] == res.best_latency_ms
    assert meta["trials"] == 14


def test_small_space_is_searched_exhaustively(tmp_path):
    space = parse_space(SMALL)
    valid = space.valid_configs(128, 128)
    res = run_study(FakeObjective(PROBLEM), space, _opts(tmp_path, trials=3))
    assert res.exhaustive and res.evaluated == len(valid) == res.target
    study = _study(tmp_path, res.study_name)
    keys = [t.user_attrs["config"] for t in _evaluated(study)]
    assert sorted(keys) == sorted(c.key() for c in valid)  # each valid config exactly once
    ok = [c for c in valid if not (c.block_N == 32 and c.num_stages == 3)]
    assert res.best_latency_ms == pytest.approx(min(fake_latency_ms(c, PROBLEM) for c in ok))
    # Running again finds the study complete: nothing new is evaluated.
    again = run_study(FakeObjective(PROBLEM), space, _opts(tmp_path, trials=3))
    assert again.evaluated == res.evaluated
    assert len(_evaluated(_study(tmp_path, res.study_name))) == len(valid)


def test_hang_crash_and_wrong_output_fail_only_their_trials(tmp_path):
    space = parse_space(SMALL)
    valid = space.valid_configs(128, 128)
    compiles = [c for c in valid if not (c.block_N == 32 and c.num_stages == 3)]
    hang, crash, wrong, unpicklable = (c.key() for c in compiles[:4])
    obj = FakeObjective(PROBLEM, hang_keys=(hang,), crash_keys=(crash,), wrong_keys=(wrong,),
                        unpicklable_keys=(unpicklable,))
    res = run_study(obj, space, _opts(tmp_path, bench_timeout_s=3, search="grid"))
    study = _study(tmp_path, res.study_name)
    by_key = {t.user_attrs["config"]: t for t in _evaluated(study)}
    assert len(by_key) == len(valid)
    assert by_key[hang].state == TrialState.FAIL
    assert "timed out" in by_key[hang].user_attrs["fail_reason"]
    assert by_key[crash].state == TrialState.FAIL
    assert "worker died" in by_key[crash].user_attrs["fail_reason"]
    assert "mismatch" in by_key[wrong].user_attrs["fail_reason"]
    # An error the worker cannot pickle back (tvm_ffi's ffi.Error) fails with its own reason.
    reason = by_key[unpicklable].user_attrs["fail_reason"]
    assert "No valid warp partition" in reason and "worker died" not in reason
    completed = [t for t in by_key.values() if t.state == TrialState.COMPLETE]
    assert len(completed) == len(compiles) - 4


def test_two_gpu_workers_share_one_sqlite_study(tmp_path):
    space = load_space("attention_fwd")
    res = run_study(FakeObjective(PROBLEM), space,
                    _opts(tmp_path, trials=12, devices=(0, 1), search="tpe"))
    study = _study(tmp_path, res.study_name)
    ev = _evaluated(study)
    assert 12 <= len(ev) <= 13  # two workers may overshoot by at most the last in-flight trial
    assert len({t.number for t in study.get_trials()}) == len(study.get_trials())
    assert not [t for t in study.get_trials() if t.state == TrialState.RUNNING]


def test_grid_vs_optuna_record(tmp_path):
    space = parse_space({**SMALL, "params": {**SMALL["params"], "num_stages": [1, 2, 3],
                                             "swizzle_panel": [0, 8]}})
    valid = space.valid_configs(128, 128)
    rec = compare_grid(FakeObjective(PROBLEM), space, _opts(tmp_path), out_dir=tmp_path)
    assert rec["grid"]["trials"] == len(valid)
    assert rec["optuna"]["trials"] == int(0.3 * len(valid))
    assert rec["optuna_gap_vs_grid_best"] >= 0
    on_disk = json.loads(open(rec["path"]).read())
    assert on_disk["pass"] == rec["pass"] and on_disk["grid"] == rec["grid"]
    # The fake objective is deterministic: both studies time a config alike.
    assert rec["remeasure_spread"] == 0
    assert rec["optuna_measured_gap_vs_grid_best"] == pytest.approx(rec["optuna_gap_vs_grid_best"])


def _result(name: str, timings: list[tuple[str, float]], n_valid: int = 10):
    from attnbench.tune.result import TuneResult

    best = min(timings, key=lambda kv: kv[1])
    return TuneResult(study_name=name, storage="", gpu="gpu", n_valid=n_valid, exhaustive=False,
                      target=len(timings), evaluated=len(timings), failed=0,
                      best_latency_ms=best[1], best_tflops=None, best_config=None,
                      best_trial=None, history=[t for _, t in timings],
                      history_keys=[k for k, _ in timings])


def test_comparison_scores_optunas_picks_by_the_grids_timings():
    from attnbench.tune.compare import comparison_record

    grid = _result("grid", [(f"c{i}", 1.0 + 0.1 * i) for i in range(10)])
    # Optuna finds the grid's best config c0 at its third trial but times it 4% slower.
    tpe = _result("tpe", [("c5", 1.52), ("c3", 1.31), ("c0", 1.04)])
    rec = comparison_record(grid, tpe)
    assert rec["optuna_gap_vs_grid_best"] == pytest.approx(0.0)
    assert rec["optuna_measured_gap_vs_grid_best"] == pytest.approx(0.04)
    assert rec["optuna_trials_to_within_3pct"] == 3
    assert rec["remeasure_spread"] == pytest.approx(1.52 / 1.5 - 1)  # median of 1.3%, 0.8%, 4%
    assert rec["pass"]
    # A search that never tries a config within 3% of the grid's best fails however lucky its
    # own timings were.
    lucky = _result("tpe", [("c5", 0.9), ("c3", 1.3), ("c4", 1.4)])
    rec = comparison_record(grid, lucky)
    assert rec["optuna_gap_vs_grid_best"] == pytest.approx(0.3)
    assert rec["optuna_trials_to_within_3pct"] is None and not rec["pass"]


def _trace(path):
    return [json.loads(line) for line in open(path)]


def test_compile_of_next_trial_overlaps_benchmark_of_current(tmp_path):
    space = parse_space(SMALL)
    trace = tmp_path / "trace.jsonl"
    obj = FakeObjective(PROBLEM, delay_s=0.4, trace_path=str(trace))
    run_study(obj, space, _opts(tmp_path, trials=6, search="tpe", compile_jobs=2))
    events = _trace(trace)
    compiles = {e["key"]: e for e in events if e["step"] == "compile"}
    benches = sorted((e for e in events if e["step"] == "bench"), key=lambda e: e["t0"])
    assert len(benches) >= 6
    # The compile of trial N+1 started before the benchmark of trial N ended (compiles run
    # ahead instead of waiting for a whole batch of benchmarks), for every consecutive pair,
    # and at least one ran while a benchmark did.
    overlapped = 0
    for cur, nxt in zip(benches, benches[1:], strict=False):
        c = compiles[nxt["key"]]
        assert c["t0"] < cur["t1"], (cur, c)
        overlapped += c["t1"] > cur["t0"]
    assert overlapped


def test_default_config_is_measured_first_and_gates_the_tune_file(tmp_path):
    from engine.kernels.attention_fwd.plan import default_forward_config

    space = load_space("attention_fwd")
    default = default_forward_config(128, 128)
    trace = tmp_path / "trace.jsonl"
    res = run_study(FakeObjective(PROBLEM, trace_path=str(trace)), space,
                    _opts(tmp_path, trials=6, search="tpe"))
    first = min((e for e in _trace(trace) if e["step"] == "bench"), key=lambda e: e["t0"])
    assert first["key"] == default.key()
    assert res.baseline_latency_ms == pytest.approx(fake_latency_ms(default, PROBLEM))
    assert res.run_best_latency_ms <= res.baseline_latency_ms
    cfg, meta = lookup(tmp_path / "tune.json", template="attention_fwd", spec_hash="fake-spec",
                       dtype="bf16", mode="fwd", gpu="Fake GPU", shape=PROBLEM.shape())
    assert meta["latency_ms"] == res.run_best_latency_ms <= meta["default_latency_ms"]
    # A second run of the same (resumed) study measures the default again, without counting it.
    again = run_study(FakeObjective(PROBLEM), space, _opts(tmp_path, trials=8, search="tpe"))
    assert again.baseline_latency_ms is not None and again.run_id != res.run_id
    study = _study(tmp_path, res.study_name)
    base = [t for t in study.get_trials() if t.user_attrs.get("baseline")]
    assert len(base) == 2 and [bool(t.user_attrs.get("evaluated")) for t in base] == [True, False]
    assert len(_evaluated(study)) == 8


def test_entry_of_the_baseline_is_replaced_by_a_confirmed_winner(tmp_path):
    """An exact entry is what the engine runs now: the baseline. A winner that beats it in this
    run's A/B rounds replaces it, whatever latency the entry recorded in an older run."""
    from engine.tuning.tune_file import store

    space = load_space("attention_fwd")
    slow = KernelConfig(64, 64, 2, 128)
    assert space.contains(slow)
    store(tmp_path / "tune.json", {
        "template": "attention_fwd", "spec_hash": "fake-spec", "dtype": "bf16", "mode": "fwd",
        "gpu": "Fake GPU", "shape": PROBLEM.shape(), "config": slow.to_dict(),
        "latency_ms": 1e-3, "tflops": 1e6, "date": "2026-11-22T00:00:00+00:00"})
    res = run_study(FakeObjective(PROBLEM), space, _opts(tmp_path, trials=4, search="tpe"))
    assert res.baseline_config == slow.to_dict()
    cfg, meta = lookup(tmp_path / "tune.json", template="attention_fwd", spec_hash="fake-spec",
                       dtype="bf16", mode="fwd", gpu="Fake GPU", shape=PROBLEM.shape())
    assert cfg.to_dict() == res.best_config != slow.to_dict() and meta["outcome"] == "tuned"
    assert meta["default_latency_ms"] == pytest.approx(fake_latency_ms(slow, PROBLEM))
    assert "replaced M64_N64" in res.tune_file_note


def test_other_tuners_faster_entry_is_kept_and_failed_default_writes_nothing(tmp_path, caplog):
    from engine.kernels.attention_fwd.plan import default_forward_config
    from engine.tuning.tune_file import store

    space = load_space("attention_fwd")
    # An entry the baseline is not (outside this space: another tuner's, written meanwhile)
    # with a faster recorded latency stays.
    other_cfg = KernelConfig(128, 128, 2, 256, swizzle_panel=16)
    assert not space.contains(other_cfg)
    store(tmp_path / "tune.json", {
        "template": "attention_fwd", "spec_hash": "fake-spec", "dtype": "bf16", "mode": "fwd",
        "gpu": "Fake GPU", "shape": PROBLEM.shape(), "config": other_cfg.to_dict(),
        "latency_ms": 1e-3, "tflops": 1e6, "date": "2026-11-22T00:00:00+00:00"})
    with caplog.at_level("INFO"):
        res = run_study(FakeObjective(PROBLEM), space, _opts(tmp_path, trials=4, search="tpe"))
    assert res.tune_file is None and "kept the entry" in res.tune_file_note
    assert "kept the existing entry" in caplog.text
    cfg, meta = lookup(tmp_path / "tune.json", template="attention_fwd", spec_hash="fake-spec",
                       dtype="bf16", mode="fwd", gpu="Fake GPU", shape=PROBLEM.shape())
    assert cfg == other_cfg and meta["latency_ms"] == 1e-3
    # The default fails (wrong output): the winner cannot be timed against it, nothing written.
    other = tmp_path / "other"
    other.mkdir()
    bad = FakeObjective(PROBLEM, wrong_keys=(default_forward_config(128, 128).key(),))
    res = run_study(bad, space, _opts(other, trials=4, search="tpe"))
    assert res.best_latency_ms is not None and res.baseline_latency_ms is None
    assert not (other / "tune.json").exists() and "A/B timing" in res.tune_file_note
    assert "mismatch" in res.tune_file_note


def test_baseline_is_the_nearest_tuned_entry_the_engine_would_use(tmp_path):
    """A study of a shape without its own entry measures the nearest tuned shape's config first
    (what the engine runs now), not the bare default, so what it writes is never slower."""
    from engine.kernels.attention_fwd.plan import default_forward_config
    from engine.tuning.tune_file import store

    space = load_space("attention_fwd")
    near = KernelConfig(128, 64, 2, 256)
    assert near != default_forward_config(128, 128) and space.contains(near)
    store(tmp_path / "tune.json", {
        "template": "attention_fwd", "spec_hash": "fake-spec", "dtype": "bf16", "mode": "fwd",
        "gpu": "Fake GPU", "shape": {**PROBLEM.shape(), "seqlen_q": 8192, "seqlen_kv": 8192},
        "config": near.to_dict(), "latency_ms": 1.0, "tflops": 1.0,
        "date": "2026-11-22T00:00:00+00:00"})
    trace = tmp_path / "trace.jsonl"
    res = run_study(FakeObjective(PROBLEM, trace_path=str(trace)), space,
                    _opts(tmp_path, trials=4, search="tpe"))
    first = min((e for e in _trace(trace) if e["step"] == "bench"), key=lambda e: e["t0"])
    assert first["key"] == near.key() and res.baseline_config == near.to_dict()
    assert res.baseline_latency_ms == pytest.approx(fake_latency_ms(near, PROBLEM))
    assert res.run_best_latency_ms <= res.baseline_latency_ms


def test_interrupted_comparison_still_writes_a_partial_record(tmp_path):
    space = parse_space({**SMALL, "params": {**SMALL["params"], "num_stages": [1, 2, 3]}})
    # 1 s per benchmark and a 16 s budget: a few of the 14 grid trials finish even when
    # starting the worker processes takes seconds on a loaded 2-core machine.
    obj = FakeObjective(PROBLEM, delay_s=2.0)
    rec = compare_grid(obj, space, _opts(tmp_path, timeout_s=16.0), out_dir=tmp_path)
    on_disk = json.loads(open(rec["path"]).read())
    assert on_disk["complete"] is False and on_disk["pass"] is False
    assert on_disk["incomplete_reasons"]
    assert 0 < on_disk["grid"]["trials"] < len(space.valid_configs(128, 128))


def test_backward_space_tunes_the_backward_kernel_the_engine_then_uses(tmp_path):
    """`--mode bwd`: the attention_bwd space (pruned by the backward's own validity model) is
    searched, the best config lands in the tune file under attention_bwd, and a module of that
    spec and shape builds its backward kernel with it."""
    import torch

    from engine.kernels.attention_bwd.plan import backward_config_problems, default_backward_config
    from engine.variants import VARIANTS

    space = load_space("attention_bwd")
    valid = space.valid_configs(128, 128)
    assert 24 <= len(valid) < len(space.all_configs())
    assert all(not backward_config_problems(c, 128, 128) for c in valid)
    assert default_backward_config(128, 128) in valid
    sizes = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1024, seqlen_kv=1024, head_dim=128,
                 head_dim_v=128)
    mod = VARIANTS["softmax_causal"].build(**sizes, dtype=torch.bfloat16, backend="reference",
                                           tune_file=str(tmp_path / "tune.json"))
    problem = Problem("softmax_causal", dtype="bf16", mode="bwd", **sizes)
    fake = FakeObjective(problem, spec=mod.spec_hash, gpu="none")
    res = run_study(fake, space, _opts(tmp_path, trials=12))
    assert res.baseline_config == default_backward_config(128, 128).to_dict()
    tuned = KernelConfig.from_dict(res.run_best_config)
    hit = lookup(tmp_path / "tune.json", template="attention_bwd", spec_hash=mod.spec_hash,
                 dtype="bf16", mode="bwd", gpu="none", shape=sizes)
    assert hit is not None and hit[0] == tuned
    assert mod.backward_kernels().config == tuned
    # An explicit backward_config wins over the tune file.
    other = next(c for c in valid if c != tuned)
    pinned = VARIANTS["softmax_causal"].build(**sizes, dtype=torch.bfloat16, backend="reference",
                                              tune_file=str(tmp_path / "tune.json"),
                                              backward_config=other)
    assert pinned.backward_kernels().config == other


def test_reaper_uncounts_a_trial_killed_between_its_attributes_and_tell(tmp_path):
    """SIGKILL can land after a trial's measurement attributes are written and before the
    study is told: the trial is still RUNNING. Resuming fails it, marks it not evaluated and
    queues its config again."""
    import socket
    import subprocess
    import sys

    from attnbench.tune.storage import OWNER_ATTR, make_storage, reap_dead_trials

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    storage = make_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    trial.suggest_categorical("block_M", [64, 128])
    trial.set_user_attr(OWNER_ATTR, f"{socket.gethostname()}:{dead.stdout.strip()}")
    trial.set_user_attr("candidate", True)
    trial.set_user_attr("evaluated", True)
    trial.set_user_attr("latency_ms", 1.0)
    assert reap_dead_trials(study) == 1
    t = study.get_trials()[0]
    assert t.state == TrialState.FAIL and t.user_attrs["evaluated"] is False
    assert "died" in t.user_attrs["fail_reason"]
    queued = study.get_trials(states=(TrialState.WAITING,))
    assert len(queued) == 1 and queued[0].user_attrs["retry_of"] == t.number


def test_reaper_fails_a_trial_whose_asker_died_before_writing_its_owner(tmp_path):
    """SIGKILL between study.ask() (which popped a queued seed) and writing the owner: the
    trial is RUNNING with no owner. Under the ask lock no live asker can be in that window,
    so resuming on SQLite fails it and queues the seed's config again."""
    from attnbench.tune.storage import make_storage, reap_dead_trials

    storage = make_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = optuna.create_study(study_name="s", storage=storage)
    study.enqueue_trial({"block_M": 128})
    orphan = study.ask()  # pops the seed; its asker "dies" here
    assert orphan.number == 0 and study.get_trials()[0].state == TrialState.RUNNING
    assert reap_dead_trials(study) == 1
    t = study.get_trials()[0]
    assert t.state == TrialState.FAIL and "killed while asking" in t.user_attrs["fail_reason"]
    (queued,) = study.get_trials(states=(TrialState.WAITING,))
    assert queued.system_attrs["fixed_params"] == {"block_M": 128}


def test_a_changed_space_gets_a_study_of_its_own(tmp_path, caplog):
    """A study drawn from another search space (here: before `schedule` was a parameter)
    cannot go on (Optuna: "dynamic value space"): the tuner says so and starts one named
    after the new space, and the old study's trials are left as they were."""
    old = {"template": "attention_fwd", "params": {"block_M": [64, 128], "block_N": [64, 128],
                                                   "num_stages": [2], "threads": [256]}}
    new = {**old, "params": {**old["params"], "schedule": ["auto", "overlap"]}}
    first = run_study(FakeObjective(PROBLEM), parse_space(old), _opts(tmp_path, trials=3))
    with caplog.at_level("WARNING"):
        second = run_study(FakeObjective(PROBLEM), parse_space(new), _opts(tmp_path, trials=3))
    assert second.study_name.startswith(first.study_name + ":space-")
    assert "drawn from another search space" in caplog.text
    assert len(_evaluated(_study(tmp_path, first.study_name))) == first.evaluated
    # The same space again resumes that study instead of branching once more.
    third = run_study(FakeObjective(PROBLEM), parse_space(new), _opts(tmp_path, trials=4))
    assert third.study_name == second.study_name


def test_a_trial_killed_while_sampling_does_not_fork_the_study(tmp_path):
    """A tuner killed between two parameters of a trial leaves it RUNNING with part of the
    space's distributions: the resumed run goes on in the same study (it used to start a
    ':space-' one, losing sight of the measured trials)."""
    space = {"template": "attention_fwd", "params": {"block_M": [64, 128], "block_N": [64, 128],
                                                     "num_stages": [2], "threads": [256]}}
    first = run_study(FakeObjective(PROBLEM), parse_space(space), _opts(tmp_path, trials=3))
    study = _study(tmp_path, first.study_name)
    killed = study.ask()
    killed.suggest_categorical("block_M", [64, 128])  # the tuner dies here
    second = run_study(FakeObjective(PROBLEM), parse_space(space), _opts(tmp_path, trials=5))
    assert second.study_name == first.study_name
    assert len(_evaluated(_study(tmp_path, first.study_name))) >= first.evaluated
