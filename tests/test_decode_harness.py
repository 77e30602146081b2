"""The decode harness on a CPU: lengths, paged tables, traffic counts, suite fields, the
implementations' decode checks, and a decode suite run end to end against the engine's decode
reference (attnbench/decode.py, issue 23)."""

from __future__ import annotations

import math

import pytest
import torch

from attnbench import metrics
from attnbench.cases import Case
from attnbench.decode import (
    WINDOWS,
    attended_pairs,
    cache_lengths,
    case_traffic,
    decode_bytes,
    make_decode_inputs,
    page_table,
    valid_mask,
)
from attnbench.impls import DeviceInfo, Prepared, get_impl
from attnbench.impls.fa3 import decode_problem
from attnbench.results.read import read_results
from attnbench.runner import Runner, RunOptions
from attnbench.suites import SuiteError, load_suite, parse_suite
from engine.reference.decode import gather_pages
from engine.variants import get_variant

H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
BUNDLE_FLAGS = {"FLASHATTENTION_DISABLE_PAGEDKV": True, "FLASHATTENTION_DISABLE_LOCAL": True,
                "FLASHATTENTION_DISABLE_FP16": True}  # the GPU bundle's fa3-fwd 0.0.3


def dcase(**over) -> Case:
    c = dict(suite="t", name="c", variant="softmax", shape="s", batch=4, heads_q=4, heads_kv=2,
             seqlen_q=1, seqlen_kv=64, head_dim=16, head_dim_v=16, dtype="bfloat16",
             kind="decode", modes=("fwd",), impls=("engine",), baseline="engine")
    c.update(over)
    return Case(**c)


# ---------------------------------------------------------------------- lengths and pages
def test_ragged_lengths_are_seeded_and_include_both_ends():
    for batch, sq in ((2, 1), (8, 1), (64, 4)):
        lens = cache_lengths(batch, 4096, sq, True, seed=0)
        assert lens == cache_lengths(batch, 4096, sq, True, seed=0)
        assert len(lens) == batch and min(lens) == sq and max(lens) == 4096
    assert cache_lengths(8, 4096, 1, True, seed=0) != cache_lengths(8, 4096, 1, True, seed=1)
    assert sq <= cache_lengths(1, 4096, sq, True, seed=0)[0] <= 4096
    assert cache_lengths(3, 512, 2, False, seed=5) == [512, 512, 512]


def test_page_table_uses_every_page_once_in_a_shuffled_order():
    table = page_table(3, 64, 16, seed=0)
    assert table.dtype == torch.int32 and table.shape == (3, 4)
    assert sorted(table.flatten().tolist()) == list(range(12))
    assert table.flatten().tolist() != list(range(12))
    with pytest.raises(ValueError, match="page_size=24"):
        page_table(3, 64, 24, seed=0)


def test_paged_inputs_gather_to_the_contiguous_cache():
    variant = get_variant("softmax")
    flat = make_decode_inputs(dcase(ragged=True), variant, "cpu", seed=3)
    paged = make_decode_inputs(dcase(ragged=True, page_size=16), variant, "cpu", seed=3)
    assert flat["block_table"] is None and paged["k_cache"].shape == (16, 16, 2, 16)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(gather_pages(paged[name], paged["block_table"]), flat[name])
    assert torch.equal(paged["q"], flat["q"])
    assert torch.equal(paged["cache_seqlens"], flat["cache_seqlens"])
    assert paged["cache_seqlens"].dtype == torch.int32


# ---------------------------------------------------------------------- traffic
def test_bytes_count_valid_keys_or_the_window_plus_q_and_o():
    c = dcase(batch=2, heads_q=8, heads_kv=2, seqlen_q=2, seqlen_kv=1000, head_dim=128,
              head_dim_v=64)
    qo = 2 * 2 * 8 * (128 + 64)
    assert decode_bytes(c, [1000, 10], None) == 2 * (1010 * 2 * (128 + 64) + qo)
    # a window of 100 keys: the two new tokens' windows cover 101 keys
    assert decode_bytes(c, [1000, 10], 100) == 2 * ((101 + 10) * 2 * (128 + 64) + qo)
    assert decode_bytes(dcase(dtype="float32"), [64] * 4, None) == 2 * decode_bytes(
        dcase(), [64] * 4, None)


