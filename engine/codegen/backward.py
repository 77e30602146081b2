"""The backward kernel templates: TileLang source generated from a TracedSpec.

Three kernels, mirroring the reference executor's `backward()`:

- preprocess (only when the spec's `bwd` reads `doosum`): Delta[b, h, q] = sum_d dO * O (fp32).
- main: one thread block per (kv block of block_N keys, query head, batch). K and V tiles
  stay in shared memory; the block walks the query blocks [LoT, HiT) that the mask analysis
  found non-empty for its kv block. Everything is computed in the transposed frame (rows =
  keys i, columns = queries j) so that P^T and dS^T are register fragments that feed the
  dV += P^T dO and dK += dS^T Q wgmmas directly:
      S^T = K Q^T (recomputed), P^T = fwd_recompute(score_mod(S^T), finals)
      dP^T = V dO^T, dS'^T = bwd(dP^T, P^T, finals, doosum), dS^T = dS'^T * d score_mod/d score
      dQ += dS K (fp32 atomics, one partial product per kv block)
  Only partial blocks (mask analysis, plus the key and query tails) evaluate the mask; there
  masked entries give P = 0 and dS = 0.
- postprocess: dQ, dK, dV are accumulated in fp32 and cast to the input dtype by the caller
  (engine.runtime.backward_kernels). dK / dV are accumulated with fp32 atomics into the kv
  head, so GQA needs no extra reduction (G = 1 has no contention; the atomics act as stores).
"""

from __future__ import annotations

from engine.codegen.emit import Emitter
from engine.dsl.expr import Expr, leaf, leaves, topo
from engine.ir.diff import diff, score_mod_derivatives
from engine.ir.rewrite import substitute
from engine.ir.spec import TracedSpec
from engine.plan.config import (
    GEMM_POLICIES,
    SMEM_LIMIT_BYTES,
    ConfigError,
    KernelConfig,
    consumer_register_cap,
    warp_partition,
)
from engine.plan.shape import KernelShape

_TL_DTYPE = {"float16": "float16", "bfloat16": "bfloat16"}
# Rows of the preprocess kernel per thread block.
PREP_ROWS = 32

# Preference order for the main kernel. block_N = keys per thread block (rows of every
# fragment), block_M = queries per inner step. The kernel holds dK and dV [block_N x D]
# accumulators for the whole loop, so block_M stays small: at D = 128 and 256 threads,
# 128 x 32 needs about 208 fp32 registers per thread, 128 x 64 about 288 (over the cap).
PREFERENCE: tuple[KernelConfig, ...] = (
    KernelConfig(block_M=64, block_N=128, num_stages=2, threads=256),
    KernelConfig(block_M=32, block_N=128, num_stages=2, threads=256),
    KernelConfig(block_M=32, block_N=64, num_stages=2, threads=128),
    KernelConfig(block_M=16, block_N=64, num_stages=1, threads=128),
)


