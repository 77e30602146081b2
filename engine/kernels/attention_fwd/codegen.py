"""The forward kernel template: TileLang source generated from a TracedSpec and a KernelConfig.

One thread block computes block_M query rows of one (batch, query head). It loads its Q tile
once (TMA), then walks the non-empty key blocks [lo, hi) given by the mask analysis: for each,
S = Q K^T (wgmma), the spec's score_mod and online_fwd (row reductions, new row scales,
o_scale), O = O * o_scale + P V (wgmma). Only blocks the mask analysis marks partial evaluate
the mask; there masked entries are neutral in reductions and give p = 0, and non-finite row
updates (a row with no key in the block) keep the previous state. After the loop the epilogue
normalises O and writes O and the final row scales (e.g. lse) for the backward.
"""

from __future__ import annotations

from engine.codegen.emit import Emitter, const_text, custom_decl
from engine.dsl.expr import Expr, leaf, topo
from engine.ir.rewrite import pull_out_of_max, substitute
from engine.ir.spec import TracedSpec
from engine.mask.analysis import reads_data
from engine.plan.config import KernelConfig
from engine.plan.shape import KernelShape

_NEUTRAL = {"max": float("-inf"), "min": float("inf"), "sum": 0.0, "abssum": 0.0}
_TL_DTYPE = {"float16": "float16", "bfloat16": "bfloat16"}


def _rows(e: Expr) -> bool:
    return "n" not in e.axes and "d" not in e.axes


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def add(self, indent: int, text: str) -> None:
        for ln in text.splitlines():
            self.lines.append("    " * indent + ln)


def _prepare_online(spec: TracedSpec) -> tuple[Expr, list[tuple[str, Expr]], Expr]:
    """online_fwd outputs written over the raw score (score_mod inlined), with max
    reductions moved off scaled/shifted tiles (exp becomes exp2 of an FFMA at emission)."""
    raw = leaf("score", ("m", "n"))
    # Mark the raw score with a distinct leaf so the substitution is not recursive.
    raw_mark = leaf("rawscore", ("m", "n"))
    sm = substitute(spec.score_mod, {raw.key: raw_mark})
    roots = [spec.online_p, spec.o_scale, *(e for _, e in spec.online_updates)]
    roots = [pull_out_of_max(substitute(r, {raw.key: sm})) for r in roots]
    p, o_scale, *upd = roots
    return p, list(zip(spec.online_names, upd, strict=True)), o_scale


