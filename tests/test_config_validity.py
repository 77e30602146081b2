"""The KernelConfig validity model: TileLang's warp partition of both forward gemms, checked
against TileLang's own partition code, and the configs measured on the H100."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from engine.kernels.attention_fwd.plan import config_problems
from engine.plan.config import KernelConfig, warp_partition

# Compiled and ran on the H100 (first `attnbench tune` run, llama3-8b, D=128, bf16).
WORKED = [
    KernelConfig(192, 128, 2, 384, "FullRow"),
    KernelConfig(128, 128, 2, 256, "FullRow"),
    KernelConfig(128, 64, 2, 256, "FullRow"),
    KernelConfig(64, 64, 2, 128, "FullRow"),
    KernelConfig(64, 128, 1, 128, "Square"),
]
# Refused by TileLang 0.1.15 at lowering: no partition (H100 run), or a split along N that
# conflicts with P as the register operand of the PV gemm (lowered on CPU).
REFUSED = [
    KernelConfig(64, 32, 2, 384, "Square"),
    KernelConfig(64, 64, 2, 256, "FullRow"),
    KernelConfig(128, 128, 2, 256, "Square"),
    KernelConfig(128, 96, 2, 384, "Square"),
]


@pytest.mark.parametrize("cfg", WORKED, ids=lambda c: c.key())
def test_configs_that_ran_are_valid(cfg):
    assert config_problems(cfg, 128, 128) == []


@pytest.mark.parametrize("cfg", REFUSED, ids=lambda c: c.key())
def test_configs_tilelang_refused_are_invalid(cfg):
    problems = config_problems(cfg, 128, 128)
    assert problems and any("warp" in p for p in problems)


def test_partition_rules_by_hand():
    assert warp_partition(64, 32, 12, "Square") is None  # the H100 error message's case
    assert warp_partition(192, 128, 12, "FullRow") == (12, 1)
    assert warp_partition(64, 64, 8, "FullRow") == (4, 2)  # wgmma: groups of 4 along M
    assert warp_partition(64, 64, 8, "FullRow", wgmma=False) == (4, 2)
    assert warp_partition(32, 64, 8, "FullRow", wgmma=False) == (2, 4)
    assert warp_partition(128, 128, 8, "FullCol") == (4, 2)
    assert warp_partition(256, 192, 12, "FullRow") == (4, 3)


def test_partition_matches_tilelang():
    tilelang = pytest.importorskip("tilelang")
    from tilelang.ir import GemmWarpPolicy
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90a"})
    codes = {"Square": 0, "FullRow": 1, "FullCol": 2}
    assert tilelang is not None
    for m, n, warps, pol, (inst, wgmma) in itertools.product(
        [64, 128, 192, 256], [32, 64, 96, 128, 192, 256], [4, 8, 12], codes,
        [("cuda.wgmma", True), ("cuda.mma", False)],
    ):
        policy = GemmWarpPolicy(policy_type=codes[pol], m_warp=1, n_warp=1)
        try:
            want = policy.compute_warp_partition(m, n, warps * 32, target, inst)
        except Exception:  # TileLang's "No valid warp partition"
            want = None
        assert warp_partition(m, n, warps, pol, wgmma) == want, (m, n, warps, pol, inst)


def test_space_keeps_enough_valid_configs():
    from attnbench.tune.space import load_space

    space = load_space("attention_fwd")
    counts = {d: len(space.valid_configs(d, d)) for d in (64, 128, 256)}
    assert counts == {64: 351, 128: 230, 256: 68}  # the numbers quoted in the space file
    assert counts[128] >= 48


def test_masked_blocks_pick_tiles_with_register_headroom():
    """192 x 128 tiles on 384 threads fill a consumer's registers with accumulators: specs whose
    partial blocks do more than a causal mask get 128 x 128 tiles (engine.plan.config)."""
    import torch

    from engine.kernels.attention_fwd.plan import default_forward_config, masked_body_fits
    from engine.variants import VARIANTS

    big, mid = KernelConfig(192, 128, 2, 384), KernelConfig(128, 128, 2, 256, "FullRow", 8)
    walk = KernelConfig(128, 128, 2, 256, schedule="overlap", persistent=True)
    assert masked_body_fits(big, 128, 128, 2) and not masked_body_fits(big, 128, 128, 3)
    assert masked_body_fits(mid, 128, 128, 6)
    # The warp-specialised schedule for online softmaxes that read tensors at most per query
    # or per key (document ids: staged); ReLU and sigmoid (no softmax to overlap), RetNet (no
    # rescaled output) and specs that read per (query, key) (T5's bucketed bias) keep
    # TileLang's pipeline, heavier partial blocks on 128 rows. The warp-specialised schedule
    # walks its tiles persistently.
    expect = {"softmax": walk, "sigmoid": big, "relu": big, "softmax_causal": walk,
              "sliding_window": walk, "document": walk, "document_prefix": walk,
              "prefix_lm": walk, "alibi": walk,
              "softcap": walk, "retnet": mid, "neighbourhood_2d": walk, "gemma2": walk,
              "key_gate": walk,
              "t5_bias": KernelConfig(128, 64, 2, 256)}
    for name, cfg in expect.items():
        spec = VARIANTS[name].build(batch=1, heads_q=4, heads_kv=4, seqlen_q=256, seqlen_kv=256,
                                    head_dim=128, head_dim_v=128, dtype=torch.bfloat16,
                                    backend="reference").spec
        assert default_forward_config(128, 128, spec=spec, seqlen_q=4096) == cfg, name
        if cfg.schedule != "auto":  # one kernel for every length: the automatic pipeline
            auto = big if spec.masked_block_ops() <= 2 else mid
            assert default_forward_config(128, 128, spec=spec, dynamic=True) == auto, name
    # Without a spec (or where no config has headroom) the preference order alone decides;
    # past D 128 the walk's own O stage does not fit beside two K/V stages.
    assert default_forward_config(128, 128) == walk
    assert default_forward_config(256, 256) == KernelConfig(128, 64, 2, 256, schedule="overlap")
    assert not default_forward_config(192, 128).persistent


def test_three_warpgroup_tiles_at_d64_on_long_rows():
    """192-row warp-specialised tiles (three consumer warpgroups) by default at D 64 only, rows
    and keys from 2048 unmasked (three stages) and 8192 masked (two, and persistent past
    MASKED_WALK_ROWS); unknown lengths, D 128, short keys and heavier masks keep 128 rows."""
    import torch

    from engine import AttentionEngine, CustomIO, meta_tensor
    from engine.kernels.attention_fwd.plan import default_forward_config
    from engine.variants import VARIANTS

    wide = KernelConfig(192, 128, 3, 384, schedule="overlap", persistent=True)
    wide_masked = dataclasses.replace(wide, num_stages=2)
    walk = KernelConfig(128, 128, 2, 256, schedule="overlap", persistent=True)

    def spec(name):
        return VARIANTS[name].build(batch=1, heads_q=4, heads_kv=4, seqlen_q=256, seqlen_kv=256,
                                    head_dim=64, head_dim_v=64, dtype=torch.bfloat16,
                                    backend="reference").spec

    def default(name, s, skv=None, d=64, **kw):
        return default_forward_config(d, d, spec=spec(name), seqlen_q=s,
                                      seqlen_kv=s if skv is None else skv, **kw)

    assert default("softmax", 1024) == walk
    assert default("softmax", 2048) == wide
    assert default("softmax", 4096) == wide
    assert default("softmax", None, None) == walk  # lengths unknown
    assert default("softmax", 4096, 1024) == walk  # short keys
    assert default("softmax_causal", 4096) == walk
    assert default("softmax_causal", 8192) == wide_masked
    assert default("softmax_causal", 16384) == wide_masked
    assert default("alibi", 16384).block_M == 128  # 5 masked ops: no registers left
    def user(score_mod, io=None):
        meta = [meta_tensor(1, 4, 256, 64)] * 3
        spec = AttentionEngine(tuple(meta), CustomIO(io or {}), score_mod=score_mod,
                               backend="reference").spec
        return default_forward_config(64, 64, spec=spec, seqlen_q=16384, seqlen_kv=16384)

    assert user(lambda s, io, b, h, q, k: s * 0.5 + io["hb"][h], {"hb": ("heads",)}) == wide
    # a tensor read per key: staged beside K on two warpgroups only
    assert user(lambda s, io, b, h, q, k: s + io["kb"][b, k], {"kb": ("batch", "seq_len_kv")}
                ) == walk
    # an unmasked score of 3 ops per element (soft-capping): no registers left at 192 rows
    assert user(lambda s, io, b, h, q, k: (s * 0.02).tanh() * 50.0) == walk
    assert default("softmax", 16384, d=128) == walk
    assert default("softmax", 16384, d=32).block_M == 128  # not measured
    assert default("softmax", 16384, dynamic=True).schedule == "auto"


def test_three_warpgroup_tiles_keep_registers_for_the_walk():
    """Three consumer warpgroups have 160 registers a thread, 32 of them kept for the walk
    (ptxas spilled D 128's 192 x 128 and D 80's); the ping-pong pairs two warpgroups only."""
    wide = KernelConfig(192, 128, 3, 384, schedule="overlap", persistent=True)
    assert not config_problems(wide, 64, 64)
    assert any("registers" in p for p in config_problems(wide, 80, 80))
    assert any("registers" in p for p in config_problems(wide, 128, 128))
    problems = config_problems(dataclasses.replace(wide, schedule="pingpong", persistent=False),
                               64, 64)
    assert any("block_M=128 with threads=256" in p for p in problems)
    problems = config_problems(dataclasses.replace(wide, threads=256), 64, 64)
    assert any("block_M=192 with threads=384" in p for p in problems)


def test_short_rows_take_the_least_padded_tile():
    """ViT's 197 rows: 192-row tiles compute 384, 128-row ones 256. A 64-row tile only where one
    holds every row; long rows keep the preference order."""
    from engine.kernels.attention_fwd.plan import default_forward_config

    big, mid = KernelConfig(192, 128, 2, 384), KernelConfig(128, 128, 2, 256, "FullRow", 8)
    assert default_forward_config(64, 64, seqlen_q=197, dynamic=True) == mid
    assert default_forward_config(128, 128, seqlen_q=512, dynamic=True) == mid
    assert default_forward_config(128, 128, seqlen_q=700, dynamic=True) == big  # 768 rows
    assert default_forward_config(128, 128, seqlen_q=4096, dynamic=True) == big
    assert default_forward_config(128, 128, seqlen_q=48).block_M == 64
    assert default_forward_config(128, 128, seqlen_q=None, dynamic=True) == big
    # The warp-specialised default already has 128-row tiles: short rows keep it (persistent:
    # ViT-S/16's forward 0.140 -> 0.105 ms on the H100).
    ws = default_forward_config(64, 64)
    assert ws.schedule == "overlap" and ws.persistent
    assert default_forward_config(64, 64, seqlen_q=197) == ws


def test_short_keys_take_one_block_fitted_to_them():
    """Keys shorter than 256 in the least fitting warp-specialised block, where that pads
    less and fits; otherwise the block of the preference order."""
    from engine.kernels.attention_fwd.plan import default_forward_config

    def block_N(D: int, skv: int | None, **kw) -> int:
        return default_forward_config(D, D, seqlen_q=197, seqlen_kv=skv, **kw).block_N

    assert block_N(64, 197) == 208  # ViT: 208 keys computed, not 256
    assert block_N(64, 100) == 112 and block_N(64, 40) == 64 and block_N(64, 75) == 112
    assert block_N(64, 140) == 208 and block_N(64, 220) == 240
    assert block_N(64, 256) == 128 and block_N(64, 250) == 128  # pads no less
    assert block_N(64, 300) == 128 and block_N(64, None) == 128
    assert block_N(128, 197) == 128  # a 208-key ring and O's stage exceed the shared memory
    assert block_N(64, 197, dynamic=True) == 128  # the automatic pipeline: listed blocks only
    ws = KernelConfig(128, 128, 2, 256, schedule="overlap", persistent=True)
    assert not config_problems(dataclasses.replace(ws, block_N=208), 64, 64)
    assert config_problems(dataclasses.replace(ws, block_N=200), 64, 64)  # not a multiple of 16
    assert config_problems(dataclasses.replace(ws, block_N=144), 64, 64)  # not run on the H100
    assert config_problems(KernelConfig(128, 208, 2, 256), 64, 64)  # the automatic pipeline


def test_warp_specialised_schedule_validity():
    """Consumer warpgroups of 64 rows (block_M 128 on 256 threads, or 192 on 384 overlapped;
    FullRow); O staged in Q's shared tile where D == Dv, so 128 x 64 tiles with two stages fit
    at D 256; the backward takes no schedule."""
    from engine.kernels.attention_bwd.plan import backward_config_problems
    from engine.kernels.attention_fwd.plan import config_problems, estimate_resources

    ok = KernelConfig(128, 176, 2, 256, schedule="pingpong")
    assert config_problems(ok, 128, 128) == []
    assert ok.key().endswith("_pingpong") and not KernelConfig().key().endswith("auto")
    for bad in (KernelConfig(192, 128, 2, 384, schedule="pingpong"),
                KernelConfig(128, 128, 2, 256, "Square", schedule="overlap"),
                KernelConfig(64, 64, 2, 128, schedule="overlap")):
        assert any("consumer warpgroups" in p for p in config_problems(bad, 64, 64)), bad
    assert any("expected one of" in p
               for p in config_problems(KernelConfig(schedule="fast"), 128, 128))
    d256 = KernelConfig(128, 64, 2, 256, schedule="overlap")
    assert config_problems(d256, 256, 256) == []
    auto = KernelConfig(128, 64, 2, 256)
    assert estimate_resources(auto, 256, 256)["smem_bytes"] - \
        estimate_resources(d256, 256, 256)["smem_bytes"] == 2 * 128 * 256
    assert any("schedule" in p for p in backward_config_problems(d256, 128, 128))


def test_persistent_walk_validity():
    """The persistent walk: a warp-specialised schedule in grid order (no swizzle), O staged
    apart from Q (so D 256 fits one K/V stage only), never the backward; its key and tune
    dict name it only when on, so earlier tune files read back unchanged."""
    from engine.kernels.attention_bwd.plan import backward_config_problems
    from engine.kernels.attention_fwd.plan import config_problems, estimate_resources

    walk = KernelConfig(128, 128, 2, 256, schedule="overlap", persistent=True)
    assert config_problems(walk, 128, 128) == [] and walk.key().endswith("_overlap_persistent")
    assert walk.to_dict()["persistent"] is True and "persistent" not in KernelConfig().to_dict()
    assert KernelConfig.from_dict(walk.to_dict()) == walk
    assert any("warp-specialised schedule" in p
               for p in config_problems(KernelConfig(persistent=True), 128, 128))
    swizzled = KernelConfig(128, 128, 2, 256, "FullRow", 8, "overlap", persistent=True)
    assert any("swizzle_panel=0" in p for p in config_problems(swizzled, 128, 128))
    plain = KernelConfig(128, 64, 1, 256, schedule="overlap")
    wide = KernelConfig(128, 64, 1, 256, schedule="overlap", persistent=True)
    assert estimate_resources(wide, 256, 256)["smem_bytes"] - \
        estimate_resources(plain, 256, 256)["smem_bytes"] == 2 * 128 * 256
    assert config_problems(wide, 256, 256) == []
    two_stages = KernelConfig(128, 64, 2, 256, schedule="overlap", persistent=True)
    assert any("shared memory" in p for p in config_problems(two_stages, 256, 256))
    assert any("persistent" in p for p in backward_config_problems(
        KernelConfig(64, 128, 2, 256, persistent=True), 128, 128))


def test_persistent_walk_default_follows_the_warp_specialised_schedule():
    """The warp-specialised specs walk persistently by default, masked ones and per-head,
    per-query and per-key custom reads included (masked tiles dealt by the host's table);
    sigmoid is not warp-specialised."""
    import torch

    from engine.kernels.attention_fwd.plan import persistent_by_default
    from engine.variants import VARIANTS

    want = {"softmax": True, "softmax_causal": True, "alibi": True, "softcap": True,
            "sliding_window": True, "document": True, "document_prefix": True,
            "sigmoid": False}
    for name, expected in want.items():
        spec = VARIANTS[name].build(batch=1, heads_q=4, heads_kv=4, seqlen_q=256, seqlen_kv=256,
                                    head_dim=128, head_dim_v=128, dtype=torch.bfloat16,
                                    backend="reference").spec
        assert persistent_by_default(spec) is expected, name
    # Masked rows past MASKED_WALK_ROWS take the plain grid (the walk's gain is per tile);
    # unmasked ones walk at every length.
    from engine.kernels.attention_fwd.plan import MASKED_WALK_ROWS, default_forward_config

    def default(name: str, rows: int) -> KernelConfig:
        spec = VARIANTS[name].build(batch=1, heads_q=4, heads_kv=4, seqlen_q=256, seqlen_kv=256,
                                    head_dim=128, head_dim_v=128, dtype=torch.bfloat16,
                                    backend="reference").spec
        return default_forward_config(128, 128, spec=spec, seqlen_q=rows)

    assert default("softmax_causal", MASKED_WALK_ROWS).persistent
    long_causal = default("softmax_causal", 2 * MASKED_WALK_ROWS)
    assert long_causal == KernelConfig(128, 128, 2, 256, schedule="overlap")
    assert default("softmax", 2 * MASKED_WALK_ROWS).persistent
    # a mask that reads data: a row spans its document, the walk at every length
    assert default("document_prefix", 2 * MASKED_WALK_ROWS).persistent