@pytest.mark.parametrize("variant", ["softmax", "softmax_causal", "sliding_window"])
def test_pairs_match_the_mask_the_sdpa_rows_use(variant):
    v = get_variant(variant)
    c = dcase(variant=variant, seqlen_q=3, seqlen_kv=2048, batch=3, ragged=True)
    lens = cache_lengths(3, 2048, 3, True, seed=0)
    mask = valid_mask(c, v, torch.tensor(lens, dtype=torch.int32))
    window = WINDOWS.get(variant)
    assert sum(attended_pairs(n, 3, v.causal, window) for n in lens) == int(mask.sum())
    _, flops = case_traffic(c, v, seed=0)
    assert flops == 2.0 * c.heads_q * int(mask.sum()) * (c.head_dim + c.head_dim_v)


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_window_table_matches_the_library_masks(name):
    w, v = WINDOWS[name], get_variant(name)
    s = 2 * w  # pairs of a causal window of w over s positions: w * s - w (w - 1) / 2
    assert round(v.unmasked_fraction(s, s) * s * s) == w * s - w * (w - 1) // 2


def test_peak_bandwidth_and_fraction():
    assert metrics.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert metrics.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert metrics.peak_bandwidth("cpu") is None
    assert metrics.tbps(3.35e9, 1.0) == pytest.approx(3.35)
    assert metrics.bw_frac(3.35, "NVIDIA H100 80GB HBM3") == pytest.approx(1.0)
    assert math.isnan(metrics.bw_frac(1.0, "Some GPU")) and math.isnan(metrics.tbps(1.0, 0.0))


# ---------------------------------------------------------------------- suite fields
def parse(block: dict, **top):
    data = {"kind": "decode", "impls": ["reference"], "modes": ["fwd"], "dtypes": ["bf16"],
            "cases": [{"variants": ["softmax"], "shapes": ["llama3-8b"], "seqlen_q": [1],
                       "seqlen_kv": [4096], **block}], **top}
    return parse_suite(data, name="t", variant_names=["softmax"])


def test_ragged_and_page_size_expand_and_name_the_cases():
    s = parse({"ragged": [False, True], "page_size": [0, 256]})
    got = [(c.ragged, c.page_size, c.name) for c in s.cases]
    assert got == [(False, 0, "softmax/llama3-8b/b1/s1x4096/bfloat16"),
                   (False, 256, "softmax/llama3-8b/b1/s1x4096/page256/bfloat16"),
                   (True, 0, "softmax/llama3-8b/b1/s1x4096/ragged/bfloat16"),
                   (True, 256, "softmax/llama3-8b/b1/s1x4096/ragged/page256/bfloat16")]
    assert parse({}, ragged=True).cases[0].ragged  # a top-level default


@pytest.mark.parametrize("block, top, msg", [
    ({"ragged": "yes"}, {}, r"cases\[0\]: ragged must be true or false, got 'yes'"),
    ({"page_size": -16}, {}, r"page_size must be an integer >= 0"),
    ({"page_size": 1000}, {}, r"page_size 1000 does not divide seqlen_kv 4096"),
    ({"seqlen_q": [8], "seqlen_kv": [4]}, {}, r"seqlen_q \(8, the new tokens\) must be <= "
     r"seqlen_kv \(4"),
    ({}, {"modes": ["fwd", "bwd"]}, r"decode cases time the forward only"),
    ({"ragged": True}, {"kind": "attention"}, r"'ragged' applies to decode cases only"),
    ({"page_size": 16}, {"kind": "attention"}, r"'page_size' applies to decode cases only"),
])
def test_decode_field_errors_name_the_field(block, top, msg):
    with pytest.raises(SuiteError, match=msg):
        parse(block, **top)


