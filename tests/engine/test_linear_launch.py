"""The linear kernels' launchers on the CPU with recording kernels (nothing compiles or runs):
which kernels a forward and a backward launch, in order, for the single-pass and two-kernel
configs, with folds and kept states; that every launch binds each parameter by name with its
declared dtype and extents (engine.runtime.kernel.check_arguments); and that the tensors one
kernel writes are the ones the next reads (Gc, Hs, dHs)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.linear_bwd.launch import build_backward, launch_backward
from engine.kernels.linear_fwd.launch import build_forward, launch_forward
from engine.kernels.linear_fwd.plan import NO_FOLDS, Folds, LinearConfig, LinearShape
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
          save: bool = False, states: bool = True):
    hq, hk, h = heads
    s = LinearShape(batch=2, heads_q=hq, heads_k=hk, heads=h, seqlen=seqlen, head_dim=64,
                    head_dim_v=128, dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, n, seqlen, 64, generator=gen).bfloat16() for n in (hq, hk))
    v = torch.randn(2, h, seqlen, 128, generator=gen).bfloat16()
    g = -torch.rand(2, h, seqlen, generator=gen)
    w = torch.rand(2, h, seqlen, generator=gen) if folds.v_weight else None
    h0 = torch.randn(2, h, 64, 128, generator=gen) if states else None
    fk, bk = build_forward(s, cfg, folds), build_backward(s, cfg, folds)
    o, fwd = launch_forward(fk, q, k, v, g, h0, None, states, w, save)
    dht = torch.randn(2, h, 64, 128, generator=gen) if states else None
    grads = launch_backward(fk, bk, q, k, v, fwd, h0, torch.randn_like(o), dht, states)
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


def test_backward_kernels_read_the_forwards_decay_sums(launches):
    """Every backward kernel reads G by slot (and, with a value weight, the weights) from the
    forward's decay kernel, not the decays again: the two-kernel path's and the dQ/dK kernel's
    with and without weights."""
    for cfg, folds in ((TWO, NO_FOLDS), (TWO, FOLDED), (ONE, FOLDED)):
        launches.clear()
        _call(cfg, folds, heads=(1, 1, 4))
        decays = dict(launches)["decays"]
        for kind, args in launches[1:]:
            assert "G" not in args and "W" not in args, kind
            if kind in ("reverse state pass", "dv", "dq dk dg", "reverse single pass"):
                assert args["Gc"] is decays["Gc"], kind
            if folds.v_weight and kind in ("dv", "dq dk dg", "reverse single pass"):
                assert args["Wc"] is decays["Wc"], kind


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


def test_only_the_dqk_kernel_pipelines_its_value_tiles_at_64_position_chunks():
    """linear_fwd.plan.value_stages (NOTES 160): the dQ/dK kernel's loop over value tiles is
    pipelined (warp specialisation off) at 64-position chunks with two or more tiles; not at
    128-position chunks, not with one tile, and never in the dV or output kernels."""
    from engine.kernels.linear_bwd.codegen import generate_dqk, generate_dv
    from engine.kernels.linear_bwd.plan import dqk_value_stages
    from engine.kernels.linear_fwd.codegen import generate_output

    def shape(d: int, dv: int, heads=(16, 16, 16)) -> LinearShape:
        hq, hk, h = heads
        return LinearShape(batch=8, heads_q=hq, heads_k=hk, heads=h, seqlen=4096, head_dim=d,
                           head_dim_v=dv, dtype="bfloat16")

    narrow = LinearConfig(block_K=64, single_pass=True, threads=128)
    assert dqk_value_stages(shape(128, 128), narrow) == 2
    assert dqk_value_stages(shape(256, 512), LinearConfig(block_K=128)) == 2
    assert dqk_value_stages(shape(128, 128), LinearConfig(chunk=128, block_K=128,
                                                          threads=256)) == 1
    assert dqk_value_stages(shape(128, 64, (1, 1, 80)), narrow) == 1  # one value tile
    s = shape(128, 128)
    dqk = generate_dqk(s, narrow).source
    assert "for iv in T.Pipelined(2, num_stages=2):" in dqk
    assert "'tl.disable_warp_specialized': True" in dqk
    for other in (generate_dv(s, narrow).source, generate_output(s, narrow).source):
        assert "for iv in T.serial(2):" in other and "PASS_CONFIGS" not in other


def test_dqk_blocks_walk_heads_that_share_q_and_k():
    """Where every output head reads one q and one k head (Mamba2), at one value tile and
    64-position chunks, a dQ/dK block walks up to 4 heads (a divisor of the heads) in a
    pipelined loop, its Q and K tiles loaded once, the grid over groups; otherwise a block
    per head."""
    from engine.kernels.linear_bwd.codegen import generate_dqk
    from engine.kernels.linear_bwd.plan import dqk_heads_per_block

    def shape(heads=(1, 1, 80), dv: int = 64) -> LinearShape:
        hq, hk, h = heads
        return LinearShape(batch=8, heads_q=hq, heads_k=hk, heads=h, seqlen=2048,
                           head_dim=128, head_dim_v=dv, dtype="bfloat16")

    suite = LinearConfig(block_K=128, single_pass=True, threads=256)  # Mamba2 B 8's pair
    assert dqk_heads_per_block(shape(), suite) == 4
    assert dqk_heads_per_block(shape((1, 1, 6)), suite) == 3
    assert dqk_heads_per_block(shape((1, 1, 7)), suite) == 1
    assert dqk_heads_per_block(shape(dv=128), suite) == 1  # two value tiles
    assert dqk_heads_per_block(shape((2, 1, 80)), suite) == 1
    assert dqk_heads_per_block(shape((16, 16, 16)), suite) == 1
    assert dqk_heads_per_block(shape(), LinearConfig(chunk=128, block_K=128, threads=256)) == 1
    src = generate_dqk(shape(), suite, atomic=True).source
    assert "with T.Kernel(20, 1, 256, threads=256) as (hg, ik, j):" in src
    assert "for hh in T.Pipelined(4, num_stages=2):" in src and "h: T.int32 = hg * 4 + hh" in src
    assert "'tl.disable_warp_specialized': True" in src and "for iv in" not in src
    # Q and K load once per block, before the heads' loop
    assert src.index("T.copy(K[b, hk,") < src.index("for hh in")
    one = generate_dqk(shape((1, 1, 7)), suite, atomic=True).source
    assert "as (h, ik, j):" in one and "for hh in" not in one
