"""Tuning the linear kinds (issue 18) on a CPU: `--mode linear` picks linear_fwd and linear_bwd,
linear problems and their tune-file shapes (the value heads added), the search spaces checked by
the linear validity model, and LinearAttentionEngine running the tune file's entry for the
exact shape (a training call the linear_bwd entry for both passes), else config_for_shape."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from attnbench import cli
from attnbench.commands.tune import _problems, studies_of
from attnbench.tune.objective import FakeObjective, TrialFailed
from attnbench.tune.problem import Problem, study_name
from attnbench.tune.runner import current_config
from attnbench.tune.space import load_space
from engine.dsl.io import meta_tensor
from engine.kernels.linear_fwd.plan import (
    LinearConfig,
    LinearShape,
    backward_config_for_shape,
    config_for_shape,
    config_problems,
)
from engine.kernels.linear_fwd.tune_shape import shape_from, tune_shape
from engine.kernels.registry import KINDS, LINEAR_BWD, LINEAR_FWD, kind_for
from engine.linear_api import LinearAttentionEngine
from engine.runtime import linear_backend, linear_tuning
from engine.tuning import select
from engine.tuning.tune_file import lookup, shape_tag, store, tilelang_version

pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")

GPU = "Fake GPU"
SIZES = dict(batch=8, heads_q=1, heads_kv=1, seqlen_q=2048, seqlen_kv=2048, head_dim=128,
             head_dim_v=64)
PROBLEM = Problem("mamba2", **SIZES, heads=80, family="linear")
SHAPE = LinearShape(batch=8, heads_q=1, heads_k=1, heads=80, seqlen=2048, head_dim=128,
                    head_dim_v=64, dtype="bfloat16")
TUNED = LinearConfig(chunk=128, block_K=64, block_V=32, num_stages=3, threads=256)
TRAIN = LinearConfig(chunk=64, block_K=32, block_V=64, num_stages=1, threads=128)


@pytest.fixture
def engine_gpu(monkeypatch):
    monkeypatch.setattr(select, "gpu_name", lambda: GPU)


def _entry(kind, shape: LinearShape, cfg: LinearConfig) -> dict:
    return {"template": kind.name, "spec_hash": linear_tuning.TUNE_SPEC, "dtype": "bf16",
            "mode": kind.mode, "gpu": GPU, "shape": tune_shape(shape), "config": cfg.to_dict(),
            "latency_ms": 0.1, "tflops": 1.0, "date": "2026-11-26T00:00:00+00:00"}


def test_the_linear_kinds_in_the_registry():
    assert kind_for("linear", "fwd") is LINEAR_FWD and kind_for("linear", "bwd") is LINEAR_BWD
    assert {k.config_arg for k in (LINEAR_FWD, LINEAR_BWD)} == {"config", "backward_config"}
    for kind in KINDS.values():  # every kind has its search space, read with its config type
        space = load_space(kind.name)
        assert space.config_type is kind.config_type
    assert studies_of("linear") == [("linear", "fwd"), ("linear", "bwd")]
    assert studies_of("linear_bwd") == [("linear", "bwd")]
    assert PROBLEM.template == "linear_fwd" and PROBLEM.validity_args() == {}
    assert dataclasses.replace(PROBLEM, mode="bwd").template == "linear_bwd"
    # The engine's default at a shape is config_for_shape's, the runner's baseline too.
    assert LINEAR_FWD.at_shape(PROBLEM.shape(), "bf16") == config_for_shape(SHAPE)


def test_linear_problem_and_tune_shape():
    assert PROBLEM.shape() == {**SIZES, "heads": 80} == tune_shape(SHAPE)
    assert shape_from(PROBLEM.shape(), "bfloat16") == SHAPE
    tail = f"bf16:fwd:fake-gpu:tl{tilelang_version()}"
    assert study_name(PROBLEM, spec_hash="linear", gpu=GPU) == (
        f"linear_fwd:mamba2:linear:b8_hq1_hkv1_sq2048_skv2048_d128_dv64_h80:{tail}")
    assert shape_tag(SIZES) == "b8_hq1_hkv1_sq2048_skv2048_d128_dv64"  # attention: as before
    assert PROBLEM.flops() > 0 and dataclasses.replace(PROBLEM, mode="bwd").flops() > \
        PROBLEM.flops()
    for kw, message in [(dict(heads=0), "heads=0: expected the value heads"),
                        (dict(heads=80, heads_q=3), "heads=80: expected"),
                        (dict(seqlen_kv=4096), "a linear problem has one length")]:
        with pytest.raises(ValueError, match=message):
            Problem("mamba2", **{**SIZES, **{k: v for k, v in kw.items() if k != "heads"}},
                    heads=kw.get("heads", 80), family="linear")
    with pytest.raises(ValueError, match="value heads of a linear problem"):
        Problem("softmax", **SIZES, heads=4)


def _args(*argv: str):
    return cli.build_parser().parse_args(["tune", *argv])


def test_cli_linear_problems_from_the_suite_and_by_hand(capsys):
    args = _args("--suite", "linear", "--mode", "linear", "--filter", "mamba2/*")
    probs = [p for fam, mode in studies_of(args.mode) for p in _problems(args, fam, mode)]
    assert {p.template for p in probs} == {"linear_fwd", "linear_bwd"}
    assert {(p.heads_q, p.heads_kv, p.heads, p.head_dim, p.head_dim_v) for p in probs} == {
        (1, 1, 80, 128, 64)}
    assert {(p.batch, p.seqlen_q) for p in probs} == {(b, t) for b in (1, 8)
                                                      for t in (2048, 4096, 8192)}
    args = _args("--shape", "retnet-6.7b", "--mode", "linear_fwd", "--seqlens", "2k", "--batch",
                 "1", "--variant", "retnet_linear")
    (p,) = _problems(args, "linear", "fwd")
    assert (p.heads, p.head_dim, p.head_dim_v, p.variant) == (32, 256, 512, "retnet_linear")
    for argv, message in [
        (["--mode", "linear"], "--shape: a linear study reads its heads"),
        (["--shape", "mamba2-2.7b", "--mode", "linear", "--variant", "softmax"],
         "unknown linear variant 'softmax'"),
        (["--shape", "mamba2-2.7b", "--mode", "linear", "--ragged"], "KV-cache options"),
    ]:
        assert cli.main(["tune", *argv, "--objective", "fake"]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["linear_fwd", "linear_bwd"])
def test_linear_spaces_are_checked_by_the_linear_validity_model(name):
    space = load_space(name)
    assert space.config_type is LinearConfig
    every = space.all_configs()
    for d, dv in ((128, 64), (128, 128), (256, 256), (256, 512), (64, 64)):
        valid = space.valid_configs(d, dv, 2)
        assert valid == [c for c in every if not config_problems(c, d, dv, 2)]
        assert valid
    assert space.contains(config_for_shape(SHAPE))  # the engine's default can be the baseline


def test_tune_file_lookup_and_pick(tmp_path, engine_gpu):
    path = tmp_path / "linear.json"
    assert linear_tuning.tuned_configs(SHAPE, str(path)) == linear_tuning.Tuned()
    store(path, _entry(LINEAR_FWD, SHAPE, TUNED), LinearConfig)
    store(path, _entry(LINEAR_BWD, SHAPE, TRAIN), LinearConfig)
    tuned = linear_tuning.tuned_configs(SHAPE, str(path))
    assert tuned == (TUNED, TRAIN)
    # Exact shapes only; other heads are not even the nearest shape; packed calls never.
    other = dataclasses.replace(SHAPE, batch=4)
    assert linear_tuning.tuned_configs(other, str(path)) == linear_tuning.Tuned()
    assert lookup(path, template="linear_fwd", spec_hash="linear", dtype="bf16", mode="fwd",
                  gpu=GPU, shape=tune_shape(dataclasses.replace(SHAPE, heads=40)),
                  config_type=LinearConfig) is None
    packed = dataclasses.replace(SHAPE, batch=1, sequences=3)
    assert linear_tuning.tuned_configs(packed, str(path)) == linear_tuning.Tuned()
    pick = linear_tuning.pick
    assert pick(SHAPE, None, None, tuned, False) == (TUNED, None)
    assert pick(SHAPE, None, None, tuned, True) == (TRAIN, TRAIN)
    # untuned: the default pair (Mamba2's shared heads: the single pass's own config at two
    # stages, the forward's at one where that lets two blocks share an SM, NOTES 205; a
    # non-shared shape: 64 key rows on 128 threads)
    fwd = config_for_shape(SHAPE)
    assert fwd.num_stages == 1
    assert backward_config_for_shape(SHAPE) == dataclasses.replace(fwd, num_stages=2)
    assert pick(SHAPE, None, None, linear_tuning.Tuned(), True) == (
        fwd, backward_config_for_shape(SHAPE))
    own = dataclasses.replace(SHAPE, heads_q=SHAPE.heads, heads_k=SHAPE.heads)
    assert pick(own, None, None, linear_tuning.Tuned(), True) == (
        config_for_shape(own), dataclasses.replace(fwd, block_K=64, threads=128, num_stages=2))
    mine = LinearConfig(chunk=64)
    assert pick(SHAPE, mine, None, tuned, True) == (mine, TRAIN)  # same chunk: its backward
    assert pick(SHAPE, TUNED, None, tuned, True) == (TUNED, None)  # another chunk: the forward's
    assert pick(SHAPE, None, mine, tuned, True) == (TUNED, mine)


def _module(path, **kw):
    meta = (meta_tensor(2, 1, 64, 128, dtype=torch.bfloat16),
            meta_tensor(2, 1, 64, 128, dtype=torch.bfloat16),
            meta_tensor(2, 4, 64, 64, dtype=torch.bfloat16))
    return LinearAttentionEngine(meta, backend="tilelang", tune_file=str(path), **kw)


def test_the_module_runs_the_tuned_configs(tmp_path, engine_gpu, monkeypatch, caplog):
    path = tmp_path / "linear.json"
    shape = LinearShape(batch=2, heads_q=1, heads_k=1, heads=4, seqlen=64, head_dim=128,
                        head_dim_v=64, dtype="bfloat16")
    store(path, _entry(LINEAR_FWD, shape, TUNED), LinearConfig)
    store(path, _entry(LINEAR_BWD, shape, TRAIN), LinearConfig)
    seen = []

    def fake_run(cache, q, k, v, g, h0, cu, final, config=None, backward_config=None,
                 step_config=None, q_scale=1.0, v_weight=None, save_states=False):
        seen.append((config, backward_config))
        return v.new_zeros(v.shape) + 0 * (q.sum() + k.sum() + v.sum()), None

    monkeypatch.setattr(linear_backend, "run", fake_run)
    mod = _module(path, tune=True)
    monkeypatch.setattr(mod, "resolved_backend", lambda device: "tilelang")
    q, k = torch.randn(2, 1, 64, 128).bfloat16(), torch.randn(2, 1, 64, 128).bfloat16()
    v, decay = torch.randn(2, 4, 64, 64).bfloat16(), -torch.rand(2, 4, 64)
    with torch.no_grad(), caplog.at_level("WARNING", logger="engine"):
        mod(q, k, v, decay)
    assert "attnbench tune --mode linear" in caplog.text
    mod(q.requires_grad_(), k, v, decay)
    mod(q[:, :, :32], k[:, :, :32], v[:, :, :32], decay[:, :, :32])  # untuned length
    # untuned: the defaults (here a training call's backward keeps 128 key rows)
    untuned = dataclasses.replace(shape, seqlen=32)
    assert seen == [(TUNED, None), (TRAIN, TRAIN), (config_for_shape(untuned),
                                                   backward_config_for_shape(untuned))]
    assert config_for_shape(untuned).block_K == 64
    assert backward_config_for_shape(untuned).block_K == 128


def test_tune_mode_linear_end_to_end_with_the_fake_objective(tmp_path, engine_gpu, capsys):
    """`attnbench tune --suite linear --mode linear` on one case: LinearConfig trials, one entry
    per kind, which LinearAttentionEngine's lookup then finds for that exact shape."""
    path = tmp_path / "linear.json"
    rc = cli.main(["tune", "--suite", "linear", "--mode", "linear", "--filter",
                   "mamba2/*/b8/*2048*", "--objective", "fake", "--fake-options",
                   json.dumps({"gpu": GPU, "spec": linear_tuning.TUNE_SPEC}),
                   "--trials", "4", "--tpe", "--no-progress", "--compile-jobs", "2",
                   "--storage", f"sqlite:///{tmp_path / 's.db'}", "--tune-file", str(path),
                   "--json-out", str(tmp_path / "out.json")])
    assert rc == 0, capsys.readouterr().err
    fwd, bwd = json.loads((tmp_path / "out.json").read_text())
    assert fwd["study_name"].startswith("linear_fwd:mamba2:linear:")
    assert bwd["study_name"].startswith("linear_bwd:mamba2:linear:")
    assert fwd["baseline_config"] == config_for_shape(SHAPE).to_dict()
    entries = json.loads(path.read_text())["entries"].values()
    assert {(e["template"], e["mode"]) for e in entries} == {("linear_fwd", "fwd"),
                                                             ("linear_bwd", "bwd")}
    assert all(e["shape"] == tune_shape(SHAPE) for e in entries)
    want = {e["mode"]: LinearConfig.from_dict(e["config"]) for e in entries}
    assert linear_tuning.tuned_configs(SHAPE, str(path)) == (want["fwd"], want["bwd"])
    # The tuner's baseline is now what the engine runs: the entry (exact shapes only).
    space = load_space("linear_fwd")
    assert current_config(FakeObjective(PROBLEM, spec="linear", gpu=GPU), space, GPU,
                          path) == want["fwd"]
    other = Problem("mamba2", **{**SIZES, "batch": 4}, heads=80, family="linear")
    assert current_config(FakeObjective(other, spec="linear", gpu=GPU), space, GPU,
                          path) == config_for_shape(dataclasses.replace(SHAPE, batch=4))


