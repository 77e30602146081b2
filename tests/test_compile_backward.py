"""CI without a GPU: the generated backward kernels (preprocess + main) of the main variants
are generated and nvcc-compiled for sm_90a at their default config, plus CPU checks of the
block tables, the config model and the custom-gradient refusal."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.kernels.attention_bwd.launch import transposed_tables
from engine.kernels.attention_bwd.plan import (
    PREFERENCE,
    backward_config_problems,
    default_backward_config,
)
from engine.mask.analysis import EMPTY, FULL, PARTIAL, classify
from engine.plan.config import KernelConfig
from engine.runtime.tilelang_backend import backward_kernel_call
from engine.variants import VARIANTS
from tests import dsl_math_spec, table_spec

SHAPE = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_kv=1000)  # GQA 4
COMPILED = ["softmax_causal", "softmax", "alibi", "softcap", "sigmoid", "retnet", "document"]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _module(name: str, dtype=torch.bfloat16, D: int = 128, Dv: int = 128):
    return VARIANTS[name].build(**SHAPE, head_dim=D, head_dim_v=Dv, dtype=dtype, backend="tilelang")


@pytest.mark.compile
@needs_nvcc
@pytest.mark.parametrize("name", COMPILED)
def test_backward_compiles_for_sm90a(name, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = _module(name)
    bk = mod.backward_kernels()
    assert (bk.preprocess is not None) == mod.spec.uses_doosum
    bk.compile()
    cuda = bk.main.compiled().get_kernel_source()
    assert "wgmma" in cuda, "S^T, dP^T, dV and dK products must use Hopper wgmma"
    assert "tma_load" in cuda and "__global__" in cuda
    _check_do_stage_outlives_its_wgmmas(cuda)
    _check_warp_specialised_protocol(cuda)
    if bk.preprocess is not None:
        assert "__global__" in bk.preprocess.compiled().get_kernel_source()
    if bk.warp_specialized:
        assert "__global__" in bk.post.compiled().get_kernel_source()


@pytest.mark.compile
@needs_nvcc
def test_automatic_pipeline_backward_compiles(tmp_path, monkeypatch):
    """The fast backward's other schedule (TileLang's automatic pipeline, taken where the
    warp-specialised one does not apply) still compiles, with dQ by TMA reduce-add."""
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    cuda = compile_source(_source("softmax_causal", warp_specialized=False)).get_kernel_source()
    assert "tma_store_add" in cuda and "qdo_empty" not in cuda
    _check_do_stage_outlives_its_wgmmas(cuda)


def _check_do_stage_outlives_its_wgmmas(cuda: str) -> None:
    """In the split schedule dV += P^T dO is an asynchronous wgmma reading the pipelined dO
    stage: the consumer's release of that stage must come after a wait for every wgmma issued
    before it. (The fused schedule reads dO only in synchronous gemms.)"""
    if "dO_hold" not in cuda:
        return
    lines = cuda.splitlines()
    hold = next(i for i, ln in enumerate(lines) if "dO_hold[0] =" in ln)
    release = lines[hold + 1].strip()
    assert release.startswith("mbarrier[") and release.endswith(".arrive();"), release
    assert sum(ln.strip() == release for ln in lines) == 1, "the dO stage is released twice"
    last_issue = max(i for i in range(hold) if "tl::wgmma_" in lines[i])
    last_wait = max(i for i in range(hold) if "warpgroup_wait<0>" in lines[i])
    assert last_issue < last_wait < hold


def _check_warp_specialised_protocol(cuda: str) -> None:
    """The warp-specialised schedule's hand-placed synchronisation, as compiled: the Q/dO
    stage goes back to the producer only after a wait for every wgmma of the step; dQ leaves
    its registers only after a wait that leaves at most dK's wgmma (issued after dQ's) in
    flight; the dQ tile's generic stores are fenced for the TMA engine before the writer warp
    is signalled; the consumers meet at one named barrier per step, behind the fence that
    publishes dS^T to the tensor cores; and no other barrier is left in the kernel's loops
    but the staged dK/dV stores' two after the last step."""
    if "qdo_empty" not in cuda:
        return
    lines = [ln.strip() for ln in cuda.splitlines()]

    def waits(n: int) -> set[str]:  # TileLang spells the wgmma wait two ways
        return {f"tl::warpgroup_wait<{n}>();", f"tl::wait_wgmma<{n}>();"}

    release = [i for i, ln in enumerate(lines) if ln.startswith("qdo_empty[") and ln.endswith(".arrive();")]
    assert len(release) == 1, "the consumers release each Q/dO stage once"
    r = release[0]
    last_issue = max(i for i in range(r) if lines[i].startswith("tl::wgmma_"))
    last_wait = max(i for i in range(r) if lines[i] in waits(0))
    assert last_issue < last_wait < r
    handover = next(i for i, ln in enumerate(lines) if ln.startswith("dq_full[") and "arrive" in ln)
    assert lines[handover - 1] == "tl::fence_proxy_async();"
    dq_issue = next(i for i, ln in enumerate(lines) if "initialize_wgmma_descriptor" in ln
                    and "dsT_shared" in ln)
    dq_store = next(i for i in range(dq_issue, handover) if "dq_shared" in lines[i])
    wait = max(i for i in range(dq_issue, dq_store) if lines[i] in waits(0) | waits(1))
    batches = sum(ln == "tl::warpgroup_commit_batch();" for ln in lines[dq_issue:wait])
    assert lines[wait] in waits(0) or batches == 2, "only dK's wgmma may be in flight"
    syncs = [i for i, ln in enumerate(lines) if "__sync_thread_partial" in ln or "__syncthreads" in ln]
    steps = [i for i in syncs if i < r]
    assert len(steps) == 2, "barrier init, then one consumer barrier per step"
    assert lines[steps[1] - 1] == "tl::fence_proxy_async();"
    stores = [i for i, ln in enumerate(lines) if ln.startswith(("tl::tma_store(dK", "tl::tma_store(dV"))]
    after = [i for i in syncs if i > r]
    if not stores:
        assert not after, "no barrier after the steps without the staged dK/dV stores"
        return
    # Staged dK/dV: every consumer past its last step before K's and V's tiles are written,
    # then the writes fenced for the copy engine and every consumer's rows in before a store.
    assert len(after) == 2 and after[1] < min(stores)
    assert lines[after[1] - 1] == "tl::fence_proxy_async();"
    assert all("stmatrix" not in ln for ln in lines[r:after[0]])
    assert syncs[1] < last_issue, "dS^T is published before the dQ product reads it"