def backward_resources(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, n_rows: int = 2
) -> dict[str, int]:
    """Shared memory (bytes) and fp32-equivalent accumulator registers per consumer thread of
    the main backward kernel; `n_rows` counts the per-query fp32 vectors (finals, Delta)."""
    bM, bN, st = cfg.block_M, cfg.block_N, cfg.num_stages
    smem = (
        elem_bytes
        * (
            bN * (head_dim + head_dim_v)  # K, V (loaded once)
            + st * bM * (head_dim + head_dim_v)  # Q, dO ring buffers
            + bN * bM  # dS^T staged for the dQ gemm
        )
        + 4 * bM * n_rows
    )
    per = lambda n: -(-n // cfg.threads)  # noqa: E731 - ceil division
    regs = (
        per(bN * (head_dim + head_dim_v))  # dK, dV accumulators
        + 3 * per(bN * bM)  # S^T, dP^T, P^T (fp32)
        + per(bN * bM)  # P^T and dS^T in 16 bits (two halves per register)
        + per(bM * head_dim)  # dQ partial product
    )
    return {"smem_bytes": smem, "regs_per_thread": regs}


def backward_config_problems(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, n_rows: int = 2
) -> list[str]:
    """Every reason `cfg` is invalid for the main backward kernel (empty list: valid)."""
    out: list[str] = []
    if cfg.threads not in (128, 256, 384):
        out.append(f"threads={cfg.threads}: expected 128, 256 or 384 (whole warpgroups)")
        return out
    if cfg.gemm_policy not in GEMM_POLICIES:
        out.append(f"gemm_policy={cfg.gemm_policy!r}: expected one of {GEMM_POLICIES}")
        return out
    if cfg.block_M % 16 or not 16 <= cfg.block_M <= 128:
        out.append(f"block_M={cfg.block_M}: expected a multiple of 16 in 16..128")
    if not 1 <= cfg.num_stages <= 4:
        out.append(f"num_stages={cfg.num_stages}: expected 1..4")
    if head_dim % 16 or head_dim_v % 16:
        out.append(f"head dims {head_dim}/{head_dim_v}: expected multiples of 16")
    warps = cfg.threads // 32
    # P^T and dS^T stay in registers as the A operand of the dV / dK gemms: every warp must own
    # whole rows (keys) of S^T, dV and dK, i.e. the warps split block_N only.
    for what, n in (
        ("S^T = K Q^T", cfg.block_M),
        ("dV += P^T dO", head_dim_v),
        ("dK += dS^T Q", head_dim),
    ):
        split = warp_partition(cfg.block_N, n, warps, cfg.gemm_policy, True)
        if split is None or split[1] != 1:
            out.append(
                f"{what} [{cfg.block_N}x{n}]: {warps} warps must all split the {cfg.block_N} "
                f"keys (block_N a multiple of {16 * warps} with wgmma warpgroups of 64 rows)"
            )
            break
    if warp_partition(cfg.block_M, head_dim, warps, "Square", False) is None:
        out.append(f"dQ = dS K [{cfg.block_M}x{head_dim}]: no warp partition for {warps} warps")
    res = backward_resources(cfg, head_dim, head_dim_v, elem_bytes, n_rows)
    if res["smem_bytes"] > SMEM_LIMIT_BYTES:
        out.append(f"shared memory {res['smem_bytes'] // 1024} KiB > {SMEM_LIMIT_BYTES // 1024} KiB")
    cap = consumer_register_cap(cfg.threads)
    if res["regs_per_thread"] > cap:
        out.append(
            f"accumulators need about {res['regs_per_thread']} registers per thread > {cap} "
            f"(dK/dV [{cfg.block_N}x{head_dim}/{head_dim_v}], tiles [{cfg.block_N}x{cfg.block_M}])"
        )
    return out


def check_backward_config(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, n_rows: int = 2
) -> KernelConfig:
    problems = backward_config_problems(cfg, head_dim, head_dim_v, elem_bytes, n_rows)
    if problems:
        raise ConfigError(f"invalid backward KernelConfig {cfg.key()}: " + "; ".join(problems))
    return cfg


def default_backward_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> KernelConfig:
    for cfg in PREFERENCE:
        if not backward_config_problems(cfg, head_dim, head_dim_v, elem_bytes):
            return cfg
    raise ConfigError(
        f"no valid backward kernel config for head dims D={head_dim}, Dv={head_dim_v} "
        "(dK and dV accumulators must fit in registers)"
    )


def _writer_lines(lines: list[str], indent: int, text: str) -> None:
    for ln in text.splitlines():
        lines.append("    " * indent + ln)


def generate_preprocess(shape: KernelShape) -> str:
    """TileLang source of `main`: Delta[b, h, q] = sum_d dO[b, q, h, d] * O[b, q, h, d]."""
    dt = _TL_DTYPE[shape.dtype]
    B, Sq, H, Dv, R = shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim_v, PREP_ROWS
    row = f"T.min(bx * {R} + i, {Sq - 1})"
    lines: list[str] = [
        "# Generated by engine.codegen.backward: preprocess (Delta = rowsum(dO * O))",
        "import tilelang.language as T\n\n",
        "@T.prim_func",
        "def main(",
        f'    O: T.Tensor(({B}, {Sq}, {H}, {Dv}), "{dt}"),',
        f'    dO: T.Tensor(({B}, {Sq}, {H}, {Dv}), "{dt}"),',
        f'    Delta: T.Tensor(({B}, {H}, {Sq}), "float32"),',
        "):",
    ]
    body = f"""with T.Kernel({-(-Sq // R)}, {H}, {B}, threads=128) as (bx, by, bz):
    acc = T.alloc_fragment(({R}, {Dv}), "float32")
    delta = T.alloc_fragment(({R},), "float32")
    for i, j in T.Parallel({R}, {Dv}):
        acc[i, j] = T.Cast("float32", O[bz, {row}, by, j]) * T.Cast("float32", dO[bz, {row}, by, j])
    T.reduce_sum(acc, delta, dim=1)
    for i in T.Parallel({R}):
        if bx * {R} + i < {Sq}:
            Delta[bz, by, bx * {R} + i] = delta[i]"""
    _writer_lines(lines, 1, body)
    return "\n".join(lines) + "\n"


def _check_spec(spec: TracedSpec) -> None:
    for name, root in (("fwd_recompute", spec.fwd_recompute), ("bwd", spec.bwd)):
        if any(n.op == "reduce" for n in topo([root])):
            raise NotImplementedError(
                f"backward kernel: {name} uses a row reduction; only elementwise rules are supported"
            )
        bad = {n.op for n in leaves([root])} - {
            "const",
            "score",
            "final",
            "dp",
            "p",
            "doosum",
            "idx",
            "custom",
        }
        if bad:
            raise NotImplementedError(f"backward kernel: {name} reads {sorted(bad)}")


def custom_grad_problem(spec: TracedSpec, name: str) -> str | None:
    """Why the kernel cannot produce the gradient of CustomIO tensor `name` (None: it can).
    The kernel sums a custom gradient over the query positions of its kv block in registers,
    so a read indexed by the query position is left to the reference rules."""
    if name in spec.online_custom_reads():
        return f"custom input {name!r} is read in the online functions"
    reads = [leaf_ for leaf_, _ in score_mod_derivatives(spec)[1].values() if leaf_.attr[0] == name]
    if not reads:
        return f"custom input {name!r} is not read in score_mod (its gradient is zero)"
    for leaf_ in reads:
        syms = [s for s in leaf_.attr[2] if isinstance(s, str)]
        if "q" in syms:
            return f"custom input {name!r} is indexed by the query position"
        if len(syms) != len(set(syms)):
            return f"custom input {name!r} is read with a repeated index"
    return None


class _TileExprs:
    """The spec's backward tile expressions over the raw score (leaf `rawscore`): P, dS' (the
    user's `bwd`), d score_mod / d score, and per wanted custom read (name, index, d/d read)."""

    def __init__(self, spec: TracedSpec, custom_grads: tuple[str, ...]):
        _check_spec(spec)
        for name in custom_grads:
            why = custom_grad_problem(spec, name)
            if why is not None:
                raise NotImplementedError(f"backward kernel: {why}")
        score = leaf("score", ("m", "n"))
        raw = leaf("rawscore", ("m", "n"))
        smod = substitute(spec.score_mod, {score.key: raw})
        self.p = substitute(spec.fwd_recompute, {score.key: smod})
        self.ds_mod = substitute(spec.bwd, {score.key: smod})
        self.dsm_ds = substitute(diff(spec.score_mod, score), {score.key: raw})
        self.dc_reads = [
            (read.attr[0], read.attr[2], substitute(d, {score.key: raw}))
            for read, d in score_mod_derivatives(spec)[1].values()
            if read.attr[0] in custom_grads
        ]

    def ds_text(self, em: Emitter) -> str:
        text = em.float_(self.ds_mod)
        if not (self.dsm_ds.op == "const" and float(self.dsm_ds.attr) == 1.0):
            text = f"({text} * {em.float_(self.dsm_ds)})"
        return text


def _binder(shape: KernelShape, q_idx: str, kv_idx: str, tiles: dict[str, str]):
    """Emitter binding for one frame: `q_idx`/`kv_idx` the index texts of the fragment element
    [i, j], `tiles` the fragments holding rawscore, dp and p."""
    Sq, Skv = shape.seqlen_q, shape.seqlen_kv
    index_text = {"b": "bz", "h": "by", "q": q_idx, "kv": kv_idx}
    clamp = {"q": f"T.min({q_idx}, {Sq - 1})", "kv": f"T.min({kv_idx}, {Skv - 1})"}

    def bind(node: Expr) -> str | None:
        if node.op in tiles:
            return f"{tiles[node.op]}[i, j]"
        if node.op == "idx":
            return index_text[node.attr]
        if node.op == "custom":
            name, _, index = node.attr
            parts = [clamp.get(s, index_text.get(s, "0")) if isinstance(s, str) else "0" for s in index]
            return f"C_{name}[{', '.join(parts)}]"
        # Per-query vectors are read from global memory in the elementwise loop (L1-cached):
        # staging them in shared memory made TileLang's warp specialisation give the copy to a
        # 256-thread cp.async producer, capping every thread at 128 registers (spills).
        if node.op == "final":
            return f"F_{node.attr}[bz, by, {clamp['q']}]"
        if node.op == "doosum":
            return f"Delta[bz, by, {clamp['q']}]"
        return None

    return bind, index_text


def _mask_text(spec: TracedSpec, bind, q_idx: str, kv_idx: str, shape: KernelShape) -> str:
    conds = [f"({kv_idx} < {shape.seqlen_kv})", f"({q_idx} < {shape.seqlen_q})"]
    if spec.mask is not None:
        conds.insert(0, Emitter(bind).text(spec.mask))
    text = conds[0]
    for c in conds[1:]:
        text = f"T.And({text}, {c})"
    return text


def _input_args(spec: TracedSpec, shape: KernelShape, dt: str) -> list[str]:
    B, Sq, Skv = shape.batch, shape.seqlen_q, shape.seqlen_kv
    args = [
        f'Q: T.Tensor(({B}, {Sq}, {shape.heads_q}, {shape.head_dim}), "{dt}")',
        f'K: T.Tensor(({B}, {Skv}, {shape.heads_kv}, {shape.head_dim}), "{dt}")',
        f'V: T.Tensor(({B}, {Skv}, {shape.heads_kv}, {shape.head_dim_v}), "{dt}")',
        f'dO: T.Tensor(({B}, {Sq}, {shape.heads_q}, {shape.head_dim_v}), "{dt}")',
    ]
    sizes = {"batch": B, "heads": shape.heads_q, "seq_len": Sq, "seq_len_kv": Skv}
    for name, dims in spec.customs:
        dshape = ", ".join(str(sizes[d]) if isinstance(d, str) else "1" for d in dims)
        args.append(f'C_{name}: T.Tensor(({dshape},), "float32")')
    return args


def _row_args(spec: TracedSpec, shape: KernelShape) -> list[str]:
    rows = f"({shape.batch}, {shape.heads_q}, {shape.seqlen_q})"
    args = [f'F_{name}: T.Tensor({rows}, "float32")' for name in spec.final_names]
    if spec.uses_doosum:
        args.append(f'Delta: T.Tensor({rows}, "float32")')
    return args


def _header(lines: list[str], title: str, args: list[str]) -> None:
    _writer_lines(lines, 0, f"# Generated by engine.codegen.backward: {title}")
    _writer_lines(lines, 0, "import tilelang.language as T\n\n")
    _writer_lines(lines, 0, "@T.prim_func")
    _writer_lines(lines, 0, "def main(")
    for a in args:
        _writer_lines(lines, 1, a + ",")
    _writer_lines(lines, 0, "):")


def generate_backward(
    spec: TracedSpec,
    shape: KernelShape,
    cfg: KernelConfig,
    custom_grads: tuple[str, ...] = (),
    deterministic: bool = False,
) -> str:
    """TileLang source defining `main`, the main backward prim_func of `spec` at `shape`.

    `custom_grads`: CustomIO tensors whose gradients the kernel also produces, per thread block
    the sum over its queries of dS' * d score_mod / d custom, kept per key row in registers.

    Fast (default): dQ, dK, dV and the custom gradients are accumulated with fp32 atomics
    (dQ += dS K per kv block; dK, dV over the query heads of a GQA group).
    Deterministic: no atomics and no dQ. dK and dV are stored per query head
    ([B, Skv, Hq, D], summed over the group afterwards) and custom gradients per (b, h, key)
    row; dQ comes from generate_backward_dq. Each output element has one writer, so runs are
    bitwise identical."""
    ex = _TileExprs(spec, custom_grads)
    bM, bN, D, Dv = cfg.block_M, cfg.block_N, shape.head_dim, shape.head_dim_v
    Sq, Skv = shape.seqlen_q, shape.seqlen_kv
    G = shape.heads_q // shape.heads_kv
    nqb, nkb = -(-Sq // bM), -(-Skv // bN)
    dt = _TL_DTYPE[shape.dtype]
    policy = f"T.GemmWarpPolicy.{cfg.gemm_policy}"
    mb = "bz" if shape.mask_batch > 1 else "0"
    mh = "by" if shape.mask_heads > 1 else "0"

    # Transposed frame: i runs over keys (fragment rows), j over queries (fragment columns).
    q_idx, kv_idx = f"(qb * {bM} + j)", f"(bx * {bN} + i)"
    bind, index_text = _binder(shape, q_idx, kv_idx, {"rawscore": "sT", "dp": "dpT", "p": "pT"})
    mask_text = _mask_text(spec, bind, q_idx, kv_idx, shape)

    def tile_body(mask: str | None) -> str:
        em = Emitter(bind)
        p_text = em.float_(ex.p)
        ds_text = ex.ds_text(em)
        if mask is not None:
            p_text = f"T.if_then_else({mask}, {p_text}, T.float32(0.0))"
            ds_text = f"T.if_then_else({mask}, {ds_text}, T.float32(0.0))"
        return (
            f"for i, j in T.Parallel({bN}, {bM}):\n"
            f"    pT[i, j] = {p_text}\n"
            f"    pT_cast[i, j] = pT[i, j]\n"
            f"    dsT_cast[i, j] = {ds_text}"
        )

    # ------------------------------------------------------------- signature
    args = _input_args(spec, shape, dt)
    args += [
        f'LoT: T.Tensor(({shape.mask_batch}, {shape.mask_heads}, {nkb}), "int32")',
        f'HiT: T.Tensor(({shape.mask_batch}, {shape.mask_heads}, {nkb}), "int32")',
        f'ClsT: T.Tensor(({shape.mask_batch}, {shape.mask_heads}, {nkb}, {nqb}), "int8")',
    ]
    args += _row_args(spec, shape)
    kv_heads = shape.heads_q if deterministic else shape.heads_kv
    if not deterministic:
        args.append(f'dQ: T.Tensor(({shape.batch}, {Sq}, {shape.heads_q}, {D}), "float32")')
    args += [
        f'dK: T.Tensor(({shape.batch}, {Skv}, {kv_heads}, {D}), "float32")',
        f'dV: T.Tensor(({shape.batch}, {Skv}, {kv_heads}, {Dv}), "float32")',
    ]
    if deterministic:
        for r in range(len(ex.dc_reads)):
            args.append(f'dCrow{r}: T.Tensor(({shape.batch}, {shape.heads_q}, {Skv}), "float32")')
    else:
        sizes = {"batch": shape.batch, "heads": shape.heads_q, "seq_len": Sq, "seq_len_kv": Skv}
        decls = dict(spec.customs)
        for name in custom_grads:
            dshape = ", ".join(str(sizes[d]) if isinstance(d, str) else "1" for d in decls[name])
            args.append(f'dC_{name}: T.Tensor(({dshape},), "float32")')

    lines: list[str] = []
    w = lambda ind, text: _writer_lines(lines, ind, text)  # noqa: E731
    mode = "deterministic" if deterministic else "atomic"
    _header(lines, f"spec {spec.hash}, config {cfg.key()}, {mode}", args)
    w(1, f"with T.Kernel({nkb}, {shape.heads_q}, {shape.batch}, threads={cfg.threads}) as (bx, by, bz):")
    b = 2
    w(b, f'K_shared = T.alloc_shared(({bN}, {D}), "{dt}")')
    w(b, f'V_shared = T.alloc_shared(({bN}, {Dv}), "{dt}")')
    w(b, f'Q_shared = T.alloc_shared(({bM}, {D}), "{dt}")')
    w(b, f'dO_shared = T.alloc_shared(({bM}, {Dv}), "{dt}")')
    if not deterministic:
        w(b, f'dsT_shared = T.alloc_shared(({bN}, {bM}), "{dt}")')
    w(b, f'sT = T.alloc_fragment(({bN}, {bM}), "float32")')
    w(b, f'dpT = T.alloc_fragment(({bN}, {bM}), "float32")')
    w(b, f'pT = T.alloc_fragment(({bN}, {bM}), "float32")')
    w(b, f'pT_cast = T.alloc_fragment(({bN}, {bM}), "{dt}")')
    w(b, f'dsT_cast = T.alloc_fragment(({bN}, {bM}), "{dt}")')
    w(b, f'dv = T.alloc_fragment(({bN}, {Dv}), "float32")')
    w(b, f'dk = T.alloc_fragment(({bN}, {D}), "float32")')
    if not deterministic:
        w(b, f'dq = T.alloc_fragment(({bM}, {D}), "float32")')
    if ex.dc_reads:
        w(b, f'cg_tile = T.alloc_fragment(({bN}, {bM}), "float32")')
        w(b, f'cg_row = T.alloc_fragment(({bN},), "float32")')
    for r in range(len(ex.dc_reads)):
        w(b, f'cg_acc{r} = T.alloc_fragment(({bN},), "float32")')
        w(b, f"T.clear(cg_acc{r})")
    if cfg.swizzle_panel:
        w(b, f"T.use_swizzle({cfg.swizzle_panel})")
    w(b, f"T.copy(K[bz, bx * {bN}:(bx + 1) * {bN}, by // {G}, :], K_shared)")
    w(b, f"T.copy(V[bz, bx * {bN}:(bx + 1) * {bN}, by // {G}, :], V_shared)")
    w(b, "T.clear(dk)")
    w(b, "T.clear(dv)")
    lo, hi = f"LoT[{mb}, {mh}, bx]", f"HiT[{mb}, {mh}, bx]"
    w(b, f"for k in T.Pipelined({hi} - {lo}, num_stages={cfg.num_stages}):")
    lb = b + 1
    w(lb, f"qb: T.int32 = {lo} + k")
    w(lb, f"T.copy(Q[bz, qb * {bM}:(qb + 1) * {bM}, by, :], Q_shared)")
    w(lb, "T.clear(sT)")
    w(lb, f"T.gemm(K_shared, Q_shared, sT, transpose_B=True, policy={policy})")
    w(lb, f"T.copy(dO[bz, qb * {bM}:(qb + 1) * {bM}, by, :], dO_shared)")
    w(lb, "T.clear(dpT)")
    w(lb, f"T.gemm(V_shared, dO_shared, dpT, transpose_B=True, policy={policy})")
    w(lb, f"if ClsT[{mb}, {mh}, bx, qb] == 2:")
    w(lb + 1, tile_body(None))
    w(lb, "else:")
    w(lb + 1, tile_body(mask_text))
    for r, (_, _, d_read) in enumerate(ex.dc_reads):
        em = Emitter(bind)
        g_text = f"({em.float_(ex.ds_mod)} * {em.float_(d_read)})"
        w(lb, f"for i, j in T.Parallel({bN}, {bM}):")
        w(lb + 1, f"cg_tile[i, j] = T.if_then_else({mask_text}, {g_text}, T.float32(0.0))")
        w(lb, "T.reduce_sum(cg_tile, cg_row, dim=1)")
        w(lb, f"for i in T.Parallel({bN}):")
        w(lb + 1, f"cg_acc{r}[i] += cg_row[i]")
    w(lb, f"T.gemm(pT_cast, dO_shared, dv, policy={policy})")
    w(lb, f"T.gemm(dsT_cast, Q_shared, dk, policy={policy})")
    if not deterministic:
        w(lb, "T.copy(dsT_cast, dsT_shared)")
        w(lb, "T.clear(dq)")
        w(lb, "T.gemm(dsT_shared, K_shared, dq, transpose_A=True)")
        w(lb, f"for i, j in T.Parallel({bM}, {D}):")
        w(lb + 1, f"if qb * {bM} + i < {Sq}:")
        w(lb + 2, f"T.atomic_add(dQ[bz, qb * {bM} + i, by, j], dq[i, j])")
    for r, (name, index, _) in enumerate(ex.dc_reads):
        w(b, f"for i in T.Parallel({bN}):")
        w(b + 1, f"if bx * {bN} + i < {Skv}:")
        if deterministic:
            w(b + 2, f"dCrow{r}[bz, by, bx * {bN} + i] = cg_acc{r}[i]")
        else:
            parts = [index_text.get(x, "0") if isinstance(x, str) else "0" for x in index]
            w(b + 2, f"T.atomic_add(dC_{name}[{', '.join(parts)}], cg_acc{r}[i])")
    for buf, out, width in (("dv", "dV", Dv), ("dk", "dK", D)):
        w(b, f"for i, j in T.Parallel({bN}, {width}):")
        w(b + 1, f"if bx * {bN} + i < {Skv}:")
        if deterministic:
            w(b + 2, f"{out}[bz, bx * {bN} + i, by, j] = {buf}[i, j]")
        else:
            w(b + 2, f"T.atomic_add({out}[bz, bx * {bN} + i, by // {G}, j], {buf}[i, j])")
    return "\n".join(lines) + "\n"


# The dQ kernel of the deterministic backward (forward frame: rows = queries). It holds S, dP
# and P [block_M x block_N] in fp32 plus the dQ accumulator [block_M x D].
DQ_PREFERENCE: tuple[KernelConfig, ...] = (
    KernelConfig(block_M=128, block_N=64, num_stages=2, threads=256),
    KernelConfig(block_M=64, block_N=64, num_stages=2, threads=256),
    KernelConfig(block_M=64, block_N=32, num_stages=1, threads=128),
)


def dq_config_problems(cfg: KernelConfig, head_dim: int, head_dim_v: int,
                       elem_bytes: int = 2) -> list[str]:
    """Every reason `cfg` is invalid for the deterministic dQ kernel (empty list: valid)."""
    out: list[str] = []
    warps = cfg.threads // 32
    # dS is the register A operand of dQ += dS K: the warps split the query rows only.
    for what, n in (("S = Q K^T", cfg.block_N), ("dQ += dS K", head_dim)):
        split = warp_partition(cfg.block_M, n, warps, "FullRow", True)
        if split is None or split[1] != 1:
            out.append(f"{what} [{cfg.block_M}x{n}]: {warps} warps must split the query rows")
            break
    smem = elem_bytes * (cfg.block_M * (head_dim + head_dim_v)
                         + cfg.num_stages * cfg.block_N * (head_dim + head_dim_v))
    if smem > SMEM_LIMIT_BYTES:
        out.append(f"shared memory {smem // 1024} KiB > {SMEM_LIMIT_BYTES // 1024} KiB")
    per = lambda n: -(-n // cfg.threads)  # noqa: E731 - ceil division
    regs = 3 * per(cfg.block_M * cfg.block_N) + per(cfg.block_M * cfg.block_N) // 2
    regs += per(cfg.block_M * head_dim)
    if regs > consumer_register_cap(cfg.threads):
        out.append(f"accumulators need about {regs} registers per thread")
    return out


def default_dq_config(head_dim: int, head_dim_v: int) -> KernelConfig:
    for cfg in DQ_PREFERENCE:
        if not dq_config_problems(cfg, head_dim, head_dim_v):
            return cfg
    raise ConfigError(f"no valid dQ kernel config for head dims D={head_dim}, Dv={head_dim_v}")


def generate_backward_dq(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig) -> str:
    """TileLang source of `main`, the deterministic backward's dQ kernel: one thread block per
    query block walks its non-empty key blocks (the forward's tables at this config's block
    sizes), recomputes S, P, dP and dS, and accumulates dQ = dS K in registers; one store."""
    ex = _TileExprs(spec, ())
    bM, bN, D, Dv = cfg.block_M, cfg.block_N, shape.head_dim, shape.head_dim_v
    Sq, Skv = shape.seqlen_q, shape.seqlen_kv
    G = shape.heads_q // shape.heads_kv
    nqb, nkb = -(-Sq // bM), -(-Skv // bN)
    dt = _TL_DTYPE[shape.dtype]
    mb = "bz" if shape.mask_batch > 1 else "0"
    mh = "by" if shape.mask_heads > 1 else "0"
    q_idx, kv_idx = f"(bx * {bM} + i)", f"(kb * {bN} + j)"
    bind, _ = _binder(shape, q_idx, kv_idx, {"rawscore": "s", "dp": "dp", "p": "p"})
    mask_text = _mask_text(spec, bind, q_idx, kv_idx, shape)

    def tile_body(mask: str | None) -> str:
        em = Emitter(bind)
        p_text = em.float_(ex.p)
        ds_text = ex.ds_text(em)
        if mask is not None:
            p_text = f"T.if_then_else({mask}, {p_text}, T.float32(0.0))"
            ds_text = f"T.if_then_else({mask}, {ds_text}, T.float32(0.0))"
        return (f"for i, j in T.Parallel({bM}, {bN}):\n"
                f"    p[i, j] = {p_text}\n"
                f"    ds_cast[i, j] = {ds_text}")

    args = _input_args(spec, shape, dt)
    args += [
        f'Lo: T.Tensor(({shape.mask_batch}, {shape.mask_heads}, {nqb}), "int32")',
        f'Hi: T.Tensor(({shape.mask_batch}, {shape.mask_heads}, {nqb}), "int32")',
        f'Cls: T.Tensor(({shape.mask_batch}, {shape.mask_heads}, {nqb}, {nkb}), "int8")',
    ]
    args += _row_args(spec, shape)
    args.append(f'dQ: T.Tensor(({shape.batch}, {Sq}, {shape.heads_q}, {D}), "float32")')
    lines: list[str] = []
    w = lambda ind, text: _writer_lines(lines, ind, text)  # noqa: E731
    _header(lines, f"spec {spec.hash}, dQ config {cfg.key()}, deterministic", args)
    w(1, f"with T.Kernel({nqb}, {shape.heads_q}, {shape.batch}, threads={cfg.threads}) as (bx, by, bz):")
    b = 2
    w(b, f'Q_shared = T.alloc_shared(({bM}, {D}), "{dt}")')
    w(b, f'dO_shared = T.alloc_shared(({bM}, {Dv}), "{dt}")')
    w(b, f'K_shared = T.alloc_shared(({bN}, {D}), "{dt}")')
    w(b, f'V_shared = T.alloc_shared(({bN}, {Dv}), "{dt}")')
    w(b, f's = T.alloc_fragment(({bM}, {bN}), "float32")')
    w(b, f'dp = T.alloc_fragment(({bM}, {bN}), "float32")')
    w(b, f'p = T.alloc_fragment(({bM}, {bN}), "float32")')
    w(b, f'ds_cast = T.alloc_fragment(({bM}, {bN}), "{dt}")')
    w(b, f'dq = T.alloc_fragment(({bM}, {D}), "float32")')
    w(b, f"T.copy(Q[bz, bx * {bM}:(bx + 1) * {bM}, by, :], Q_shared)")
    w(b, f"T.copy(dO[bz, bx * {bM}:(bx + 1) * {bM}, by, :], dO_shared)")
    w(b, "T.clear(dq)")
    lo, hi = f"Lo[{mb}, {mh}, bx]", f"Hi[{mb}, {mh}, bx]"
    w(b, f"for k in T.Pipelined({hi} - {lo}, num_stages={cfg.num_stages}):")
    lb = b + 1
    policy = "T.GemmWarpPolicy.FullRow"
    w(lb, f"kb: T.int32 = {lo} + k")
    w(lb, f"T.copy(K[bz, kb * {bN}:(kb + 1) * {bN}, by // {G}, :], K_shared)")
    w(lb, "T.clear(s)")
    w(lb, f"T.gemm(Q_shared, K_shared, s, transpose_B=True, policy={policy})")
    w(lb, f"T.copy(V[bz, kb * {bN}:(kb + 1) * {bN}, by // {G}, :], V_shared)")
    w(lb, "T.clear(dp)")
    w(lb, f"T.gemm(dO_shared, V_shared, dp, transpose_B=True, policy={policy})")
    w(lb, f"if Cls[{mb}, {mh}, bx, kb] == 2:")
    w(lb + 1, tile_body(None))
    w(lb, "else:")
    w(lb + 1, tile_body(mask_text))
    w(lb, f"T.gemm(ds_cast, K_shared, dq, policy={policy})")
    w(b, f"for i, j in T.Parallel({bM}, {D}):")
    w(b + 1, f"if bx * {bM} + i < {Sq}:")
    w(b + 2, f"dQ[bz, bx * {bM} + i, by, j] = dq[i, j]")
    return "\n".join(lines) + "\n"