def test_linear_objective_on_the_cpu():
    from attnbench.tune.linear_objective import LinearObjective, linear_case

    obj = LinearObjective(dataclasses.replace(PROBLEM, mode="bwd"))
    assert obj.spec_hash() == linear_tuning.TUNE_SPEC and obj.traced_spec() is None
    case = linear_case(obj.problem)
    assert (case.kind, case.heads, case.modes, case.dtype) == ("linear", 80, ("fwd+bwd",),
                                                                "bfloat16")
    assert pickle.loads(pickle.dumps(obj)) == obj
    mod = obj._module(TRAIN)
    assert (mod.config, mod.backward_config) == (TRAIN, TRAIN)
    assert LinearObjective(PROBLEM)._module(TUNED).backward_config is None
    if not torch.cuda.is_available():
        with pytest.raises(TrialFailed, match="no CUDA device"):
            obj.evaluate(TRAIN)
    with pytest.raises(ValueError, match="expected 'linear'"):
        LinearObjective(Problem("softmax", **SIZES))


@pytest.mark.parametrize("sizes, heads", [
    (dict(batch=8, heads_q=40, heads_kv=40, seqlen_q=2048, seqlen_kv=2048, head_dim=256,
          head_dim_v=256), 40),   # single-pass forward, reverse pass + 128-thread dQ/dK
    (dict(batch=2, heads_q=16, heads_kv=16, seqlen_q=16384, seqlen_kv=16384, head_dim=128,
          head_dim_v=128), 16),  # 64-row forward key tile, 128-row backward
])
def test_the_default_linear_bwd_config_stands_for_the_untuned_pair(sizes, heads):
    """Where an untuned training call runs two configs, the linear_bwd tuner's baseline (the
    engine's default) is timed as that pair, and a tune file's entry of it runs as that pair:
    a "baseline" entry cannot make training slower than no entry. Other configs run for both
    passes, as they were timed."""
    from attnbench.tune.linear_objective import LinearObjective

    problem = Problem("simple_gla", **sizes, heads=heads, family="linear", mode="bwd")
    shape = shape_from(problem.shape(), "bfloat16")
    fwd, bwd = config_for_shape(shape), backward_config_for_shape(shape)
    assert fwd != bwd and problem.engine_default() == fwd
    obj = LinearObjective(problem)
    assert (obj._module(fwd).config, obj._module(fwd).backward_config) == (fwd, bwd)
    assert obj._module(TRAIN).backward_config == TRAIN
    assert linear_tuning.pick(shape, None, None, linear_tuning.Tuned(training=fwd), True) == (
        fwd, bwd)
    assert linear_tuning.pick(shape, None, None, linear_tuning.Tuned(training=TRAIN), True) == (
        TRAIN, TRAIN)