def test_backward_source_follows_the_spec():
    src = _module("softcap").backward_kernels().source
    assert "T.tanh" in src, "d score_mod / d score of a soft-cap reads tanh"
    assert "ClsT[0, 0, bx, qb]" in src and "if qcls == 2:" in src
    assert "by // 4" in src, "GQA: query head by reads kv head by // 4"
    sig = _module("sigmoid").backward_kernels()
    assert sig.preprocess is None and "Delta" not in sig.source
    assert "T.sigmoid" in sig.source


def test_transposed_tables_cover_the_causal_triangle_and_the_query_tail():
    bM, bN, S = 32, 128, 1000
    bc = classify(_module("softmax_causal").spec.mask, 2, 8, S, S, bM, bN)
    lo, hi, clsT, order = transposed_tables(bc, S, bM)
    nqb, nkb = -(-S // bM), -(-S // bN)
    assert order[0, 0].tolist() == list(range(nkb)), "causal: key order is longest first"
    assert clsT.shape == (1, 1, nkb, nqb)
    for kb in range(nkb):
        # Causal: query block qb sees kv block kb iff its last row reaches kb's first key.
        first = next(qb for qb in range(nqb) if (qb + 1) * bM - 1 >= kb * bN)
        assert (lo[0, 0, kb].item(), hi[0, 0, kb].item()) == (first, nqb)
        assert (clsT[0, 0, kb, :first] == EMPTY).all()
    assert (clsT[0, 0, :, -1] != FULL).all(), "the query tail block must evaluate the bounds"
    bc_full = classify(None, 1, 1, S, S, bM, bN)
    _, _, c2, _ = transposed_tables(bc_full, S, bM)
    assert c2[0, 0, 0, 0] == FULL and c2[0, 0, 0, -1] == PARTIAL


def test_launch_order_table_puts_each_documents_longest_blocks_first():
    """A document mask's longest key-block walks start its documents; OrdT (per batch: the
    ids differ) lists them first, ties in key order."""
    S, bM, bN = 1024, 64, 128
    spec = _module("document").spec
    ids = torch.zeros(2, S)
    ids[0, 300:] = 1
    ids[1, 700:] = 1
    bc = classify(spec.mask, 2, 8, S, S, bM, bN, {"doc_ids": ids})
    lo, hi, _, order = transposed_tables(bc, S, bM)
    assert order.shape == (2, 1, S // bN)
    for b in range(2):
        walk = (hi - lo)[b, 0]
        want = sorted(range(S // bN), key=lambda kb: (-int(walk[kb]), kb))
        assert order[b, 0].tolist() == want
    assert order[0, 0, 0] == 2 and order[1, 0, 0] == 0, "the blocks that start a document"


def test_backward_config_model():
    cfg = default_backward_config(128, 128)
    assert not backward_config_problems(cfg, 128, 128)
    # ptxas: 64 x 128 on 256 threads fits 240 registers without spills, 128 x 128 spills.
    assert not backward_config_problems(KernelConfig(64, 128, 2, 256), 128, 128)
    too_big = KernelConfig(128, 128, 2, 256)
    assert any("registers" in p for p in backward_config_problems(too_big, 128, 128))
    # 64 keys cannot be split over 8 warps along the keys only.
    assert backward_config_problems(KernelConfig(32, 64, 2, 256), 128, 128)
    # D = 256: no key split fits ((D + Dv) / 2 registers a thread for dK and dV); the
    # head split does (128 for dK and dV; 192 in all), and shared memory bounds its stages.
    head_split = KernelConfig(64, 64, 2, 256, "FullCol")
    assert default_backward_config(256, 256) == head_split
    assert not backward_config_problems(head_split, 256, 256)
    assert any("shared memory" in p for p in backward_config_problems(
        KernelConfig(64, 64, 3, 256, "FullCol"), 256, 256))
    assert any("registers" in p for p in backward_config_problems(head_split, 256, 512))
    assert all(backward_config_problems(c, 256, 256) for c in PREFERENCE[:-1])


LEARNABLE = {"alibi": "alibi_slopes", "sigmoid": "bias", "retnet": "log_decay"}


@pytest.mark.compile
@needs_nvcc
@pytest.mark.parametrize("name", sorted(LEARNABLE))
def test_backward_with_custom_gradients_compiles(name, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    cname = LEARNABLE[name]
    bk = _module(name).backward_kernels(custom_grads=(cname,))
    # Per-head parameter: rows reduced in registers over the query loop, one atomic per key row.
    assert f"dC_{cname}: T.Tensor((8,)" in bk.source
    assert "T.reduce_sum(cg_tile, cg_row, dim=1)" in bk.source
    assert f"T.atomic_add(dC_{cname}[by], cg_acc0[i])" in bk.source
    assert "AtomicAdd" in bk.main.compiled().get_kernel_source()


def _query_indexed_bias_module():
    from engine import AttentionEngine, CustomIO, meta_tensor

    io = CustomIO({"qbias": ("batch", "heads", "seq_len")})
    meta = (meta_tensor(2, 8, 1000, 128, dtype=torch.bfloat16),
            meta_tensor(2, 2, 1000, 128, dtype=torch.bfloat16),
            meta_tensor(2, 2, 1000, 128, dtype=torch.bfloat16))
    return AttentionEngine(meta, io, score_mod=lambda s, io_, b, h, qi, ki: s + io_["qbias"],
                           backend="tilelang")


def test_custom_gradients_the_kernel_cannot_produce_are_refused():
    mod = _module("alibi")
    with pytest.raises(ValueError, match="not CustomIO inputs"):
        inp = VARIANTS["alibi"].make_inputs(**SHAPE, head_dim=128, head_dim_v=128,
                                            dtype=torch.bfloat16)
        q = inp["q"]
        backward_kernel_call(mod.kernel_cache, mod.kernel_request(), q, inp["k"], inp["v"], q,
                             [torch.zeros(2, 8, 1000)], q, [inp["alibi_slopes"]],
                             custom_grads=("nope",))
    qmod = _query_indexed_bias_module()
    with pytest.raises(NotImplementedError, match="indexed by the query position"):
        qmod.backward_kernels(custom_grads=("qbias",))
    # Without its gradient the same spec generates.
    assert "dC_" not in qmod.backward_kernels().source


@pytest.mark.compile
@needs_nvcc
@pytest.mark.parametrize("name", ["softmax_causal", "alibi"])
def test_deterministic_backward_compiles_without_atomics(name, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    grads = tuple(VARIANTS[name].learnable)
    bk = _module(name).backward_kernels(custom_grads=grads, deterministic=True)
    assert bk.deterministic and bk.dq is not None
    for src in (bk.source, bk.dq.source):
        assert "atomic_add" not in src
    # dK/dV per query head (8), summed per group afterwards; custom gradients per key row.
    assert 'dK: T.Tensor((2, 1000, 8, 128), "float32")' in bk.source
    if grads:
        assert "dCrow0[bz, by, bx * 128 + i] = cg_acc0[i]" in bk.source
    bk.compile()
    assert "wgmma" in bk.dq.compiled().get_kernel_source()
    assert "AtomicAdd" not in bk.main.compiled().get_kernel_source() + bk.dq.compiled().get_kernel_source()


def test_fold_rows_matches_broadcast_sums():
    from engine.kernels.attention_bwd.launch import fold_rows

    rows = torch.randn(2, 8, 100, dtype=torch.float64)
    torch.testing.assert_close(fold_rows(rows, ("h",), (8,)), rows.sum((0, 2)))
    torch.testing.assert_close(fold_rows(rows, ("b", "h"), (2, 8)), rows.sum(2))
    torch.testing.assert_close(fold_rows(rows, ("kv", "b"), (100, 2)), rows.sum(1).T)
    torch.testing.assert_close(fold_rows(rows, (0,), (1,)), rows.sum().reshape(1))
    torch.testing.assert_close(fold_rows(rows, ("b", "h", "kv"), (2, 8, 100)), rows)


def test_schedule_follows_the_register_model():
    """Split schedule (dV asynchronous beside dS) where the model says it fits; soft-capping's
    dS reads the raw score beside two row vectors and gets the fused loop (split spilled 588
    bytes there). Both in the warp-specialised schedule and in the automatic pipeline (where
    split holds the dO stage until dK's wait)."""
    from engine.kernels.attention_bwd.plan import split_schedule_fits

    cfg = KernelConfig(block_M=64, block_N=128, num_stages=2, threads=256)
    assert split_schedule_fits(cfg, 128, 128, n_rows=2, ds_reads_score=False)
    assert split_schedule_fits(cfg, 128, 128, n_rows=0, ds_reads_score=True)
    assert not split_schedule_fits(cfg, 128, 128, n_rows=2, ds_reads_score=True)
    for ws in (True, False):
        split = _source("softmax", warp_specialized=ws)
        # (The warp-specialised schedule's third wait lets dK's wgmma run under dQ's store.)
        assert split.count("T.wait_wgmma(1)") == 2 + ws and "T.gemm(pT_cast" not in split
        assert ("dO_hold[0] = dO_shared[0, 0]" in split) == (not ws)
        fused = _source("softcap", warp_specialized=ws)
        assert "dO_hold" not in fused and "T.wait_wgmma(0)" in fused and "T.gemm(pT_cast" in fused


def test_custom_reads_by_one_position_are_hoisted():
    """A document mask reads a custom tensor per query and per key: both reads become register
    vectors (per key before the loop; per query each step, from the producer's ring in the
    warp-specialised schedule) instead of 2 x 64 x 128 / 256 global loads per step in the
    tile loops; the per-query vector counts in the register model (fused loop)."""
    for ws in (True, False):
        src = _source("document", warp_specialized=ws)
        tile_loops = [ln for ln in src.splitlines() if "pT[i, j] =" in ln or "dsT_cast[i, j] =" in ln]
        assert tile_loops and not any("C_doc_ids" in ln for ln in tile_loops)
        assert all("Cq" in ln and "Ck" in ln for ln in tile_loops if "T.if_then_else" in ln)
        assert "T.gemm(pT_cast" in src, "fused loop"
        reads = [ln.strip() for ln in src.splitlines() if "= C_doc_ids[" in ln]
        assert len(reads) == 2 and (any(ln.startswith("Cqs") for ln in reads) == ws)


def test_per_query_vectors_of_whole_blocks_come_by_tma():
    """The producer's per-query vectors (the finals, Delta, a document id and a prefix end): at
    lengths that whole query blocks tile, each is one TMA copy on its stage's barrier (its
    warp no longer waits for 64 loads a vector before arriving); with a tail, element by
    element, clamped."""
    from engine.kernels.attention_bwd.codegen import generate_backward
    from engine.kernels.attention_bwd.plan import plan_backward
    from engine.plan.shape import KernelShape

    def fills(seqlen: int) -> list[str]:
        mod = VARIANTS["document_prefix"].build(**{**SHAPE, "seqlen_q": seqlen,
                                                   "seqlen_kv": seqlen},
                                                head_dim=128, head_dim_v=128,
                                                dtype=torch.bfloat16, backend="reference")
        plan = plan_backward(mod.spec, KernelShape.of(mod), default_backward_config(128, 128))
        assert plan.warp_specialized and plan.q_reads_in_ring
        src = generate_backward(mod.spec, KernelShape.of(mod), plan).source
        sources[seqlen] = src
        return [ln.strip() for ln in src.splitlines()
                if ln.strip().startswith(("T.tma_copy(C_", "T.tma_copy(F_", "T.tma_copy(Delta",
                                          "Cqs", "Fs_", "Ds["))
                and "alloc" not in ln]
    sources: dict[int, str] = {}
    rows = "qb * 64:(qb + 1) * 64"
    assert fills(1024) == [
        f"T.tma_copy(F_lse[bz, by, {rows}], Fs_lse[k % 2, :], barrier=q_full[k % 2])",
        f"T.tma_copy(C_doc_ids[bz, {rows}], Cqs1[k % 2, :], barrier=q_full[k % 2])",
        f"T.tma_copy(C_prefix_end[bz, {rows}], Cqs2[k % 2, :], barrier=q_full[k % 2])",
        f"T.tma_copy(Delta[bz, by, {rows}], Ds[k % 2, :], barrier=do_full[k % 2])"]
    tail = fills(1000)
    clamp = "T.min(qb * 64 + t, 999)"
    assert tail == [f"Fs_lse[k % 2, t] = F_lse[bz, by, {clamp}]",
                    f"Cqs1[k % 2, t] = C_doc_ids[bz, {clamp}]",
                    f"Cqs2[k % 2, t] = C_prefix_end[bz, {clamp}]",
                    f"Ds[k % 2, t] = Delta[bz, by, {clamp}]"], tail
    from engine.runtime.compile import lowered_cuda

    # K, V, Q, dO and the four vectors: TileLang lowers each copy to a TMA load
    assert lowered_cuda(sources[1024]).count("tma_load") == 8


def _source(name: str, cfg: KernelConfig | None = None, custom_grads=(), deterministic=False,
            **forced) -> str:
    from engine.kernels.attention_bwd.codegen import generate_backward
    from engine.kernels.attention_bwd.plan import plan_backward
    from engine.plan.shape import KernelShape

    mod = _module(name)
    cfg = cfg or default_backward_config(128, 128)
    shape = KernelShape.of(mod)
    plan = plan_backward(mod.spec, shape, cfg, custom_grads, deterministic, **forced)
    return generate_backward(mod.spec, shape, plan).source


@pytest.mark.compile
@needs_nvcc
def test_warp_specialised_tuner_configs_compile(tmp_path, monkeypatch):
    """Other points of the tuner's space that take the warp-specialised schedule: one consumer
    warpgroup with 64 keys, rasterised in panels, one stage."""
    from engine.kernels.attention_bwd.plan import ws_schedule_fits
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    cfg = KernelConfig(64, 64, 1, 128, "FullRow", 8)
    assert not backward_config_problems(cfg, 128, 128) and ws_schedule_fits(cfg, 128, 128)
    cuda = compile_source(_source("alibi", cfg, custom_grads=("alibi_slopes",))).get_kernel_source()
    _check_warp_specialised_protocol(cuda)


def test_warp_specialised_schedule_model():
    """The fast backward takes the warp-specialised schedule at the default D = 128 tile
    (about 226 KiB of rings and barriers); not in the deterministic mode (no dQ), with
    32-query steps (dQ is no wgmma) or head dims that are not whole 64-column tiles; asked
    for where it does not apply, the generator refuses."""
    from engine.kernels.attention_bwd.plan import ws_schedule_fits

    cfg = default_backward_config(128, 128)
    assert ws_schedule_fits(cfg, 128, 128)
    assert not ws_schedule_fits(cfg, 128, 128, deterministic=True)
    assert not ws_schedule_fits(KernelConfig(32, 128, 2, 256), 128, 128)
    assert not ws_schedule_fits(cfg, 96, 96)
    assert not ws_schedule_fits(KernelConfig(64, 128, 3, 256), 128, 128), "3 stages: 256 KiB"
    # Each per-query vector takes 512 bytes of the two-stage ring: four fit beside the tiles.
    assert ws_schedule_fits(cfg, 128, 128, n_vectors=4)
    assert not ws_schedule_fits(cfg, 128, 128, n_vectors=5)
    # Head-split past D 128 (dQ from the dQ kernel, in either mode): K, V, the Q/dO ring and
    # P^T and dS^T two deep take 226 KiB at D 256; two more per-query vectors fit.
    split = default_backward_config(256, 256)
    assert ws_schedule_fits(split, 256, 256) and ws_schedule_fits(split, 256, 256, deterministic=True)
    assert ws_schedule_fits(split, 256, 256, n_vectors=4)
    assert not ws_schedule_fits(split, 256, 256, n_vectors=5)
    assert not ws_schedule_fits(KernelConfig(64, 64, 2, 256, "FullCol"), 128, 128), "dQ atomics"
    assert "warp-specialised" in _module("softmax").backward_kernels().source
    assert "warp-specialised" not in _module("softmax").backward_kernels(deterministic=True).source
    with pytest.raises(ValueError, match="warp_specialized"):
        _source("softmax", deterministic=True, warp_specialized=True)


def test_dq_fragment_order_round_trip():
    """The kernel's flat dQ order (dq_fragment_index, evaluated here on index grids: its text
    is Python too) is a permutation of each query block, and the postprocess kernel's reading
    of it (dq_fragment_position) is its inverse."""
    from engine.kernels.attention_bwd.codegen import dq_fragment_index, dq_fragment_position

    for bM, D in ((64, 128), (128, 64), (64, 256)):
        i, j = torch.meshgrid(torch.arange(bM), torch.arange(D), indexing="ij")
        f = eval(dq_fragment_index("i", "j", D), {"i": i, "j": j})
        assert torch.equal(f.flatten().sort().values, torch.arange(bM * D))
        p, q = torch.meshgrid(torch.arange(bM * D // 4), torch.arange(4), indexing="ij")
        i_text, j_text = dq_fragment_position("p", "q", D)
        i2, j2 = (eval(t, {"p": p, "q": q}) for t in (i_text, j_text))
        assert torch.equal(eval(dq_fragment_index("i", "j", D), {"i": i2, "j": j2}), p * 4 + q)


LLAMA3 = dict(batch=2, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_kv=4096)  # 512 blocks


def test_heads_loop_schedule():
    """With GQA and enough thread blocks (LLaMA-3 8B heads at 4k: 32 kv blocks x 8 kv heads
    x 2), one thread block per kv head walks the group's query heads: dK and dV are summed in
    registers and stored once in the input dtype (launched in panels of 4 kv heads,
    test_panel_launch_order). Not with too few blocks, without GQA, with
    custom gradients, or in the deterministic mode; asked for there, the generator refuses."""
    from engine.kernels.attention_bwd.plan import HEADS_LOOP_MIN_BLOCKS, heads_loop_default
    from engine.plan.shape import KernelShape

    def mod(name, **kw):
        sizes = {**LLAMA3, **kw}
        return VARIANTS[name].build(**sizes, head_dim=128, head_dim_v=128, dtype=torch.bfloat16,
                                    backend="tilelang")

    bk = mod("softmax_causal").backward_kernels()
    assert bk.heads_loop and bk.warp_specialized
    src = bk.source
    assert "with T.Kernel(512, threads=384) as bid:" in src and "by: T.int32 = grp % 8" in src
    assert "for g in T.serial(4):" in src and "hq: T.int32 = by * 4 + g" in src
    assert "Q[bz, qb * 64:(qb + 1) * 64, hq, :]" in src and "dQ[bz, hq, qb, :, :]" in src
    assert "K[bz, bx * 128:(bx + 1) * 128, by, :]" in src
    assert 'dK: T.Tensor((2, 4096, 8, 128), "bfloat16")' in src
    assert "T.atomic_add(dK" not in src and "T.atomic_add(dV" not in src
    # Too few blocks (8 x 2 x 2), MHA, custom gradients, deterministic: a block per query head.
    assert not _module("softmax_causal").backward_kernels().heads_loop
    assert not mod("softmax_causal", heads_kv=32).backward_kernels().heads_loop
    alibi = mod("alibi")
    assert not alibi.backward_kernels(custom_grads=("alibi_slopes",)).heads_loop
    assert alibi.backward_kernels().heads_loop
    assert not mod("softmax_causal").backward_kernels(deterministic=True).heads_loop
    shape = KernelShape.of(mod("softmax_causal", seqlen_q=1024, seqlen_kv=1024))
    cfg = default_backward_config(128, 128)
    assert 8 * 8 * 2 < HEADS_LOOP_MIN_BLOCKS and not heads_loop_default(shape, cfg, True)
    with pytest.raises(ValueError, match="heads_loop"):
        _source("softmax_causal", deterministic=True, warp_specialized=False, heads_loop=True)


@pytest.mark.compile
@needs_nvcc
@pytest.mark.parametrize("name", ["document", "alibi"])
def test_heads_loop_backward_compiles(name, tmp_path, monkeypatch):
    """The heads loop compiles with the schedule's protocol intact: document reloads its
    per-key vector per query head; ALiBi reads its slope of head hq and (forced here: not
    the default) flushes its slopes' gradient once per query head."""
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    grads = tuple(VARIANTS[name].learnable)
    src = _source(name, custom_grads=grads, heads_loop=True)
    body = src[src.index("for g in T.serial(4):", src.index("T.set_max_nreg(240")):]
    if name == "document":
        assert body.index("Ck") < body.index("for kk in T.serial(n):")
    else:
        assert "C_alibi_slopes[hq]" in body
        flush = body.index("T.atomic_add(dC_alibi_slopes[hq]")
        assert body.index("T.clear(cg_acc0)") < body.index("for kk in T.serial(n):") < flush
    _check_warp_specialised_protocol(compile_source(src).get_kernel_source())


@pytest.mark.compile
@needs_nvcc
def test_persistent_walk_compiles_with_k_and_v_handed_back(tmp_path, monkeypatch):
    """The persistent walk (forced here, under a causal mask: kv blocks of unequal steps):
    each role walks the thread block's kv blocks, counting its steps on across them; the
    producer loads a block's K and V only once the consumers have freed the last block's,
    which they do after their last step (whose wgmmas are waited for) and before the dK/dV
    stores; and the schedule's per-step protocol holds as compiled."""
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    src = _source("softmax_causal", persistent=True)
    assert "with T.Kernel(128, threads=384) as pid:" in src  # 8 kv blocks x 8 heads x 2
    assert src.count("for it in T.serial(T.ceildiv(128 - pid, 128)):") == 3
    assert src.count("base[0] = base[0] + n") == 3 and "k: T.int32 = base[0] + kk" in src
    producer = src[src.index("if tx < 32:"):src.index("elif tx < 64:")]
    assert producer.index("T.mbarrier_wait_parity(kv_empty[0]") < producer.index("T.tma_copy(K[")
    consumers = src[src.index("T.set_max_nreg(240"):]
    steps_end = consumers.index("T.mbarrier_arrive(qdo_empty")
    free = consumers.index("T.mbarrier_arrive(kv_empty[0])")
    assert steps_end < free < consumers.index("T.atomic_add(dV[bz, bx * 128 + i, by // 4, j]")
    assert "kv_empty" not in _source("softmax_causal")
    _check_warp_specialised_protocol(compile_source(src).get_kernel_source())


def test_panel_launch_order():
    """The warp-specialised backward's launch order (panel_order, evaluated here: its text is
    Python but for T.min) visits every (key block, head, batch) once, a panel's groups key
    block by key block; panels keep within one wave of an H100's 132 SMs (at most 132 blocks
    each: every block of a group runs at once)."""
    from types import SimpleNamespace

    from engine.kernels.attention_bwd.panels import panel_order
    from engine.kernels.attention_bwd.plan import panel_default, plan_backward
    from engine.plan.shape import KernelShape

    for nkb, heads, batch, panel in ((32, 8, 2, 4), (7, 3, 5, 18), (8, 8, 16, 16), (5, 2, 3, 4)):
        # A launch order per batch (as a document mask's): key blocks reversed in batch 0.
        ords = [list(range(nkb))[::-1] if b == 0 else list(range(nkb)) for b in range(batch)]
        seen, env = [], {"T": SimpleNamespace(min=min), "Ord": ords}
        for bid in range(nkb * heads * batch):
            env["bid"] = bid
            for name, text in panel_order("bid", nkb, heads, batch, panel, "Ord[bz][{pos}]"):
                env[name] = eval(text, env)
            seen.append((env["pn"], env["bx"], env["bz"], env["by"]))
        assert sorted((bx, bz, by) for _, bx, bz, by in seen) == [
            (bx, bz, by) for bx in range(nkb) for bz in range(batch) for by in range(heads)]
        first = {}
        for pn, _bx, bz, by in seen:
            first.setdefault((bz, by), pn)
            assert first[(bz, by)] == pn, "a group stays in its panel"
        for b in range(batch):  # within a panel, a group's blocks in its launch order
            first_panel = [bx for pn, bx, bz, by in seen if pn == first[(b, 0)] and bz == b and by == 0]
            assert first_panel == ords[b]
    cfg = default_backward_config(128, 128)
    for S, want in ((1024, 16), (4096, 4), (16384, 1)):
        mod = VARIANTS["softmax_causal"].build(**{**LLAMA3, "seqlen_q": S, "seqlen_kv": S},
                                                head_dim=128, head_dim_v=128,
                                                dtype=torch.bfloat16, backend="tilelang")
        shape = KernelShape.of(mod)
        assert panel_default(shape, cfg, True) == want and panel_default(shape, cfg, False) == 1
        assert want * -(-S // 128) <= 132
        # a mask that reads data (its blocks walk a document's queries): two waves
        assert panel_default(shape, cfg, True, short_walks=True) == max(1, 264 // -(-S // 128))
    docs = VARIANTS["document_prefix"].build(**{**LLAMA3, "seqlen_q": 8192, "seqlen_kv": 8192},
                                             head_dim=128, head_dim_v=128,
                                             dtype=torch.bfloat16, backend="reference")
    plan = plan_backward(docs.spec, KernelShape.of(docs), cfg)
    assert plan.warp_specialized and plan.panel == 4
    src = _module("softmax_causal", D=128).backward_kernels().source
    assert "as bid:" in src and "bx: T.int32 = OrdT[0, 0, (bid - pn * " in src


@pytest.mark.compile
@needs_nvcc
def test_dsl_math_compiles_forward_and_backward(tmp_path, monkeypatch):
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = dsl_math_spec.module(torch.float16, 2, 8, 2, 1000, 64)
    fwd = compile_source(mod.kernel_source).get_kernel_source()
    for fn in ("sinf", "cosf", "tanf", "sqrtf", "rsqrtf", "log1pf", "expm1f", "erff",
               "nearbyintf", "floorf", "ceilf"):
        assert fn in fwd, f"{fn} missing from the forward kernel"
    bk = mod.backward_kernels()
    bk.compile()
    assert "__global__" in bk.main.compiled().get_kernel_source()


@pytest.mark.compile
@needs_nvcc
@pytest.mark.parametrize("per_element", [False, True], ids=["diagonals", "per-element"])
def test_table_lookups_compile_forward_and_backward(per_element, tmp_path, monkeypatch):
    """Learnable tables read at index expressions: the forward reads them clamped, the
    backward sums their gradients along dS^T's diagonals (16-byte shared loads, shuffles) or
    adds them element by element with fp32 atomics; each nvcc-compiles for sm_90a."""
    from engine.kernels.attention_bwd import plan
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    if per_element:
        monkeypatch.setattr(plan, "diagonal_tables", lambda ex, cfg, det: ())
    mod = table_spec.module(torch.bfloat16, 2, 8, 2, 1000, 64)
    assert "C_rel[by, T.max(T.min(" in mod.kernel_source
    if not per_element:
        compile_source(mod.kernel_source)
    assert mod.backward_problem(("rel", "t5")) is None
    bk = mod.backward_kernels(custom_grads=("rel", "t5"))
    bk.compile()
    cuda = bk.main.compiled().get_kernel_source()
    assert "AtomicAdd((&(dC_rel[" in cuda
    if per_element:
        assert "T.atomic_add(dC_rel[by, T.max(T.min(" in bk.main.source
    else:
        assert "*(uint4*)(dg_v + 0)" in cuda and "__shfl_xor_sync" in cuda