def generate_forward(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig) -> str:
    """TileLang source defining `main`, the forward prim_func of `spec` at `shape`."""
    bM, bN, D, Dv = cfg.block_M, cfg.block_N, shape.head_dim, shape.head_dim_v
    G = shape.heads_q // shape.heads_kv
    grid_q = shape.blocks_text(shape.sq_text, shape.seqlen_q, bM)
    nqb = shape.table_blocks_text("q", shape.seqlen_q, bM)
    nkb = shape.table_blocks_text("kv", shape.seqlen_kv, bN)
    Bt, Sq, Skv = shape.b_text, shape.sq_text, shape.skv_text
    dt = _TL_DTYPE[shape.dtype]
    policy = f"T.GemmWarpPolicy.{cfg.gemm_policy}"
    mb = shape.mask_batch_index
    mh = "by" if shape.mask_heads > 1 else "0"
    p_expr, updates, o_scale = _prepare_online(spec)

    q_idx = f"(bx * {bM} + i)"
    kv_idx = f"(kb * {bN} + j)"
    index_text = {"b": "bz", "h": "by", "q": q_idx, "kv": kv_idx}
    clamp = {
        "q": f"T.min({q_idx}, {shape.last_text('q')})",
        "kv": f"T.min({kv_idx}, {shape.last_text('kv')})",
    }

    def custom_global(node: Expr, i: str = "i", j: str = "j") -> str:
        name, _, index = node.attr
        parts = [clamp.get(s, index_text.get(s, "0")) if isinstance(s, str) else "0" for s in index]
        text = f"C_{name}[{', '.join(parts)}]"
        return text.replace("+ i)", f"+ {i})").replace("+ j)", f"+ {j})")

    # Custom reads indexed by the query position only are staged once per query block in a row
    # fragment instead of being re-read from global memory per element. Those indexed by the
    # key position only (a document id per key) are copied per key block into shared memory
    # beside K: on the H100 the document forward ran 5% faster (the per-element global reads
    # of partial blocks were 13% of its time). Not with three consumer warpgroups: TileLang's
    # warp specialisation then gave the copy to a second producer group that ran out of
    # registers. Partial blocks evaluate the mask only once either way, see _online_body.
    all_nodes = topo(
        [
            spec.score_mod,
            *([spec.mask] if spec.mask is not None else []),
            spec.online_p,
            spec.o_scale,
            *(e for _, e in spec.online_updates),
        ]
    )
    customs_1d = {n.key: n for n in all_nodes if n.op == "custom" and n.axes == ("m",)}
    staged: dict[tuple, str] = {}
    for idx_c, key in enumerate(sorted(customs_1d, key=str)):
        staged[key] = f"cq{idx_c}"

    # A whole key block per copy: static lengths that the key blocks tile exactly.
    per_key: dict[tuple, tuple[str, str]] = {}
    if cfg.threads <= 256 and not shape.dynamic and shape.seqlen_kv % bN == 0:
        reads = sorted({n.key: n for n in all_nodes if n.op == "custom" and n.axes == ("n",)
                        and n.attr[2][-1] == "kv"}.items(), key=lambda kv: str(kv[0]))
        for idx_c, (key, node) in enumerate(reads):
            name, _, index = node.attr
            parts = [f"kb * {bN}:(kb + 1) * {bN}" if s == "kv" else index_text.get(s, "0")
                     if isinstance(s, str) else "0" for s in index]
            per_key[key] = (f"cks{idx_c}", f"C_{name}[{', '.join(parts)}]")

    def custom_text(node: Expr) -> str:
        if node.key in staged:
            return f"{staged[node.key]}[i]"
        if node.key in per_key:
            return f"{per_key[node.key][0]}[j]"
        return custom_global(node)

    def base_bind(node: Expr) -> str | None:
        if node.op == "idx":
            return index_text[node.attr]
        if node.op == "custom":
            return custom_text(node)
        if node.op == "rowscale":
            return f"rs_{node.attr}[i]"
        return None

    # ------------------------------------------------------------- signature
    args = [
        f'Q: T.Tensor(({Bt}, {Sq}, {shape.heads_q}, {D}), "{dt}")',
        f'K: T.Tensor(({Bt}, {Skv}, {shape.heads_kv}, {D}), "{dt}")',
        f'V: T.Tensor(({Bt}, {Skv}, {shape.heads_kv}, {Dv}), "{dt}")',
    ]
    args += [custom_decl(f"C_{name}", dims, Bt, shape.heads_q, Sq, Skv)
             for name, dims in spec.customs]
    args += [
        f'Lo: T.Tensor(({shape.mask_batch_text}, {shape.mask_heads}, {nqb}), "int32")',
        f'Hi: T.Tensor(({shape.mask_batch_text}, {shape.mask_heads}, {nqb}), "int32")',
        f'Cls: T.Tensor(({shape.mask_batch_text}, {shape.mask_heads}, {nqb}, {nkb}), "int8")',
        f'O: T.Tensor(({Bt}, {Sq}, {shape.heads_q}, {Dv}), "{dt}")',
    ]
    for name in spec.final_names:
        args.append(
            f'F_{name}: T.Tensor(({Bt}, {shape.heads_q}, {Sq}), "float32")'
        )

    w = _Writer()
    w.add(0, f"# Generated by engine.codegen.forward: spec {spec.hash}, config {cfg.key()}")
    w.add(0, "import tilelang.language as T\n\n")
    if shape.preamble:
        w.add(0, shape.preamble)
    w.add(0, "@T.prim_func")
    w.add(0, "def main(")
    for a in args:
        w.add(1, a + ",")
    w.add(0, "):")
    w.add(
        1,
        f"with T.Kernel({grid_q}, {shape.heads_q}, {Bt}, threads={cfg.threads}) as (bx, by, bz):",
    )
    body = 2
    w.add(body, f'Q_shared = T.alloc_shared(({bM}, {D}), "{dt}")')
    w.add(body, f'K_shared = T.alloc_shared(({bN}, {D}), "{dt}")')
    w.add(body, f'V_shared = T.alloc_shared(({bN}, {Dv}), "{dt}")')
    w.add(body, f'O_shared = T.alloc_shared(({bM}, {Dv}), "{dt}")')
    w.add(body, f'acc_s = T.alloc_fragment(({bM}, {bN}), "float32")')
    w.add(body, f'acc_s_cast = T.alloc_fragment(({bM}, {bN}), "{dt}")')
    w.add(body, f'acc_o = T.alloc_fragment(({bM}, {Dv}), "float32")')
    for name, _ in spec.online_init:
        w.add(body, f'rs_{name} = T.alloc_fragment(({bM},), "float32")')

    # The loop body is generated twice (full and partial blocks); collect its row temporaries.
    loop_full, temps_full = _online_body(p_expr, updates, o_scale, base_bind, None, bM, bN)
    mask_text = None
    # A dynamic length may leave a key tail: the bound is then always part of the mask (it
    # costs nothing in full blocks, which the class table sends to the unmasked body).
    if spec.mask is not None or shape.seqlen_kv % bN or shape.dynamic:
        mask_em = Emitter(base_bind)
        conds = [f"({kv_idx} < {Skv})"]
        if spec.mask is not None:
            conds.insert(0, mask_em.text(spec.mask))
        mask_text = conds[0] if len(conds) == 1 else f"T.And({conds[0]}, {conds[1]})"
    # Masks that read tensors (document ids) are evaluated once per partial block into a tile;
    # index-only masks are cheaper to recompute inline (measured on the H100: causal 4k
    # 516 vs 452 TFLOP/s inline vs once, document 61 vs 104).
    mask_once = reads_data(spec.mask)
    loop_part, temps_part = (
        (None, set())
        if mask_text is None
        else _online_body(
            p_expr, updates, o_scale, base_bind, mask_text, bM, bN, dt if mask_once else None
        )
    )
    for t in sorted(temps_full | temps_part):
        w.add(body, f'{t} = T.alloc_fragment(({bM},), "float32")')
    for buf in staged.values():
        w.add(body, f'{buf} = T.alloc_fragment(({bM},), "float32")')
    for buf, _ in per_key.values():
        w.add(body, f'{buf} = T.alloc_shared(({bN},), "float32")')
    if cfg.swizzle_panel:
        w.add(body, f"T.use_swizzle({cfg.swizzle_panel})")

    w.add(body, f"T.copy(Q[bz, bx * {bM}:(bx + 1) * {bM}, by, :], Q_shared)")
    w.add(body, "T.fill(acc_o, 0)")
    for key, buf in staged.items():
        w.add(body, f"for i in T.Parallel({bM}):")
        w.add(body + 1, f"{buf}[i] = {custom_global(customs_1d[key])}")
    for name, init in spec.online_init:
        w.add(body, f"T.fill(rs_{name}, {const_text(init, 'float')})")
    lo, hi = f"Lo[{mb}, {mh}, bx]", f"Hi[{mb}, {mh}, bx]"
    has_rescale = not (o_scale.op == "const" and float(o_scale.attr) == 1.0)
    w.add(body, f"for k in T.Pipelined({hi} - {lo}, num_stages={cfg.num_stages}):")
    lb = body + 1
    w.add(lb, f"kb: T.int32 = {lo} + k")
    w.add(lb, f"T.copy(K[bz, kb * {bN}:(kb + 1) * {bN}, by // {G}, :], K_shared)")
    for buf, src in per_key.values():
        w.add(lb, f"T.copy({src}, {buf})")
    w.add(lb, "T.clear(acc_s)")
    w.add(lb, f"T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy={policy})")
    if loop_part is None:
        w.add(lb, loop_full)
    else:
        w.add(lb, f"if Cls[{mb}, {mh}, bx, kb] == 2:")
        w.add(lb + 1, loop_full)
        w.add(lb, "else:")
        w.add(lb + 1, loop_part)
    if has_rescale:
        w.add(lb, f"for i, j in T.Parallel({bM}, {Dv}):")
        w.add(lb + 1, "acc_o[i, j] *= o_scale_f[i]")
    w.add(lb, f"T.copy(V[bz, kb * {bN}:(kb + 1) * {bN}, by // {G}, :], V_shared)")
    w.add(lb, f"T.gemm(acc_s_cast, V_shared, acc_o, policy={policy})")

    # ------------------------------------------------------------- epilogue
    def epi_bind(node: Expr) -> str | None:
        if node.op == "o":
            return "acc_o[i, j]"
        return base_bind(node)

    em = Emitter(epi_bind)
    o_text = em.text(spec.epilogue_o)
    w.add(body, f"for i, j in T.Parallel({bM}, {Dv}):")
    # NaN only arises for rows without any unmasked key (e.g. 0/0 in softmax): they output 0.
    w.add(
        body + 1,
        f"acc_o[i, j] = T.if_then_else(T.isnan({o_text}), T.float32(0.0), {o_text})"
        if o_text != "acc_o[i, j]"
        else "acc_o[i, j] = acc_o[i, j]",
    )
    w.add(body, "T.copy(acc_o, O_shared)")
    w.add(body, f"T.copy(O_shared, O[bz, bx * {bM}:(bx + 1) * {bM}, by, :])")
    inits = dict(spec.final_init)
    for name, fexpr in spec.epilogue_final:
        em_r = Emitter(base_bind)
        t = em_r.text(fexpr)
        w.add(body, f"for i in T.Parallel({bM}):")
        w.add(body + 1, f"if bx * {bM} + i < {Sq}:")
        w.add(
            body + 2,
            f"F_{name}[bz, by, bx * {bM} + i] = T.if_then_else(T.isnan({t}), "
            f"{const_text(inits[name], 'float')}, {t})",
        )
    return "\n".join(w.lines) + "\n"


