"""AttentionEngine(tune=True): a shape missing from the tune file is tuned (through the
harness's tuner: the real study, worker processes and tune-file rule, with attnbench's fake
objective standing in for the GPU), written to the module's tune file, and then used by the
module's kernel. The engine finds the tuner through an entry point; without one it says so."""

from __future__ import annotations

import functools
import json
import pickle

import pytest
import torch

from attnbench.tune.engine_tuner import EngineTuner
from attnbench.tune.objective import FakeObjective
from attnbench.tune.spec_objective import SpecObjective
from engine.kernels.attention_fwd.plan import default_forward_config
from engine.plan.config import KernelConfig
from engine.tuning import autotune
from engine.tuning.autotune import TuneBudget, ensure_tuned
from engine.tuning.tune_file import lookup
from engine.variants import VARIANTS

SIZES = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1024, seqlen_kv=1024, head_dim=128,
             head_dim_v=128)
GPU = "none"  # what the engine calls the GPU on a machine without one


def _module(name: str, tune_file, **kw):
    return VARIANTS[name].build(**SIZES, dtype=torch.bfloat16, backend="reference",
                                tune_file=str(tune_file), **kw)


def _inputs(name: str):
    inp = VARIANTS[name].make_inputs(**SIZES, dtype=torch.bfloat16, device="cpu", seed=3)
    mod_names = list(VARIANTS[name].make_spec(VARIANTS[name].sizes(**SIZES)).custom_fwd_inputs.names())
    return inp["q"], inp["k"], inp["v"], [inp[n] for n in mod_names]


def _fake(spec_hash: str, problem, inputs_path):
    assert torch.load(inputs_path, weights_only=True)["q"].shape == (2, 1024, 8, 128)
    return FakeObjective(problem=problem, spec=spec_hash, gpu=GPU)


def test_tune_true_tunes_a_missing_shape_once(tmp_path):
    path = tmp_path / "tune.json"
    mod = _module("softmax_causal", path, tune=True)
    q, k, v, customs = _inputs("softmax_causal")
    make = functools.partial(_fake, mod.spec_hash)
    budget = TuneBudget(trials=6, timeout_s=240)
    res = ensure_tuned(mod.kernel_request(), q, k, v, customs, gpu=GPU, budget=budget,
                       tuner=EngineTuner(make), progress=False)
    assert res is not None and res["evaluated"] >= 6
    hit = lookup(str(path), template="attention_fwd", spec_hash=mod.spec_hash, dtype="bf16",
                 mode="fwd", gpu=GPU, shape=autotune.problem_shape(mod.problem))
    assert hit is not None and hit[1]["exact"]
    assert hit[0] == KernelConfig.from_dict(res["best_config"])
    # The tune-file rule: written only when faster than the default in this run's A/B rounds.
    assert hit[1]["outcome"] == "tuned" and res["confirmation"]["faster"]
    assert hit[1]["latency_ms"] < hit[1]["default_latency_ms"] == res["baseline_latency_ms"]
    # The module's kernel now uses the tuned config.
    assert mod.forward_kernel().config == hit[0]
    # An exact entry exists: a second module of the same spec and shape tunes nothing.
    again = _module("softmax_causal", path, tune=True)
    assert ensure_tuned(again.kernel_request(), q, k, v, customs, gpu=GPU, budget=budget,
                        tuner=EngineTuner(make), progress=False) is None
    data = json.loads(path.read_text())
    assert len(data["entries"]) == 1


def test_without_a_tuner_tune_true_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune.metadata, "entry_points", lambda group: [])
    autotune.register_tuner(None)
    mod = _module("softmax", tmp_path / "t.json", tune=True)
    q, k, v, customs = _inputs("softmax")
    with pytest.warns(UserWarning) as caught:
        assert ensure_tuned(mod.kernel_request(), q, k, v, customs, gpu=GPU) is None
    (msg,) = [str(w.message) for w in caught]
    assert "no tuner is installed" in msg and autotune.ENTRY_POINT_GROUP in msg
    assert "\n" not in msg and not (tmp_path / "t.json").exists()


