"""The linear kernels' launchers on the CPU with recording kernels (nothing compiles or runs):
which kernels a forward and a backward launch, in order, for the single-pass and two-kernel
configs, with folds and kept states; that every launch binds each parameter by name with its
declared dtype and extents (engine.runtime.kernel.check_arguments); and that the tensors one
kernel writes are the ones the next reads (Gc, Hs, dHs)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.linear_bwd.launch import build_backward, launch_backward
from engine.kernels.linear_bwd.plan import dqk_head_group
from engine.kernels.linear_fwd.launch import build_forward, launch_forward
from engine.kernels.linear_fwd.plan import (
    NO_FOLDS,
    Folds,
    LinearConfig,
    LinearShape,
    backward_config_for_shape,
)
from engine.runtime.kernel import Kernel, check_arguments

ONE = LinearConfig(block_K=64, single_pass=True, threads=256)
TWO = LinearConfig(block_K=64, threads=128)
FOLDED = Folds(q_scale=0.5, v_weight=True)


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, dict]]:
    """Each launch as (the kernel's kind from its header, {parameter: tensor})."""
    seen: list[tuple[str, dict]] = []

    def record(self: Kernel, *args):
        check_arguments(self.params, args)
        header = self.source.splitlines()[0]
        kind = header.split(": ", 1)[1].split(" B")[0]
        seen.append((kind, dict(zip(self.names, args, strict=True))))

    monkeypatch.setattr(Kernel, "launch", record)
    return seen


def _call(cfg: LinearConfig, folds: Folds = NO_FOLDS, seqlen: int = 200, heads=(4, 4, 4),
          save: bool = False, states: bool = True, deterministic: bool = False):
    hq, hk, h = heads
    s = LinearShape(batch=2, heads_q=hq, heads_k=hk, heads=h, seqlen=seqlen, head_dim=64,
                    head_dim_v=128, dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, n, seqlen, 64, generator=gen).bfloat16() for n in (hq, hk))
    v = torch.randn(2, h, seqlen, 128, generator=gen).bfloat16()
    g = -torch.rand(2, h, seqlen, generator=gen)
    w = torch.rand(2, h, seqlen, generator=gen) if folds.v_weight else None
    h0 = torch.randn(2, h, 64, 128, generator=gen) if states else None
    fk, bk = build_forward(s, cfg, folds), build_backward(s, cfg, folds, deterministic)
    o, fwd = launch_forward(fk, q, k, v, g, h0, None, states, w, save)
    dht = torch.randn(2, h, 64, 128, generator=gen) if states else None
    grads = launch_backward(fk, bk, q, k, v, g, fwd, h0, torch.randn_like(o), dht, states, w)
    return s, grads


def _kinds(launches) -> list[str]:
    return [kind for kind, _ in launches]


def test_single_pass_config_runs_the_reverse_single_pass(launches):
    s, (dq, dk, dv, dg, dh0, dw) = _call(ONE)
    assert _kinds(launches) == ["decays", "single pass", "state pass",
                                "reverse single pass", "dq dk dg"]
    by = dict(launches)
    rev, dqk = by["reverse single pass"], by["dq dk dg"]
    assert rev["Gc"] is by["decays"]["Gc"], "the reverse pass reads the forward's decay sums"
    assert rev["dHs"] is dqk["dHs"] and by["state pass"]["Hs"] is dqk["Hs"]
    assert rev["dV"] is dv and rev["dH0"] is dh0 and "dHt" in rev
    assert dq.shape == (2, 4, 200, 64) and dv.shape == (2, 4, 200, 128) and dw is None


def test_two_kernel_config_runs_the_reverse_state_pass_and_dv(launches):
    _call(TWO)
    assert _kinds(launches) == ["decays", "state pass", "output", "state pass",
                                "reverse state pass", "dv", "dq dk dg"]
    by = [a for _, a in launches]
    assert by[4]["dHs"] is by[5]["dHs"] is by[6]["dHs"]
    assert by[4]["Gc"] is by[0]["Gc"], "the reverse state pass reads the forward's decay sums"


