"""Tuning the decode kind (issue 23) on a CPU: `--mode decode` picks attention_decode, its search
space is checked by the decode validity model (with the tile's rows), decode tune files key the
paging and round-trip, and the engine's kernel cache runs the tuned entry (the exact shape's,
or the nearest shape's with its split count left to the plan), else the default."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from attnbench import cli
from attnbench.commands.tune import _problems, studies_of
from attnbench.tune.objective import FakeObjective
from attnbench.tune.problem import Problem, study_name
from attnbench.tune.runner import current_config
from attnbench.tune.space import SearchSpaceError, load_space, parse_space
from engine.kernels.attention_decode.plan import DecodeConfig, DecodeShape, config_problems
from engine.kernels.registry import ATTENTION_DECODE, get_kind, kind_for
from engine.plan.config import ConfigError, KernelConfig
from engine.runtime.kernel_cache import decode_config
from engine.tuning import select
from engine.tuning.select import decode_shape
from engine.tuning.tune_file import (
    TuneFileWarning,
    entry_key,
    lookup,
    shape_tag,
    store,
    tilelang_version,
)
from engine.variants import get_variant

pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")

REPO = Path(__file__).resolve().parents[1]
GPU = "Fake GPU"
SIZES = dict(batch=8, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_kv=32768, head_dim=128,
             head_dim_v=128)
PROBLEM = Problem("softmax", **SIZES, family="decode")


def _sizes(**kw) -> dict:
    return {**SIZES, **kw}


@pytest.fixture(scope="module")
def module():
    return get_variant("softmax").build(**SIZES, dtype=torch.bfloat16, backend="tilelang")


@pytest.fixture
def engine_gpu(monkeypatch):
    monkeypatch.setattr(select, "gpu_name", lambda: GPU)  # what the engine calls this machine


def _entry(spec: str, sizes: dict, cfg: DecodeConfig, page_size: int = 0) -> dict:
    return {"template": "attention_decode", "spec_hash": spec, "dtype": "bf16", "mode": "fwd",
            "gpu": GPU, "shape": decode_shape(sizes, page_size), "config": cfg.to_dict(),
            "latency_ms": 0.1, "tflops": 1.0, "date": "2026-11-25T00:00:00+00:00"}


def _request(mod, path: Path):
    mod.tune_file = str(path)
    return mod.kernel_request()


def _shape(page_size: int = 0, **kw) -> DecodeShape:
    return DecodeShape(**_sizes(**kw), dtype="bfloat16", page_size=page_size,
                       num_pages=_sizes(**kw)["batch"] * 128 if page_size else 0)


def test_mode_decode_tunes_the_decode_kind():
    assert studies_of("decode") == studies_of("attention_decode") == [("decode", "fwd")]
    assert studies_of("fwd") == [("attention", "fwd")]
    assert studies_of("both") == [("attention", "fwd"), ("attention", "bwd")]
    assert kind_for("decode", "fwd") is PROBLEM.kind is ATTENTION_DECODE
    assert PROBLEM.template == "attention_decode"
    assert Problem("softmax", **SIZES).template == "attention_fwd"
    assert PROBLEM.validity_args() == {"rows": 4}  # 4 query heads per kv head x 1 new token
    assert Problem("softmax", **SIZES).validity_args() == {}
    with pytest.raises(ValueError, match="no kernel kind"):
        Problem("softmax", **SIZES, family="decode", mode="bwd")
    with pytest.raises(ValueError, match="page_size=48: expected 0"):
        Problem("softmax", **SIZES, family="decode", page_size=48)
    with pytest.raises(ValueError, match="KV-cache fields of a decode problem"):
        Problem("softmax", **SIZES, ragged=True)
    # Attention study names are unchanged (their studies resume); decode's name the paging and
    # ragged lengths (other inputs, so another study).
    tail = f"bf16:fwd:fake-gpu:tl{tilelang_version()}"
    assert study_name(Problem("softmax", **SIZES), spec_hash="s", gpu=GPU) == (
        f"attention_fwd:softmax:s:b8_hq32_hkv8_sq1_skv32768_d128_dv128:{tail}")
    assert study_name(PROBLEM, spec_hash="s", gpu=GPU) == (
        f"attention_decode:softmax:s:b8_hq32_hkv8_sq1_skv32768_d128_dv128_page0:{tail}")
    ragged = Problem("softmax", **SIZES, family="decode", ragged=True, page_size=256)
    assert study_name(ragged, spec_hash="s", gpu=GPU).endswith("_page256:" + tail + ":ragged")


def _args(*argv: str):
    return cli.build_parser().parse_args(["tune", *argv])


def _all_problems(args) -> list[Problem]:
    return [p for fam, mode in studies_of(args.mode) for p in _problems(args, fam, mode)]


def test_cli_decode_problems_from_the_suite_and_by_hand(capsys):
    probs = _all_problems(_args("--suite", "decode", "--mode", "decode",
                                "--filter", "softmax/llama3-8b/b8/s1x32768"))
    assert {p.template for p in probs} == {"attention_decode"}
    assert {(p.dtype, p.ragged, p.page_size) for p in probs} == {
        ("bf16", False, 0), ("bf16", True, 0), ("bf16", False, 16), ("bf16", False, 256),
        ("bf16", True, 256), ("fp16", False, 0)}
    assert all(p.seqlen_q == 1 and p.seqlen_kv == 32768 and p.batch == 8 for p in probs)
    probs = _all_problems(_args("--shape", "llama3-8b", "--mode", "decode", "--seqlens",
                                "32k,128k", "--batch", "8", "--new-tokens", "2",
                                "--page-size", "256", "--ragged"))
    assert [(p.seqlen_q, p.seqlen_kv, p.page_size, p.ragged) for p in probs] == [
        (2, 32768, 256, True), (2, 131072, 256, True)]
    for argv, message in [
        (["--shape", "llama3-8b", "--ragged"], "--ragged: KV-cache options of --mode decode"),
        (["--suite", "decode", "--mode", "fwd"], "no half-precision engine case of kind "
                                                 "'attention' to tune (--mode fwd)"),
        (["--shape", "llama3-8b", "--mode", "decode", "--seqlens", "32k", "--page-size",
          "3000"], "--page-size 3000: expected a divisor of every capacity"),
    ]:
        assert cli.main(["tune", *argv, "--objective", "fake"]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--mode", "prefill")
    assert "expected one of fwd, bwd, both, decode, linear or a kernel kind" in capsys.readouterr().err


def test_decode_space_is_checked_by_the_decode_validity_model():
    space = load_space("attention_decode")
    assert space.config_type is DecodeConfig and DecodeConfig() in space.seeds
    every = space.all_configs()
    assert all(isinstance(c, DecodeConfig) for c in every)
    for d, rows in ((128, 4), (192, 1), (256, 2), (256, 128)):
        valid = space.valid_configs(d, d, 2, rows=rows)
        assert valid == [c for c in every if not config_problems(c, d, d, 2, rows)]
        assert 0 < len(valid) < len(every)
    # The tile's rows count: 128 rows (a 128-row tile) leave less shared memory for K/V.
    assert (set(space.valid_configs(256, 256, 2, rows=128))
            < set(space.valid_configs(256, 256, 2, rows=2)))
    with pytest.raises(SearchSpaceError, match="block_M is not a DecodeConfig field"):
        parse_space({"template": "attention_decode", "params": {"block_M": [64]}})
    with pytest.raises(SearchSpaceError, match="outside"):
        parse_space({"template": "attention_decode", "params": {"block_N": [64]},
                     "seed": [{"block_N": 128}]})


def test_decode_tune_file_round_trips(tmp_path):
    path = tmp_path / "attention_decode.json"
    cfg = DecodeConfig(64, 3, 16)
    key = store(path, _entry("abc", SIZES, cfg, page_size=256), DecodeConfig)
    assert key.endswith("|b8_hq32_hkv8_sq1_skv32768_d128_dv128_page256")
    assert list(json.loads(path.read_text())["entries"]) == [key]
    q = dict(template="attention_decode", spec_hash="abc", dtype="bf16", mode="fwd", gpu=GPU,
             config_type=DecodeConfig)
    got, meta = lookup(path, shape=decode_shape(SIZES, 256), **q)
    assert got == cfg and meta["exact"] and meta["shape"]["page_size"] == 256
    # The paging is fixed: a contiguous cache (or a shape without paging) finds no entry.
    assert lookup(path, shape=decode_shape(SIZES, 0), **q) is None
    assert lookup(path, shape=SIZES, **q) is None
    with pytest.warns(TuneFileWarning, match="unusable config"):  # read as a KernelConfig
        assert lookup(path, shape=decode_shape(SIZES, 256),
                      **{**q, "config_type": KernelConfig}) is None
    with pytest.raises(ConfigError, match="KernelConfig: unknown field"):
        store(path, _entry("abc", SIZES, cfg))  # a decode config is no KernelConfig
    assert shape_tag(SIZES) == "b8_hq32_hkv8_sq1_skv32768_d128_dv128"  # attention: as before


def test_committed_tune_files_still_load():
    files = sorted(REPO.glob("results/tune/*/attention_*.json"))
    assert files
    for f in files:
        data = json.loads(f.read_text())
        for key, e in data["entries"].items():
            fields = {k: e[k] for k in ("template", "spec_hash", "dtype", "mode", "gpu", "shape")}
            assert entry_key(**fields) == key
            kind = get_kind(e["template"])  # each kind's entries hold its own config type
            cfg, meta = lookup(f, **fields, config_type=kind.config_type)
            assert meta["exact"] and cfg.to_dict() == e["config"]


def test_kernel_cache_runs_the_tuned_decode_config(tmp_path, engine_gpu, module):
    path = tmp_path / "attention_decode.json"
    default = ATTENTION_DECODE.default(128, 128, rows=4)
    mod = get_variant("softmax").build(**SIZES, dtype=torch.bfloat16, backend="tilelang",
                                       tune_file=str(path))
    assert decode_config(mod.kernel_request(), _shape()) == default  # no tune file
    tuned = DecodeConfig(64, 3, 8)
    store(path, _entry(mod.spec.hash, SIZES, tuned), DecodeConfig)
    fresh = get_variant("softmax").build(**SIZES, dtype=torch.bfloat16, backend="tilelang",
                                         tune_file=str(path))
    dk = fresh.decode_kernels(0, 0, 132)
    assert dk.config == tuned and dk.plan.splits == 8
    # A paged cache has no entry here: the default.
    assert fresh.decode_kernels(256, 8 * 128, 132).config == default
    # The module's own decode_config wins over the tune file.
    fresh.decode_config = DecodeConfig(128, 1, 4)
    assert fresh.decode_kernels(0, 0, 132).config == DecodeConfig(128, 1, 4)


def test_nearest_decode_shape(tmp_path, engine_gpu, module, caplog):
    path = tmp_path / "attention_decode.json"
    spec = module.spec.hash
    store(path, _entry(spec, SIZES, DecodeConfig(64, 3, 16)), DecodeConfig)
    store(path, _entry(spec, _sizes(batch=1, seqlen_kv=131072), DecodeConfig(128, 1, 32)),
          DecodeConfig)
    store(path, _entry(spec, SIZES, DecodeConfig(64, 2, 4), page_size=256), DecodeConfig)
    req = _request(module, path)
    # Exact shapes: the entries as tuned.
    assert decode_config(req, _shape()) == DecodeConfig(64, 3, 16)
    assert decode_config(req, _shape(batch=1, seqlen_kv=131072)) == DecodeConfig(128, 1, 32)
    # Nearest tuned batch and capacity (same heads, dims, paging): the tiles, the split count
    # left to the plan (0).
    assert decode_config(req, _shape(batch=4)) == DecodeConfig(64, 3, 0)
    assert decode_config(req, _shape(batch=1, seqlen_kv=65536)) == DecodeConfig(128, 1, 0)
    assert decode_config(req, _shape(seqlen_q=4)) == DecodeConfig(64, 3, 0)
    assert decode_config(req, _shape(page_size=256, batch=2)) == DecodeConfig(64, 2, 0)
    assert decode_config(req, _shape(page_size=16)) == ATTENTION_DECODE.default(128, 128)
    # The tuner's baseline is what the engine runs.
    space = load_space("attention_decode")
    obj = FakeObjective(Problem("softmax", **_sizes(batch=4), family="decode"), spec=spec,
                        gpu=GPU)
    assert current_config(obj, space, GPU, path) == DecodeConfig(64, 3, 0)
    # An entry the validity model rejects at this shape's rows: the default, with a log line.
    store(path, _entry(spec, _sizes(head_dim=256, head_dim_v=256, heads_q=16),
                       DecodeConfig(128, 1, 0)), DecodeConfig)
    wide = _shape(head_dim=256, head_dim_v=256, heads_q=16, seqlen_q=64)  # 128 rows
    with caplog.at_level(logging.INFO, logger="engine"):
        cfg = decode_config(req, wide)
    assert cfg == ATTENTION_DECODE.default(256, 256, rows=128) != DecodeConfig(128, 1, 0)
    assert "invalid at 128 rows" in caplog.text


def test_tune_mode_decode_end_to_end_with_the_fake_objective(tmp_path, engine_gpu, module,
                                                              capsys):
    """`attnbench tune --suite decode --mode decode` on one case: DecodeConfig trials, a decode
    entry in the tune file, which the engine's kernel cache then runs."""
    path = tmp_path / "attention_decode.json"
    rc = cli.main(["tune", "--suite", "decode", "--mode", "decode", "--filter",
                   "softmax/llama3-8b/b8/s1x32768/bfloat16", "--objective", "fake",
                   "--fake-options", json.dumps({"gpu": GPU, "spec": module.spec.hash}),
                   "--trials", "5", "--tpe", "--no-progress", "--compile-jobs", "2",
                   "--storage", f"sqlite:///{tmp_path / 's.db'}", "--tune-file", str(path),
                   "--json-out", str(tmp_path / "out.json")])
    assert rc == 0, capsys.readouterr().err
    (res,) = json.loads((tmp_path / "out.json").read_text())
    assert res["study_name"].startswith("attention_decode:softmax:")
    assert res["evaluated"] == 5 and not res["exhaustive"]
    assert set(res["baseline_config"]) == {"block_N", "num_stages", "num_splits"}
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["template"] == "attention_decode" and entry["ragged"] is False
    assert entry["shape"] == decode_shape(SIZES, 0)
    want = DecodeConfig.from_dict(entry["config"])
    assert decode_config(_request(module, path), _shape()) == want