def test_linear_objective_checks_the_learnable_inputs_gradients():
    """A trial whose decay gradient is wrong fails, through the gradient of Mamba2's dt (one
    value per position: batch row 0 is checked); A's, which sums over the rows, is checked at
    batch 1 only."""
    from attnbench.linear import learned_names, linear_args, linear_reference, make_linear_inputs
    from attnbench.tune import linear_objective
    from attnbench.tune.linear_objective import LinearObjective
    from engine.variants.linear import get_linear_variant

    variant = get_linear_variant("mamba2")
    for batch in (2, 1):
        problem = Problem("mamba2", batch=batch, heads_q=1, heads_kv=1, seqlen_q=40,
                          seqlen_kv=40, head_dim=32, head_dim_v=32, heads=2, family="linear",
                          mode="bwd")
        obj = LinearObjective(problem)
        inputs, grad_out = make_linear_inputs(obj.case, variant, "cpu", 0)
        args, learned = linear_args(variant, inputs, True)
        linear_objective._INPUTS[(problem, 0)] = (inputs, args, learned, grad_out)
        linear_objective._REFERENCE.clear()
        out, *grads = linear_reference(obj.case, variant, inputs, grad_out, torch.float32, True)
        names = learned_names(variant, inputs)
        assert {"decay", "A"} <= set(names)  # Mamba2's dt is its decay input
        assert obj._check(out, grads) < 1e-5
        for name in names:
            bad = [g.clone() for g in grads]
            bad[3 + names.index(name)][:1] *= 1.1
            shared = inputs[name].shape[0] != batch
            if shared and batch > 1:
                assert obj._check(out, bad) < 1e-5  # A: not checked beside other rows
            else:
                with pytest.raises(TrialFailed, match=f"d{name} rel err"):
                    obj._check(out, bad)
    linear_objective._INPUTS.clear()
    linear_objective._REFERENCE.clear()