def test_one_chunk_rows_take_the_two_kernels(launches):
    """runs_single_pass: a row of one chunk has no chunk loop to pipeline, in either pass."""
    _call(ONE, seqlen=64)
    assert "reverse single pass" not in _kinds(launches)
    assert "reverse state pass" in _kinds(launches) and "single pass" not in _kinds(launches)


def test_value_weights_give_one_dw_share_per_value_tile(launches):
    s, (*_, dw) = _call(ONE, FOLDED, heads=(1, 1, 4))
    rev = dict(launches)["reverse single pass"]
    assert rev["dW"].shape == (128 // ONE.block_V, 2, 4, 200)
    assert "Wc" in rev and "V" in rev
    assert dw.shape == (2, 4, 200) and dw.dtype == torch.float32


def test_kept_states_skip_the_state_pass(launches):
    _call(ONE, FOLDED, save=True, states=False)
    assert _kinds(launches) == ["decays", "single pass", "reverse single pass", "dq dk dg"]
    by = dict(launches)
    assert by["single pass"]["Hs"] is by["dq dk dg"]["Hs"]
    assert "dH0" not in by["reverse single pass"] and "dHt" not in by["reverse single pass"]


def _mamba2(batch: int, seqlen: int) -> LinearShape:
    return LinearShape(batch=batch, heads_q=1, heads_k=1, heads=80, seqlen=seqlen, head_dim=128,
                       head_dim_v=64, dtype="bfloat16")


def test_head_groups_follow_sharing_shared_memory_and_waves():
    """Mamba2-2.7B at B 8 walks 8 of its 80 heads per dQ/dK block; not where no head is
    shared, where 128-position chunks leave no room for the sums, or where the groups would
    not fill two waves of the SMs."""
    m2k = _mamba2(8, 2048)
    assert dqk_head_group(m2k, backward_config_for_shape(m2k)) == 8
    m1 = _mamba2(1, 8192)
    assert backward_config_for_shape(m1).chunk == 128
    assert dqk_head_group(m1, backward_config_for_shape(m1)) == 1
    assert dqk_head_group(_mamba2(1, 128), ONE) == 1  # 320 blocks ungrouped
    mha = LinearShape(batch=8, heads_q=16, heads_k=16, heads=16, seqlen=4096, head_dim=128,
                      head_dim_v=128, dtype="bfloat16")
    assert dqk_head_group(mha, ONE) == 1
    mixed = LinearShape(batch=8, heads_q=2, heads_k=1, heads=16, seqlen=4096, head_dim=128,
                        head_dim_v=128, dtype="bfloat16")
    assert dqk_head_group(mixed, ONE) == 8  # gcd of 8 and 16 heads per q and k head


@pytest.mark.parametrize("deterministic", [False, True])
def test_grouped_heads_bind_one_sum_per_group(launches, deterministic):
    """A grouped dQ/dK kernel adds into the shared head by atomics, or (deterministic) writes
    one float32 sum per group of heads for the launcher to add: dq and dk come back in the
    shared heads' shape and the inputs' dtype."""
    s, (dq, dk, *_) = _call(ONE, heads=(1, 1, 16), seqlen=4200, deterministic=deterministic)
    kind, dqk = launches[-1]
    assert kind == "dq dk dg"
    group = 8
    if deterministic:
        assert dqk["dQh"].shape == (2, 16 // group, 4200, 64) and "dQa" not in dqk
    else:
        assert dqk["dQa"].shape == (2, 1, 4200, 64) and "dQh" not in dqk
    assert dq.shape == dk.shape == (2, 1, 4200, 64) and dq.dtype == torch.bfloat16


def test_the_gpu_tests_grouped_cases_walk_groups():
    """tests/gpu/test_linear_kernels.py's GROUPED cases exercise the grouped kernel (at the
    configs those tests run: the case's, else config_for_shape's for both passes)."""
    from engine.kernels.linear_fwd.plan import config_for_shape
    from tests.gpu.test_linear_kernels import GROUPED

    groups = []
    for _, (hq, hk, h), (d, dv), b, t, _, _, cfg in GROUPED:
        s = LinearShape(batch=b, heads_q=hq, heads_k=hk, heads=h, seqlen=t, head_dim=d,
                        head_dim_v=dv, dtype="bfloat16")
        groups.append(dqk_head_group(s, cfg or config_for_shape(s)))
    assert groups == [4, 2]
