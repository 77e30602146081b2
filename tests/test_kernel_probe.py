"""scripts/kernel_probe.py on a CPU: arms parsed and their patches applied only while they
build, outputs compared, rounds rotated, the record written (the profiler replaced)."""

import types

import pytest
import torch

from attnbench.cases import Case
from attnbench.impls import DeviceInfo
from tests.script_module import load_script

CPU = DeviceInfo("cpu")
PLAN = "engine.kernels.attention_bwd.plan"


@pytest.fixture
def probe():
    return load_script("kernel_probe")


def case(**over) -> Case:
    c = dict(suite="t", name="c", variant="softmax_causal", shape="s", batch=1, heads_q=2,
             heads_kv=2, seqlen_q=33, seqlen_kv=33, head_dim=16, head_dim_v=16,
             dtype="float32", kind="attention", modes=("fwd", "bwd"), impls=("reference",),
             baseline="reference")
    c.update(over)
    return Case(**c)


def test_arms_parse_with_their_patches(probe):
    arm = probe.parse_arm(f"engine@{PLAN}:PERSISTENT_MAX_SQ=65536@{PLAN}:X='a'")
    assert arm.impl == "engine" and arm.label.startswith("engine@")
    assert arm.patches == ((PLAN, "PERSISTENT_MAX_SQ", 65536), (PLAN, "X", "a"))
    assert probe.parse_arm("sdpa-cudnn") == probe.Arm("sdpa-cudnn", "sdpa-cudnn", ())
    for bad, why in [("engine@PERSISTENT_MAX_SQ=1", "expected IMPL@module.path:NAME=VALUE"),
                     (f"engine@{PLAN}:N", "expected IMPL@module.path:NAME=VALUE"),
                     (f"engine@{PLAN}:N=abc", "'abc' is not a Python literal"),
                     (f"@{PLAN}:N=1", "no implementation named")]:
        with pytest.raises(ValueError, match=why):
            probe.parse_arm(bad)


def test_patches_hold_only_inside_their_block(probe):
    from engine.kernels.attention_bwd import plan

    before = plan.PERSISTENT_MAX_SQ
    with pytest.raises(RuntimeError), probe.patched(((PLAN, "PERSISTENT_MAX_SQ", 7),)):
        assert plan.PERSISTENT_MAX_SQ == 7
        raise RuntimeError
    assert plan.PERSISTENT_MAX_SQ == before
    with pytest.raises(ValueError, match="has no 'NOPE'"), \
            probe.patched(((PLAN, "PERSISTENT_MAX_SQ", 7), (PLAN, "NOPE", 1))):
        pass
    assert plan.PERSISTENT_MAX_SQ == before


def test_rounds_rotate_the_arms(probe):
    arms = [probe.Arm(x, x) for x in "abc"]
    order = [[a.label for a in r] for r in probe.rotations(arms, 4)]
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd", "bwd"])
def test_a_case_probed_on_the_reference(probe, monkeypatch, mode):
    # two arms of the same implementation, the second with a patch that must hold while it
    # is prepared and called first and be gone when it is timed
    from engine.kernels.attention_bwd import plan

    seen = []

    def times(fn, calls):
        seen.append(plan.PERSISTENT_MAX_SQ)
        out = fn()
        assert all(torch.isfinite(t).all() for t in (out if isinstance(out, tuple) else (out,)))
        return {"kernels_us": 10.0 + len(seen), "kernels": {"0:main": 5.0}}

    real_prepare = probe.get_impl("reference").prepare
    built = []

    def prepare(self, *args):
        built.append(plan.PERSISTENT_MAX_SQ)
        return real_prepare(*args)

    monkeypatch.setattr(probe, "TIMES", times)
    monkeypatch.setattr(probe, "get_impl", lambda name: types.SimpleNamespace(
        prepare=types.MethodType(prepare, object())))
    arms = [probe.parse_arm("reference"), probe.parse_arm(f"reference@{PLAN}:PERSISTENT_MAX_SQ=9")]
    rec = probe.probe_case(case(), arms, mode, rounds=3, calls=2, device=CPU)
    default = plan.PERSISTENT_MAX_SQ
    assert built == [default, 9] and seen == [default] * 6
    assert rec["order"] == [[arms[0].label, arms[1].label], [arms[1].label, arms[0].label],
                            [arms[0].label, arms[1].label]]
    first, second = rec[arms[0].label], rec[arms[1].label]
    assert first["rounds_us"] == [11.0, 14.0, 15.0] and first["median_us"] == 14.0
    assert second["rounds_us"] == [12.0, 13.0, 16.0] and second["kernels_us"] == {"0:main": 5.0}
    assert len(first["rel_diff"]) == (1 if mode == "fwd" else 3)
    assert max(second["rel_diff"]) < 1e-6  # the same reference both ways