def _online_body(
    p_expr: Expr,
    updates: list[tuple[str, Expr]],
    o_scale: Expr,
    base_bind,
    mask: str | None,
    bM: int,
    bN: int,
    mask_once_dtype: str | None = None,
) -> tuple[str, set[str]]:
    """Statements for score -> (P in acc_s_cast, o_scale_f, new row scales); `mask` is the
    mask condition text for partial blocks (None: a full block); with `mask_once_dtype` the
    mask is evaluated once into acc_s_cast (of that dtype) and read back."""
    out: list[str] = []
    if mask is not None and mask_once_dtype is not None:
        dt = mask_once_dtype
        # Evaluate the mask once into acc_s_cast (free until P is written into it, in place,
        # last); every select below reads it back.
        one, zero = f'T.Cast("{dt}", 1)', f'T.Cast("{dt}", 0)'
        loop = f"for i, j in T.Parallel({bM}, {bN}):\n"
        out.append(loop + f"    acc_s_cast[i, j] = T.if_then_else({mask}, {one}, {zero})")
        mask = f"(acc_s_cast[i, j] != {zero})"
    temps: set[str] = set()
    bound: dict[tuple, str] = {}
    raw = leaf("rawscore", ("m", "n"))
    acc_holds: Expr = raw  # which expression acc_s currently holds
    bound[raw.key] = "acc_s[i, j]"
    counter = [0]

    def bind(node: Expr) -> str | None:
        if node.key in bound:
            return bound[node.key]
        return base_bind(node)

    roots = [p_expr, o_scale, *(e for _, e in updates)]
    order = topo(roots)
    tile_roots = [p_expr]
    reduce_nodes = [n for n in order if n.op == "reduce"]
    # Row nodes that need a fragment: referenced from a tile expression or a reduction's
    # input, or a root. Everything else is inlined.
    needed: set[tuple] = set()
    for n in order:
        if "n" in n.axes:
            for a in n.args:
                if _rows(a) and a.args and a.op != "const" and a.axes:
                    needed.add(a.key)
    for r in [o_scale, *(e for _, e in updates)]:
        if r.args and r.axes:
            needed.add(r.key)

    def uses(expr: Expr, target: Expr, stop: Expr) -> bool:
        """Does `expr` read `target` other than inside subexpression `stop`?"""
        seen = set()
        stack = [expr]
        while stack:
            e = stack.pop()
            if e.key in seen or e.key == stop.key:
                continue
            seen.add(e.key)
            if e.key == target.key:
                return True
            stack.extend(e.args)
        return False

    def materialize(src: Expr, neutral: float | None, remaining: list[Expr]) -> str:
        nonlocal acc_holds
        em = Emitter(bind)
        if src.key in bound and bound[src.key] == "acc_s[i, j]":
            if mask is not None and neutral is not None:
                out.append(
                    f"for i, j in T.Parallel({bM}, {bN}):\n    acc_s[i, j] = T.if_then_else("
                    f"{mask}, acc_s[i, j], {const_text(neutral, 'float')})"
                )
            return "acc_s"
        if any(uses(e, acc_holds, src) for e in remaining):
            raise NotImplementedError("this spec needs two live score tiles; not supported yet")
        text = em.float_(src)
        if mask is not None:
            text = f"T.if_then_else({mask}, {text}, {const_text(neutral or 0.0, 'float')})"
        out.append(f"for i, j in T.Parallel({bM}, {bN}):\n    acc_s[i, j] = {text}")
        bound.pop(acc_holds.key, None)
        bound[src.key] = "acc_s[i, j]"
        acc_holds = src
        return "acc_s"

    def emit_rows() -> None:
        # Row values whose reductions are all available, each into its own fragment.
        for n in order:
            if n.key in needed and n.key not in bound and n.op != "reduce":
                deps = [m for m in topo([n]) if m.op == "reduce"]
                if all(d.key in bound for d in deps):
                    counter[0] += 1
                    name = f"r{counter[0]}"
                    temps.add(name)
                    text = Emitter(bind).float_(n)
                    out.append(f"for i in T.Parallel({bM}):\n    {name}[i] = {text}")
                    bound[n.key] = f"{name}[i]"

    for idx, rn in enumerate(reduce_nodes):
        emit_rows()
        later = [r.args[0] for r in reduce_nodes[idx + 1 :]] + tile_roots
        buf = materialize(rn.args[0], _NEUTRAL[rn.attr], later)
        counter[0] += 1
        name = f"r{counter[0]}"
        temps.add(name)
        kind = rn.attr
        if kind == "abssum":
            out.append(f"T.reduce_abssum({buf}, {name}, dim=1)")
        else:
            out.append(f"T.reduce_{kind}({buf}, {name}, dim=1, clear=True)")
        bound[rn.key] = f"{name}[i]"
    emit_rows()
    # P into the half-precision tile for the PV gemm.
    em = Emitter(bind)
    ptext = em.float_(p_expr)
    if mask is not None:
        ptext = f"T.if_then_else({mask}, {ptext}, T.float32(0.0))"
    out.append(f"for i, j in T.Parallel({bM}, {bN}):\n    acc_s_cast[i, j] = {ptext}")
    # o_scale and the new row scales (old values are read above; commit last).
    if not (o_scale.op == "const" and float(o_scale.attr) == 1.0):
        temps.add("o_scale_f")
        t = Emitter(bind).float_(o_scale)
        if mask is not None:
            t = f"T.if_then_else(T.isnan({t}), T.float32(1.0), {t})"
        out.append(f"for i in T.Parallel({bM}):\n    o_scale_f[i] = {t}")
    commits = []
    for name, e in updates:
        t = Emitter(bind).float_(e)
        if t == f"rs_{name}[i]":
            continue
        if mask is not None:
            t = f"T.if_then_else(T.isnan({t}), rs_{name}[i], {t})"
        commits.append(f"rs_{name}[i] = {t}")
    if commits:
        out.append(f"for i in T.Parallel({bM}):\n" + "\n".join("    " + c for c in commits))
    return "\n".join(out), temps