def test_the_tuner_is_found_through_the_entry_point(monkeypatch):
    """pyproject.toml registers the harness's tuner under the engine's entry point group; the
    engine loads the first one there (a factory called with no arguments)."""
    import tomllib
    from importlib import import_module
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (target,) = pyproject["project"]["entry-points"][autotune.ENTRY_POINT_GROUP].values()
    module, _, attr = target.partition(":")
    factory = getattr(import_module(module), attr)
    assert factory is EngineTuner and callable(factory().tune)

    class FakeEntryPoint:
        value = target

        def load(self):
            return factory

    seen = []
    monkeypatch.setattr(autotune.metadata, "entry_points",
                        lambda group: seen.append(group) or [FakeEntryPoint()])
    autotune.register_tuner(None)
    assert isinstance(autotune.find_tuner(), EngineTuner)
    assert seen == [autotune.ENTRY_POINT_GROUP]


def test_tune_true_and_config_exclude_each_other(tmp_path):
    with pytest.raises(ValueError, match="tune=True and config="):
        _module("softmax", tmp_path / "t.json", tune=True,
                config=default_forward_config(128, 128))


def test_spec_objective_pickles_and_compiles_on_cpu(tmp_path):
    """The worker side of tune=True: the spec travels by pickling (no user functions) and the
    kernel of a config nvcc-compiles; the mask fraction comes from the saved inputs."""
    from attnbench.tune.problem import Problem

    mod = _module("document", tmp_path / "t.json")
    q, k, v, customs = _inputs("document")
    path = tmp_path / "inputs.pt"
    torch.save({"q": q, "k": k, "v": v, "doc_ids": customs[0]}, path)
    problem = Problem(variant="custom", dtype="bf16", **autotune.problem_shape(mod.problem))
    obj = pickle.loads(pickle.dumps(SpecObjective(problem, mod.spec, mod.custom_io, str(path))))
    assert obj.spec_hash() == mod.spec_hash
    ids = customs[0]
    causal = torch.ones(1024, 1024).tril().bool()
    kept = (ids[:, :, None] == ids[:, None, :]) & causal  # same document, causal
    assert obj.unmasked_fraction() == pytest.approx(kept.double().mean().item())
    built = obj.module(None, backend="tilelang")
    assert built.spec_hash == mod.spec_hash and built.problem == mod.problem
    assert built.kernel_source == mod.kernel_source
    obj.compile(default_forward_config(128, 128))  # nvcc, sm_90a


@pytest.mark.parametrize("objective", ["engine", "spec"])
def test_compile_step_compiles_the_timed_kernel(objective, tmp_path, monkeypatch):
    """The compile workers must really compile (building a module compiles nothing): the
    trial's compile step hands the generated source of the very kernel the benchmark worker
    times to TileLang."""
    from attnbench.tune.engine_objective import EngineObjective
    from attnbench.tune.problem import Problem
    from engine.runtime import kernel

    seen: list[str] = []
    monkeypatch.setattr(kernel, "compile_source", lambda src: seen.append(src))
    cfg = default_forward_config(128, 128)
    problem = Problem(variant="softmax_causal", dtype="bf16", **SIZES)
    mod = _module("softmax_causal", tmp_path / "t.json", config=cfg)
    if objective == "engine":
        EngineObjective(problem).compile(cfg)
    else:
        q, k, v, _ = _inputs("softmax_causal")
        torch.save({"q": q, "k": k, "v": v}, tmp_path / "in.pt")
        SpecObjective(problem, mod.spec, mod.custom_io, str(tmp_path / "in.pt")).compile(cfg)
    assert seen == [mod.kernel_source]


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv("ATTNBENCH_TUNE_TRIALS", raising=False)
    monkeypatch.delenv("ATTNBENCH_TUNE_SECONDS", raising=False)
    assert TuneBudget.from_env() == TuneBudget()
    monkeypatch.setenv("ATTNBENCH_TUNE_TRIALS", "12")
    monkeypatch.setenv("ATTNBENCH_TUNE_SECONDS", "90.5")
    assert TuneBudget.from_env() == TuneBudget(trials=12, timeout_s=90.5)
    for bad in ("0", "-3", "many", "nan"):
        monkeypatch.setenv("ATTNBENCH_TUNE_SECONDS", bad)
        with pytest.raises(ValueError, match="ATTNBENCH_TUNE_SECONDS"):
            TuneBudget.from_env()
