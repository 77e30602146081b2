"""CI without a GPU: every variant's forward kernel is generated and nvcc-compiled for sm_90a
at its default config (TileLang lowers and compiles with no GPU present)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from engine.plan.config import ConfigError, KernelConfig
from engine.variants import VARIANTS

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed"),
]

SHAPE = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_kv=1000)


def _module(name: str, dtype=torch.bfloat16, D: int = 128, Dv: int = 128, config=None, **shape):
    return VARIANTS[name].build(
        **{**SHAPE, **shape}, head_dim=D, head_dim_v=Dv, dtype=dtype, backend="tilelang",
        config=config,
    )


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_forward_compiles_for_sm90a(name, tmp_path, monkeypatch):
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    src = _module(name).kernel_source
    kernel = compile_source(src)
    cuda = kernel.get_kernel_source()
    assert "wgmma" in cuda, "the QK^T / PV products must use Hopper wgmma"
    assert "tma_load" in cuda, "Q/K/V tiles must be loaded by TMA"
    assert "__global__" in cuda


def test_generated_source_is_deterministic_and_inspectable():
    a = _module("alibi")
    b = _module("alibi")
    assert a.kernel_source == b.kernel_source
    assert "T.wgmma_gemm" in a.kernel_source and a.spec_hash in a.kernel_source
    c = _module("alibi", config=KernelConfig(128, 64, 2, 256))
    assert c.kernel_source != a.kernel_source and "M128_N64" in c.kernel_source


def test_invalid_config_is_refused_before_compiling():
    mod = _module("softmax", D=256, Dv=256, config=KernelConfig(256, 256, 4, 256))
    with pytest.raises(ConfigError, match="shared memory"):
        mod.forward_kernel()


@pytest.mark.parametrize(
    "dtype,D,Dv",
    [
        (torch.float16, 64, 64),
        (torch.bfloat16, 256, 256),
        (torch.bfloat16, 192, 128),
        (torch.float16, 128, 256),
    ],
)
def test_head_dims_compile(dtype, D, Dv, tmp_path, monkeypatch):
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    compile_source(_module("softmax_causal", dtype, D, Dv).kernel_source)


def test_tilelang_backend_without_a_hopper_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    mod = _module("softmax")
    inp = VARIANTS["softmax"].make_inputs(**SHAPE, head_dim=128, head_dim_v=128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="backend='tilelang' cannot run here: tensors are on cpu"):
        mod(**inp)


def _dynamic(name: str, batch: int, seqlen: int):
    mod = VARIANTS[name].build(batch=batch, heads_q=8, heads_kv=2, seqlen_q=seqlen,
                               seqlen_kv=seqlen, head_dim=128, head_dim_v=128,
                               dtype=torch.bfloat16, backend="tilelang")
    mod.dynamic_shapes = True
    return mod


@pytest.mark.parametrize("name", ["softmax_causal", "document"])
def test_dynamic_shapes_give_one_kernel_for_every_length(name, tmp_path, monkeypatch):
    """With dynamic shapes the source names B, Sq, Skv (and the block tables' NQB, NKB)
    instead of constants, so every batch and length shares one compile; it still lowers to
    wgmma with TMA loads."""
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    sources = {_dynamic(name, b, s).kernel_source
               for b, s in ((2, 1000), (1, 4096), (3, 77))}
    assert len(sources) == 1
    (src,) = sources
    assert 'T.dynamic("B, Sq, Skv, NQB, NKB")' in src and "1000" not in src
    assert "T.Kernel(T.ceildiv(Sq, " in src
    statics = {_module(name).kernel_source,
               VARIANTS[name].build(batch=1, heads_q=8, heads_kv=2, seqlen_q=4096,
                                                seqlen_kv=4096, head_dim=128, head_dim_v=128,
                                                dtype=torch.bfloat16,
                                                backend="tilelang").kernel_source}
    assert len(statics) == 2 and src not in statics
    cuda = compile_source(src).get_kernel_source()
    assert "wgmma" in cuda and "tma_load" in cuda


def _spill_store_bytes(cuda: str, tmp_path, serialised: list | None = None) -> int:
    """ptxas's spill stores for a TileLang kernel's CUDA source (compiled as TileLang does);
    its wgmma serialisation warnings (C751x) appended to `serialised`, if given."""
    from engine.runtime.ptxas import compile_cubin

    report = compile_cubin(cuda, tmp_path)
    if serialised is not None:
        serialised += report.serialised
    return report.spill_bytes


@pytest.mark.parametrize("name, heads_kv, D, Dv", [("softmax_causal", 2, 256, 256),
                                                   ("gemma2", 8, 256, 256),
                                                   ("alibi", 2, 256, 256),
                                                   ("softmax_causal", 8, 192, 128)])
def test_d256_backward_is_head_split_and_does_not_spill(name, heads_kv, D, Dv, tmp_path,
                                                        monkeypatch):
    """D = 256's (and DeepSeek's D 192 / Dv 128) backward: the head-split schedule (dK/dV
    split by head dim over two consumer warpgroups, P^T and dS^T through shared memory),
    warp-specialised (a producer warp's
    Q/dO ring, P^T and dS^T two deep, no dQ writer), and dQ from the dQ kernel (no dQ in the
    main kernel), both compiled for sm_90a without spills (ptxas: 168 registers for plain
    softmax's main kernel), ALiBi's slope gradient included (its per-key sums add the two
    warpgroups' halves through shared memory)."""
    from engine.runtime.compile import lowered_cuda

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = _module(name, D=D, Dv=Dv, heads_kv=heads_kv)
    assert mod.backward_problem() is None
    bk = mod.backward_kernels(custom_grads=tuple(VARIANTS[name].learnable))
    assert bk.plan.head_split and bk.plan.warp_specialized
    src = bk.main.source
    assert "pT_shared = T.alloc_shared((2, 64, 64)" in src and "GemmWarpPolicy.FullCol" in src
    assert "T.set_max_nreg(240, 1)" in src and "dq_full" not in src
    assert "kn: T.int32 = T.min(k + 1, " in src, "the next step's products issued ahead"
    assert "dQ" not in src and "dQ" in bk.dq.source
    for kernel_src in (src, bk.dq.source):
        assert _spill_store_bytes(lowered_cuda(kernel_src), tmp_path) == 0


def test_d64_backward_takes_128_row_steps_without_spills(tmp_path, monkeypatch):
    """D 64's backward steps 128 query rows (the fused step) and reads the finals and Delta
    from the ring where used: ptxas finds no spills (copied into registers, 32 values a thread
    each, they spilled 244 bytes and the backward ran 1.58x as long: results/NOTES.md 172)."""
    from engine.runtime.compile import lowered_cuda

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = _module("softmax_causal", D=64, Dv=64, seqlen_q=2048, seqlen_kv=2048)
    bk = mod.backward_kernels()
    assert (bk.config.block_M, bk.plan.rows_in_ring, bk.plan.split) == (128, True, False)
    src = bk.main.source
    assert "Fr_lse" not in src and "Fs_lse[k % 2, j]" in src and "Ds[k % 2, j]" in src
    assert _spill_store_bytes(lowered_cuda(src), tmp_path) == 0


def test_masked_tile_choice_follows_ptxas(tmp_path, monkeypatch):
    """The register model's calibration point: sliding window's partial blocks spill at 192 x
    128 on 384 threads (the tile it skips) and not at the tile it picks; at the variants suite's
    length, where the window (1024) is shorter than the sequence. (Over 256 bytes while P was
    masked twice, 148 since it is masked once: results/NOTES.md 108.)"""
    from engine.runtime.compile import lowered_cuda

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    picked = _module("sliding_window", seqlen_q=4096, seqlen_kv=4096)
    assert picked.forward_kernel().config.block_M == 128
    skipped = _module("sliding_window", config=KernelConfig(192, 128, 2, 384), seqlen_q=4096,
                      seqlen_kv=4096)
    spills = {
        which: _spill_store_bytes(lowered_cuda(m.kernel_source), tmp_path)
        for which, m in (("picked", picked), ("skipped", skipped))
    }
    assert spills["picked"] == 0 and spills["skipped"] > 64, spills


def test_key_indexed_reads_are_staged_per_key_block(tmp_path, monkeypatch):
    """A document id per key is copied into shared memory once per key block (beside K) and
    read from there by the partial blocks' mask; in the automatic pipeline not where the key
    blocks leave a tail, nor with three consumer warpgroups (see generate_forward); the
    warp-specialised producer fills its ring with a tail too."""
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = _module("document", seqlen_q=4096, seqlen_kv=4096,
                  config=KernelConfig(128, 128, 2, 256, "FullRow", 8))
    src = mod.kernel_source
    assert "cks0 = T.alloc_shared((128,)" in src
    assert "T.copy(C_doc_ids[bz, kb * 128:(kb + 1) * 128], cks0)" in src
    assert "(cq0[i] == cks0[j])" in src and "C_doc_ids[bz, T.min((kb" not in src
    assert "tma_load" in compile_source(src).get_kernel_source()
    for off in (_module("document", config=KernelConfig(128, 128, 2, 256, "FullRow", 8)),  # tail
                _module("document", seqlen_q=4096, seqlen_kv=4096,
                        config=KernelConfig(192, 128, 2, 384))):
        assert "cks0" not in off.kernel_source and "C_doc_ids[bz, T.min((kb" in off.kernel_source
    ws = _module("document").kernel_source  # the default: the persistent walk
    assert "cks0 = T.alloc_shared((2, 128,)" in ws and "C_doc_ids[bz, T.min((kb" not in ws


DECODE_SHAPE = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=2, seqlen_kv=1024)


@pytest.mark.parametrize("name", sorted(n for n, v in VARIANTS.items()
                                        if not v.needs_equal_seqlens))
def test_variant_decode_compiles_for_sm90a(name, tmp_path, monkeypatch):
    """The split kernel (wgmma, TMA loads of the cache) and the merge kernel of each variant."""
    from engine.kernels.attention_decode.plan import DecodeConfig
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = _module(name, **DECODE_SHAPE)
    mod.decode_config = DecodeConfig(128, 2, 4)  # four splits: a merge kernel too
    split, merge = mod.decode_kernels().sources()
    cuda = compile_source(split).get_kernel_source()
    assert "wgmma" in cuda and "tma_load" in cuda
    compile_source(merge)


@pytest.mark.parametrize("page", [64, 16])
def test_paged_decode_compiles(page, tmp_path, monkeypatch):
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = _module("softmax_causal", **DECODE_SHAPE)
    for src in mod.decode_kernels(page, 2 * 1024 // page).sources():
        compile_source(src)


# ---------------------------------------------------------------- linear attention
def _linear_sources(b: int, hq: int, hk: int, h: int, t: int, d: int, dv: int, config=None,
                    packed: int = 0, flags: tuple[tuple[bool, bool], ...] = ((False, False),),
                    folds=None, save: bool = False) -> list[str]:
    """The forward and backward sources of a linear call (engine.runtime.linear_backend) with
    each (initial state, final state) of `flags`; `packed` sequences through cu_seqlens; mods
    folded into the kernels (a Folds); the forward keeping its states (`save`)."""
    from engine.kernels.linear_fwd.plan import NO_FOLDS, default_linear_config
    from engine.runtime import linear_backend

    meta = [torch.empty(b, n, t, dim, dtype=torch.bfloat16, device="meta")
            for n, dim in ((hq, d), (hk, d), (h, dv))]
    cu = torch.empty(packed + 1, dtype=torch.int32, device="meta") if packed else None
    cfg = config or default_linear_config(d, dv)
    cache = linear_backend.LinearKernelCache()
    return [s for initial, final in flags for s in linear_backend.kernel_sources(
        cache, *meta, config=cfg, modes=("fwd", "bwd"), initial_state=initial,
        final_state=final, cu_seqlens=cu, folds=folds or NO_FOLDS, save_states=save)]


def _step_sources() -> list[str]:
    """The recurrent step, with and without an initial state, at D 128 and at D 256 / Dv 512
    (four threads per state column), with Mamba2's shared q and k head; and with a folded q
    scale and value weights."""
    from engine.kernels.linear_fwd.plan import NO_FOLDS, Folds
    from engine.runtime import linear_backend

    out = []
    for hq, d, dv, folds in ((4, 128, 128, NO_FOLDS), (1, 256, 512, NO_FOLDS),
                             (1, 128, 64, Folds(q_scale=0.125, v_weight=True))):
        meta = [torch.empty(2, n, 1, dim, dtype=torch.bfloat16, device="meta")
                for n, dim in ((hq, d), (hq, d), (4, dv))]
        shape = linear_backend.linear_shape(*meta, None)
        step = linear_backend.LinearKernelCache().step(shape, folds=folds)
        out += step.sources(True) + step.sources(False)
    return out


def test_linear_kernels_compile_for_sm90a(tmp_path, monkeypatch):
    """The chunked forward (state pass with and without initial and final states, output
    kernel) and backward (reverse state pass with and without dht / dh0, dV, dQ/dK) at the
    default config; a packed batch; one q and k head shared by four (Mamba2's); D 256 with
    Dv 512 (RetNet); 128-position chunks on 256 threads; the single-pass forward; a folded q
    scale and value weights, single pass and two kernels; the single pass keeping its states
    for the backward; the recurrent step. Distinct sources compile once, in parallel."""
    from engine.kernels.linear_fwd.plan import Folds, LinearConfig
    from engine.runtime.precompile import precompile

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    every = ((False, False), (True, True))
    sources = [
        *_linear_sources(2, 2, 2, 2, 200, 64, 64, flags=every),
        *_linear_sources(1, 2, 2, 2, 300, 64, 64, packed=3),
        *_linear_sources(2, 1, 1, 4, 200, 128, 64),
        *_linear_sources(1, 2, 2, 2, 200, 256, 512),
        *_linear_sources(2, 2, 2, 2, 200, 64, 64,
                         config=LinearConfig(chunk=128, block_K=64, block_V=64, threads=256)),
        *_linear_sources(2, 2, 2, 2, 200, 128, 128, flags=every,
                         config=LinearConfig(block_K=128, single_pass=True, threads=256)),
        *_linear_sources(2, 2, 2, 2, 200, 128, 128, folds=Folds(0.125, True),
                         config=LinearConfig(block_K=128, single_pass=True, threads=256)),
        *_linear_sources(2, 2, 2, 2, 200, 128, 128, flags=every, save=True,
                         config=LinearConfig(block_K=128, single_pass=True, threads=256)),
        *_linear_sources(2, 1, 1, 4, 200, 128, 64, folds=Folds(v_weight=True)),
        *_step_sources(),
    ]
    errors = precompile(sources)
    assert not errors, "\n".join(e[:500] for e in errors.values())


def test_chunk_loop_kernels_ask_for_two_blocks_per_sm_without_spills(tmp_path, monkeypatch):
    """linear_fwd.plan.CHUNK_LOOP_BLOCKS_PER_SM at 2 (the default; at 1 the sources as before):
    the state pass, the single pass and the reverse single pass ask for two blocks in their
    launch bounds, which ptxas meets without spills (80 registers against 168; results/NOTES.md
    200), with their consumers' registers after the reallocation within the block's own pool
    (NOTES 202, 205), where two blocks' shared memory fits the SM (here one pipeline stage); with two
    stages the single pass (129 KB a block at D 128) stays at one."""
    import dataclasses

    import torch

    from engine.kernels.linear_fwd import plan
    from engine.kernels.linear_fwd.plan import LinearConfig
    from engine.runtime import linear_backend
    from engine.runtime.compile import lowered_cuda
    from engine.runtime.ptxas import compile_cubin

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    meta = [torch.empty(2, h, 300, d, dtype=torch.bfloat16, device="meta")
            for h, d in ((4, 128), (4, 128), (4, 64))]
    cfg = LinearConfig(block_K=128, num_stages=1, threads=256, single_pass=True)

    def sources() -> list[str]:
        return linear_backend.kernel_sources(linear_backend.LinearKernelCache(), *meta,
                                             config=cfg, modes=("fwd", "bwd"))
    monkeypatch.setattr(plan, "CHUNK_LOOP_BLOCKS_PER_SM", 1)
    before = sources()
    assert not any("annotate_min_blocks_per_sm" in src for src in before)
    monkeypatch.setattr(plan, "CHUNK_LOOP_BLOCKS_PER_SM", 2)
    shape = linear_backend.linear_shape(*meta, None)
    assert plan.blocks_per_sm("single", shape, dataclasses.replace(cfg, num_stages=2)) == 1
    changed = [src for src in sources() if src not in before]
    kinds = [src.split("\n", 1)[0].split(": ", 1)[1].split(" B2")[0] for src in changed]
    assert kinds == ["single pass", "state pass", "reverse single pass"], kinds
    added = ("        T.annotate_min_blocks_per_sm(2)\n"
             "        T.annotate_producer_reg_dealloc(24)\n"
             "        T.annotate_consumer_reg_alloc(104)\n")
    for src in changed:
        assert src.replace(added, "") in before
        cuda = lowered_cuda(src)
        assert "__launch_bounds__(384, 2)" in cuda
        report = compile_cubin(cuda, tmp_path)
        assert report.spill_bytes == 0
        # setmaxnreg.inc waits for registers from the block's own pool: after TileLang's
        # reallocation its warpgroups must fit what it launched with, 384 x 80 (at the default
        # 240 they hung, and at 112, which fits the SM but not the block: NOTES 202, 205)
        assert report.registers == 80  # the launch bounds' share, the block's pool
        (producer,) = map(int, re.findall(r"warpgroup_reg_dealloc<(\d+)>", cuda))
        (consumer,) = map(int, re.findall(r"warpgroup_reg_alloc<(\d+)>", cuda))
        assert 128 * producer + 256 * consumer <= 384 * report.registers


def test_dv_kernel_scores_in_registers_keep_two_blocks_per_sm(tmp_path, monkeypatch):
    """linear_fwd.plan.DV_SCORES_IN_FRAGMENT (off by default): the dV kernel alone changes,
    its At masked in registers and copied whole, its blocks held to two an SM; lowered
    without spills in at most 128 registers on 256 threads (at 141 uncapped, one an SM)."""
    from engine.kernels.linear_fwd import plan
    from engine.kernels.linear_fwd.plan import Folds, LinearConfig
    from engine.runtime import linear_backend
    from engine.runtime.compile import lowered_cuda
    from engine.runtime.ptxas import compile_cubin

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    meta = [torch.empty(1, h, 300, d, dtype=torch.bfloat16, device="meta")
            for h, d in ((1, 128), (1, 128), (4, 64))]

    def sources() -> list[str]:
        return linear_backend.kernel_sources(
            linear_backend.LinearKernelCache(), *meta,
            config=LinearConfig(chunk=128, block_K=128, threads=256), modes=("fwd", "bwd"),
            folds=Folds(v_weight=True))
    before = sources()
    monkeypatch.setattr(plan, "DV_SCORES_IN_FRAGMENT", True)
    new = [src for src in sources() if src not in before]
    assert len(new) == 1 and ": dv " in new[0].split("\n", 1)[0]
    assert "T.annotate_min_blocks_per_sm(2)" in new[0] and "T.copy(At, At_s)" in new[0]
    report = compile_cubin(lowered_cuda(new[0]), tmp_path)
    assert report.spill_bytes == 0 and report.registers <= 128


@pytest.mark.parametrize("name,config", [
    ("softmax_causal", KernelConfig(128, 176, 2, 256, schedule="pingpong")),
    ("document", KernelConfig(128, 128, 2, 256, schedule="overlap")),  # the mask once
])
def test_warp_specialised_forward_compiles(name, config, tmp_path, monkeypatch):
    """The schedules the default does not take here (ping-pong, a data-dependent mask) lower
    and compile too: explicit setmaxnreg, TMA rings, the scores waited for apart from P V."""
    from engine.runtime.compile import compile_source

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    cuda = compile_source(_module(name, config=config).kernel_source).get_kernel_source()
    assert "warpgroup_reg_alloc<240>" in cuda and "tma_load" in cuda
    assert "wait_wgmma<1>" in cuda and "wait_wgmma<0>" in cuda


_OVERLAP_WALK = KernelConfig(128, 128, 2, 256, schedule="overlap", persistent=True)


_LLAMA3_4K = dict(batch=2, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_kv=4096)


@pytest.mark.parametrize("name,config,shape", [
    ("softmax_causal", KernelConfig(128, 128, 2, 256, schedule="pingpong", persistent=True),
     dict(batch=8)),
    ("softmax", _OVERLAP_WALK, dict(batch=8)),
    ("key_gate", _OVERLAP_WALK, dict(batch=8)),  # a per-head read: written per step, C7511
    ("prefix_lm", _OVERLAP_WALK, _LLAMA3_4K),  # an `|` mask: short-circuited, C7511
])
def test_persistent_forward_compiles_without_spills(name, config, shape, tmp_path, monkeypatch):
    """The persistent walk: one thread block per SM (the grid is the SM count, not the
    tiles), Q handed back through its own barrier, O staged apart from Q; no spills (with
    the ring stage counted on from tile to tile instead of padded, ptxas spilled 120 bytes
    here) and no wgmma serialised (the key gate and prefix-LM were, before their per-head
    reads went to the tile's start and `|` stopped short-circuiting)."""
    from engine.runtime.compile import lowered_cuda

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    src = _module(name, config=config, **shape).kernel_source
    assert "with T.Kernel(132, threads=384) as pid:" in src
    assert "q_empty" in src and "O_shared" in src
    assert ("Walk[" in src) == (name != "softmax")  # the host deals unequal rows
    cuda = lowered_cuda(src)
    serialised: list[str] = []
    assert _spill_store_bytes(cuda, tmp_path, serialised) == 0 and not serialised, serialised


@pytest.mark.parametrize("name", ["softmax", "softmax_causal"])
def test_short_keys_take_one_fitted_block_without_spills(name, tmp_path, monkeypatch):
    """ViT's 197 keys: one 208-key block by default (not two of 128), and no loop over later
    key blocks; with that loop compiled in, ptxas spilled 124 bytes."""
    from engine.runtime.compile import lowered_cuda

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = _module(name, D=64, Dv=64, batch=64, heads_q=6, heads_kv=6, seqlen_q=197,
                  seqlen_kv=197)
    assert mod.forward_kernel().config.block_N == 208
    src = mod.kernel_source
    assert "for kk in" not in src
    cuda = lowered_cuda(src)
    serialised: list[str] = []
    assert _spill_store_bytes(cuda, tmp_path, serialised) == 0 and not serialised, serialised


@pytest.mark.parametrize("name, rows", [("retnet", 32), ("key_gate", 64), ("sigmoid", 64),
                                        ("alibi", 64)])
def test_custom_gradient_backward_keeps_its_registers(name, rows, tmp_path, monkeypatch):
    """A custom gradient that alone reads the raw score in the kernel (RetNet's log decay)
    takes 32-row steps: at 64 rows it spilled 2552 bytes (ptxas, D 128) and ran 4.6x slower
    on the H100 (the key gate's spilled 596 before it came from q . dQ instead). Sigmoid's dS
    reads the score anyway and ALiBi's gradient does not: they keep 64 rows, where they ran
    faster than at 32."""
    from engine.runtime.compile import lowered_cuda

    monkeypatch.setenv("ATTNBENCH_KERNEL_DIR", str(tmp_path))
    mod = _module(name, seqlen_q=4096, seqlen_kv=4096)
    bk = mod.backward_kernels(custom_grads=tuple(VARIANTS[name].learnable))
    assert bk.config.block_M == rows
    assert mod.backward_kernels().config.block_M == 64  # without it, the usual tile
    if rows == 32:
        serialised: list[str] = []
        cuda = lowered_cuda(bk.main.source)
        assert _spill_store_bytes(cuda, tmp_path, serialised) == 0 and not serialised, serialised