def test_shipped_decode_suite_covers_the_issue():
    suite = load_suite("decode")
    cases = suite.cases
    assert 20 <= len(cases) <= 35 and all(c.kind == "decode" for c in cases)
    assert {c.shape for c in cases} >= {"llama3-8b", "llama3-70b", "deepseek-v2-lite"}
    assert {c.variant for c in cases} >= {"softmax", "softcap", "alibi", "mistral_window"}
    assert {c.seqlen_q for c in cases} == {1, 2, 4}
    assert any(c.ragged for c in cases) and {c.page_size for c in cases} >= {0, 16, 256}
    assert {c.dtype for c in cases} == {"bfloat16", "float16"}
    table = {(c.shape, c.batch, c.seqlen_kv) for c in cases if c.variant == "softmax"
             and not c.ragged and not c.page_size and c.dtype == "bfloat16"}
    assert table >= {("llama3-8b", 8, 32768), ("llama3-8b", 1, 131072),
                     ("llama3-8b", 64, 4096), ("llama3-70b", 8, 32768)}


# ---------------------------------------------------------------------- implementations
@pytest.mark.parametrize("c, flags, msg", [
    (dcase(variant="alibi"), {}, "no ALiBi"),
    (dcase(variant="sigmoid"), {}, "variant sigmoid has no FA3 form"),
    (dcase(page_size=16), BUNDLE_FLAGS, "paged KV caches out (FLASHATTENTION_DISABLE_PAGEDKV)"),
    (dcase(variant="mistral_window"), BUNDLE_FLAGS, "(FLASHATTENTION_DISABLE_LOCAL)"),
    (dcase(head_dim=128, head_dim_v=64), {}, "192/128 or 64/256-512 (got 128/64)"),
    (dcase(head_dim=192, head_dim_v=128), {"FLASH_ATTENTION_DISABLE_HDIMDIFF192": True},
     "FLASH_ATTENTION_DISABLE_HDIMDIFF192 is set"),
])
def test_fa3_decode_refusals_name_the_build_switch(c, flags, msg):
    reason = decode_problem(c, get_variant(c.variant), flags)
    assert reason is not None and msg in reason


def test_fa3_decode_runs_what_the_bundle_compiled():
    for c in (dcase(), dcase(ragged=True, seqlen_q=4, variant="softmax_causal"),
              dcase(variant="softcap"), dcase(head_dim=192, head_dim_v=128)):
        assert decode_problem(c, get_variant(c.variant), BUNDLE_FLAGS) is None, c
    assert get_impl("flash-attention-3").decode_caps(BUNDLE_FLAGS).dtypes == {"bfloat16"}


@pytest.mark.parametrize("impl, c, msg", [
    ("sdpa-cudnn", dcase(page_size=16), "SDPA takes contiguous K/V"),
    ("sdpa-flash", dcase(ragged=True), "takes no attn_mask, which ragged lengths need"),
    ("sdpa-flash", dcase(variant="softmax_causal", seqlen_q=2), "Sq > 1 causal tokens"),
    ("sdpa-cudnn", dcase(variant="alibi"), "variant alibi not supported"),
    ("flex", dcase(page_size=16), "paged attention"),
    ("engine-dynamic", dcase(), "decode cases not supported"),
    ("engine-compiled", dcase(), "decode cases not supported"),
])
def test_decode_skip_reasons(impl, c, msg):
    reason = get_impl(impl).check(c, get_variant(c.variant), H100)
    assert reason is not None and msg in reason


def test_decode_cases_that_run():
    for impl, c in (("sdpa-cudnn", dcase(ragged=True)), ("sdpa-flash", dcase()),
                    ("sdpa-flash", dcase(variant="softmax_causal")),  # Sq 1: no mask
                    ("flex", dcase(variant="alibi", ragged=True))):
        assert get_impl(impl).check(c, get_variant(c.variant), H100) is None, (impl, c)