def test_results_flatten_and_decode_cases_are_refused(probe):
    a, b = torch.ones(2), torch.zeros(3)
    assert probe.tensors((a, (b, None))) == [a, b] and probe.tensors(a) == [a]
    with pytest.raises(ValueError, match="decode cases are not probed here"):
        probe.case_inputs(case(kind="decode", seqlen_q=1), CPU)


def test_main_names_a_filter_that_matches_nothing(probe, tmp_path, capsys):
    with pytest.raises(SystemExit):
        probe.main([str(tmp_path / "o.json"), "paper", "nothing/*", "--arm", "engine"])
    assert "no case of suite 'paper' matches" in capsys.readouterr().err



# A small simple GLA case for the linear arms, and a compile that records the sources handed
# to it and stops the probe there (no GPU to call the kernels).
LINEAR = case(variant="simple_gla", kind="linear", heads=2, head_dim=64, head_dim_v=64,
              seqlen_q=128, seqlen_kv=128, dtype="bfloat16", modes=("fwd", "fwd+bwd"))


def _stopped_at_compile(monkeypatch) -> list[list[str]]:
    compiled: list[list[str]] = []

    def precompile(srcs):
        compiled.append(list(srcs))
        raise KeyboardInterrupt

    monkeypatch.setattr("attnbench.arms.precompile", precompile)
    return compiled


def test_the_arms_kernels_compile_together_under_their_patches(probe, monkeypatch):
    # the engine's linear arms: each arm's sources read under its own patch, all handed to
    # one parallel compile before any arm's first call (stopped there: no GPU to call them)
    lin = "engine.kernels.linear_fwd.plan"
    compiled, c = _stopped_at_compile(monkeypatch), LINEAR
    arms = [probe.parse_arm("engine"), probe.parse_arm("reference"),
            probe.parse_arm(f"engine@{lin}:CHUNK_LOOP_BLOCKS_PER_SM=1")]
    with pytest.raises(KeyboardInterrupt):
        probe.probe_case(c, arms, "fwd+bwd", rounds=1, calls=1, device=CPU)
    (srcs,) = compiled
    default, patched = srcs[:len(srcs) // 2], srcs[len(srcs) // 2:]  # the reference has none
    assert len(default) == len(patched)
    assert any("annotate_min_blocks_per_sm(2)" in s for s in default)  # two blocks: the default
    assert not any("annotate_min_blocks_per_sm" in s for s in patched)  # the patched arm's one


def test_a_deadline_ends_only_a_block_that_runs_past_it(monkeypatch, capsys):
    # a kernel that never ends blocks the main thread in CUDA: the deadline's timer thread
    # ends the process with the block named (os._exit replaced here to record it)
    import threading
    import time

    from attnbench import deadline as dl

    exited = threading.Event()
    monkeypatch.setattr(dl.os, "_exit", lambda status: exited.set())
    with dl.deadline(0.05, "quick"):
        pass
    time.sleep(0.2)
    assert not exited.is_set()  # the quick block's timer was cancelled
    with dl.deadline(0.05, "case X arm Y's first call"):
        assert exited.wait(5.0)
    assert "case X arm Y's first call: not finished after 0 s" in capsys.readouterr().err


def test_an_arm_whose_config_does_not_fit_the_case_sits_it_out(probe, monkeypatch, capsys):
    # 128 key rows at D 64: that arm is refused here and named; the rest compile together
    compiled, c = _stopped_at_compile(monkeypatch), LINEAR
    wide = "engine@fwd=C64_K128_V64_s1_t256_1p"
    arms = [probe.parse_arm("engine"), probe.parse_arm(wide)]
    with pytest.raises(KeyboardInterrupt):
        probe.probe_case(c, arms, "fwd+bwd", rounds=1, calls=1, device=CPU)
    assert f"c {wide}: refused here: " in capsys.readouterr().out
    assert compiled[0] and not any("K128" in s.split("\n", 1)[0] for s in compiled[0])
    with pytest.raises(Exception, match="block_K=128"):  # the reference arm may not sit out
        probe.probe_case(c, arms[::-1], "fwd+bwd", rounds=1, calls=1, device=CPU)
    # a backward config at another chunk than the case's default forward's: refused the same
    other = "engine@bwd=C64_K64_V64_s2_t128"
    with pytest.raises(KeyboardInterrupt):
        probe.probe_case(c, [arms[0], probe.parse_arm(other)], "fwd+bwd", rounds=1, calls=1,
                         device=CPU)
    assert f"c {other}: refused here: backward_config: chunk 64 " in capsys.readouterr().out