def test_decode_objective_on_the_cpu(module):
    """What the decode objective decides without a GPU: the spec the engine keys tune files by,
    the attended fraction, the sequences it checks (the reference on just those), pickling."""
    import pickle

    from attnbench.decode import decode_reference, make_decode_inputs
    from attnbench.tune.decode_objective import DecodeObjective, decode_case
    from attnbench.tune.objective import TrialFailed

    full = DecodeObjective(PROBLEM)
    assert full.spec_hash() == str(module.spec.hash)
    assert full.unmasked_fraction() == 1.0 and full.checked_sequences() == [0]
    assert full.traffic()[0] == 8 * 32768 * 8 * 256 * 2 + 8 * 32 * 256 * 2  # K, V; q, o
    ragged = DecodeObjective(Problem("softmax", **SIZES, family="decode", ragged=True))
    assert 0 < ragged.unmasked_fraction() < 1
    longest, shortest = ragged.checked_sequences()
    assert decode_case(ragged.problem).ragged and longest != shortest
    assert pickle.loads(pickle.dumps(ragged)) == ragged
    if not torch.cuda.is_available():
        with pytest.raises(TrialFailed, match="no CUDA device"):
            full.evaluate(DecodeConfig())
    with pytest.raises(ValueError, match="expected 'decode'"):
        DecodeObjective(Problem("softmax", **SIZES))
    # The reference on some sequences is those sequences' rows of the whole batch's.
    tiny = Problem("softmax_causal", batch=3, heads_q=4, heads_kv=2, seqlen_q=2, seqlen_kv=64,
                   head_dim=32, head_dim_v=32, dtype="fp16", family="decode", ragged=True,
                   page_size=16)
    case, variant = decode_case(tiny), get_variant("softmax_causal")
    inputs = make_decode_inputs(case, variant, "cpu", seed=0)
    whole = decode_reference(case, variant, inputs)
    seqs = DecodeObjective(tiny).checked_sequences()
    assert torch.equal(decode_reference(case, variant, inputs, seqs), whole[seqs])