# ---------------------------------------------------------------------- a CPU run
def _lengthless_impl():
    """Reads the whole capacity whatever the lengths: the accuracy check must fail it."""
    from attnbench.impls import Capabilities, Impl

    class Lengthless(Impl):
        name, gpu_only = "lengthless", False
        caps = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                            kinds=frozenset({"decode"}))

        def prepare(self, case, variant, inputs, needs_grad):
            q, k, v = (inputs[n] for n in ("q", "k_cache", "v_cache"))
            g = case.heads_q // case.heads_kv
            k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)

            def forward():
                s = torch.einsum("bqhd,bkhd->bhqk", q, k) * case.head_dim ** -0.5
                return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)

            return Prepared(forward=forward)

    return Lengthless()


def test_cpu_decode_run_rows_carry_traffic_and_catch_unread_lengths(tmp_path):
    impls = {n: get_impl(n) for n in ("reference", "sdpa-math")}
    impls["lengthless"] = _lengthless_impl()
    data = {"kind": "decode", "impls": list(impls), "baseline": "sdpa-math", "modes": ["fwd"],
            "dtypes": ["float32"], "repeats": 2, "warmup": 0,
            "cases": [{"variants": ["softmax", "softmax_causal"], "shapes": ["smoke-gqa"],
                       "seqlen_q": [1, 2], "seqlen_kv": [64], "batch": [3], "ragged": [True],
                       "page_size": [0]}]}
    suite = parse_suite(data, name="dec", variant_names=["softmax", "softmax_causal"],
                        impl_names=list(impls))
    runner = Runner(suite, RunOptions(device="cpu", out_dir=tmp_path, noise_threshold=1e9),
                    impls=impls, log=lambda s: None)
    rows = runner.run().rows
    by = {(r["case"], r["impl"]): r for r in rows}
    for case in suite.cases:
        expect, _ = case_traffic(case, get_variant(case.variant), seed=0)
        for impl in ("reference", "sdpa-math"):
            r = by[(case.name, impl)]
            assert r["status"] == "ok" and r["rel_err"] < 1e-5, r
            assert r["bytes"] == expect and r["tbps"] > 0 and math.isnan(r["bw_frac"])
        assert by[(case.name, "lengthless")]["status"] == "failed"
    back = read_results(runner.path)
    assert (back["schema_version"] == 3).all() and back["bytes"].notna().all()
    from rich.console import Console

    from attnbench.commands.run import print_table

    console = Console(record=True, width=250)
    print_table(rows, console)
    assert "TB/s" in console.export_text() and "TFLOP/s" not in console.export_text()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", ["softmax", "softmax_causal", "alibi", "softcap",
                                  "sliding_window"])
def test_flex_decode_functions_match_the_decode_reference(name):
    """The flex row's mods at absolute positions, run eagerly on the CPU (the GPU row compiles
    the same functions)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from attnbench.decode import decode_customs, decode_reference
    from attnbench.impls.flex import decode_functions

    c = dcase(variant=name, batch=3, seqlen_q=2, seqlen_kv=2048, dtype="float32", ragged=True)
    v = get_variant(name)
    inputs = make_decode_inputs(c, v, "cpu", seed=0)
    score_mod, mask_mod = decode_functions(c, v, decode_customs(inputs), inputs["cache_seqlens"])
    block_mask = create_block_mask(mask_mod, c.batch, c.heads_q, c.seqlen_q, c.seqlen_kv,
                                   device="cpu")
    q, k, val = (inputs[n].transpose(1, 2) for n in ("q", "k_cache", "v_cache"))
    out = flex_attention(q, k, val, score_mod=score_mod, block_mask=block_mask,
                         scale=c.head_dim ** -0.5, enable_gqa=True).transpose(1, 2)
    ref = decode_reference(c, v, inputs)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
