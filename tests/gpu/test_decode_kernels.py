"""Decode kernels (issue 23) against the decode reference (engine.reference.decode) on the H100:
every decode-capable variant of the library x fp16/bf16 x GQA 1/4/8 x Sq 1/2/4 x contiguous /
paged (pages of 64 keys: one TMA copy per block; of 16, gathered, for causal softmax), head
dims 64/256 and D != Dv, one split (no merge), a user's merge in AttentionEngine's `combine`
form, splits with no key at all, and a decode step replayed in a CUDA graph. The grid is
about 600 kernel sets: on the device, run it in parts (-k "bf16 and contig", ...).

Lengths are ragged: the shortest valid (Sq: a split-up cache where most splits are empty), a
length that is no multiple of any block, and the full capacity."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention_decode.plan import DecodeConfig
from engine.reference.decode import decode_forward, to_pages
from engine.reference.executor import rel_err
from engine.variants import VARIANTS
from tests.gpu.cases import BF16, FP16, precompile_reported

pytestmark = pytest.mark.gpu

CAP = 1024


def _lens(B: int, Sq: int) -> list[int]:
    return [Sq, 517, CAP][:B] if B <= 3 else [Sq, 517, CAP] + [CAP // 2] * (B - 3)


def decode_case_id(c: tuple) -> str:
    name, dt, Hq, Hkv, Sq, D, Dv, page = c
    return (f"{name}-{'bf16' if dt is BF16 else 'fp16'}-H{Hq}x{Hkv}-Sq{Sq}-D{D}x{Dv}"
            f"-{'paged' + str(page) if page else 'contig'}")


# rel_bias sizes its table by the prefill's Sq + Skv - 1: decode positions run past it.
DECODABLE = [n for n, v in VARIANTS.items() if not v.needs_equal_seqlens and n != "rel_bias"]
# The whole product: every decode-capable variant x dtype x GQA 1/4/8 x Sq 1/2/4 x contiguous
# and paged (pages of 64 keys: one TMA copy per block); pages of 16 (gathered) for causal
# softmax.
GRID = [(n, dt, 8, hkv, sq, 128, 128, page) for n in DECODABLE for dt in (BF16, FP16)
        for hkv in (8, 2, 1) for sq in (1, 2, 4) for page in (0, 64)]
GATHERED = [("softmax_causal", dt, 8, hkv, sq, 128, 128, 16) for dt in (BF16, FP16)
            for hkv in (8, 2, 1) for sq in (1, 2, 4)]
HEAD_DIMS = [(n, BF16, 16, 2, 1, d, dv, 0) for n in ("softmax_causal", "softcap")
             for d, dv in ((64, 64), (256, 256), (192, 128))]
CASES = GRID + GATHERED + HEAD_DIMS


def _module(case: tuple, **kw):
    name, dt, Hq, Hkv, Sq, D, Dv, _ = case
    return VARIANTS[name].build(batch=3, heads_q=Hq, heads_kv=Hkv, seqlen_q=Sq, seqlen_kv=CAP,
                                head_dim=D, head_dim_v=Dv, dtype=dt, backend="tilelang", **kw)


def decode_inputs(case: tuple, mod, seed: int) -> tuple[list, dict]:
    """(q, k_cache, v_cache, *customs) and the keyword arguments of a decode call."""
    name, dt, Hq, Hkv, Sq, D, Dv, page = case
    inp = VARIANTS[name].make_inputs(batch=3, heads_q=Hq, heads_kv=Hkv, seqlen_q=Sq,
                                     seqlen_kv=CAP, head_dim=D, head_dim_v=Dv, dtype=dt,
                                     device="cuda", seed=seed)
    q, k, v = inp["q"], inp["k"], inp["v"]
    kw = {"cache_seqlens": torch.tensor(_lens(3, Sq), dtype=torch.int32, device="cuda")}
    if page:
        gen = torch.Generator().manual_seed(seed)
        table = torch.randperm(3 * CAP // page, generator=gen).cuda().view(3, CAP // page).int()
        k, v = to_pages(k, table), to_pages(v, table)
        kw["block_table"] = table
    return [q, k, v, *(inp[n] for n in mod.custom_io.names())], kw


@pytest.fixture(scope="module", autouse=True)
def precompiled(request):
    from engine.runtime.device import sm_count
    from tests.gpu.cases import selected_params

    sms = sm_count(torch.device("cuda"))
    srcs = []
    for case in (c for c in CASES if c in selected_params(request, "case")):
        page = case[-1]
        n_pages = 3 * CAP // page if page else 0
        srcs += _module(case).decode_kernels(page, n_pages, sms).sources()
    precompile_reported(request, srcs)


def _check(mod, args, kw):
    with torch.no_grad():
        out = mod(*args, **kw)
    names = mod.custom_io.names()
    ref = decode_forward(mod.spec, *args[:3], dict(zip(names, args[3:], strict=True)),
                         kw["cache_seqlens"], kw.get("block_table"))
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2, f"rel err {rel_err(out, ref):.3e}"


@pytest.mark.parametrize("case", CASES, ids=decode_case_id)
def test_decode_matches_the_reference(case):
    mod = _module(case)
    _check(mod, *decode_inputs(case, mod, seed=int(torch.randint(0, 2**31 - 1, ()))))


@pytest.mark.parametrize("splits", [1, 8])
def test_one_split_and_empty_splits(splits):
    """num_splits 1: the kernel normalises and writes O itself; 8 splits of a cache whose
    first sequence holds one key: seven of its splits see nothing."""
    case = ("softmax_causal", BF16, 8, 2, 1, 128, 128, 0)
    mod = _module(case)
    mod.decode_config = DecodeConfig(128, 2, splits)
    _check(mod, *decode_inputs(case, mod, seed=5))


def test_masked_middle_splits_and_a_user_combine():
    """A mask without key bounds (its `|`) whose middle splits hold no visible key, under a
    user normaliser that merges in AttentionEngine's form: combine(final_rowscales)."""
    from engine import AttentionEngine, meta_tensor
    from engine.dsl.online import OnlineSoftmax

    class FinalMergeSoftmax(OnlineSoftmax):
        combine_online = None

        @staticmethod
        def combine(final_rowscales):
            lse = final_rowscales["lse"]
            top = lse.get_reduce("max")
            total = (lse - top).exp().get_reduce("sum").log() + top
            return (lse - total).exp()

    meta = (meta_tensor(3, 8, 2, 128, dtype=BF16), meta_tensor(3, 2, CAP, 128, dtype=BF16),
            meta_tensor(3, 2, CAP, 128, dtype=BF16))
    mod = AttentionEngine(meta, score_mod=lambda s, b, h, q, kv: s * 128 ** -0.5,
                          mask_mod=lambda b, h, q, kv: (kv < 64) | ((kv >= q - 64) & (kv <= q)),
                          online_func=FinalMergeSoftmax(), backend="tilelang",
                          decode_config=DecodeConfig(64, 2, 8))
    assert mod.merge is not None and mod.merge.form == "final"
    _check(mod, *decode_inputs(("softmax", BF16, 8, 2, 2, 128, 128, 0), mod, seed=7))


def test_decode_step_replays_in_a_cuda_graph():
    case = ("alibi", BF16, 8, 2, 1, 128, 128, 64)
    mod = _module(case)
    args, kw = decode_inputs(case, mod, seed=1)
    static = [t.clone() for t in args]
    lens = kw["cache_seqlens"].clone()
    table = kw["block_table"]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                mod(*static, cache_seqlens=lens, block_table=table)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mod(*static, cache_seqlens=lens, block_table=table)
        for seed, new_lens in ((2, [1, 999, 64]), (3, [CAP, 2, 700])):
            fresh, _ = decode_inputs(case, mod, seed)
            for t, f in zip(static, fresh, strict=True):
                t.copy_(f)
            lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
            graph.replay()
            want = mod(*fresh, cache_seqlens=lens.clone(), block_table=table)
            assert rel_err(out, want) < 1e-3, f"replay with lengths {new_lens}"
