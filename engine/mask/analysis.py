"""Block classification of a traced mask by interval arithmetic.

For block sizes (block_M, block_N), every index leaf is replaced by the interval it spans in
each block: q_idx by [qb*block_M, min((qb+1)*block_M, Sq) - 1], kv_idx likewise, b and h by
their exact values when the mask reads them. Each node of the mask expression then evaluates,
vectorised over all block pairs, to an interval [lo, hi] (booleans to {all false, all true,
mixed}). Affine comparisons such as `q_idx - kv_idx < W` are classified exactly, because an
affine function of independent intervals attains its extremes at the corners; anything else
is classified conservatively (a block may be called partial when it is in fact full, never the
reverse). CustomIO reads use the block-wise min/max of the data when it is supplied (document
ids), else they are unknown.

Cost: O(nodes x nQB x nKB) on tensors of block counts, never O(Sq x Skv): at Sq = Skv = 128k
with 128x128 blocks that is 1024 x 1024 = 1M entries per node, a few milliseconds on a CPU.
Exact unmasked-pair counts additionally evaluate only the partial blocks element by element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.dsl.expr import Expr, custom_names, topo

EMPTY, PARTIAL, FULL = 0, 1, 2
_INF = float("inf")
# Non-decreasing functions: the interval's ends map to the result's ends.
_INCREASING = {op: getattr(torch, op) for op in (
    "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "log1p", "expm1", "erf", "floor",
    "ceil", "round")}
_INCREASING["toint"] = torch.trunc


@dataclass(frozen=True)
class BlockClasses:
    """classes[b', h', qb, kb] in {EMPTY, PARTIAL, FULL}; b'/h' have size 1 when the mask
    does not read b/h."""

    classes: torch.Tensor
    block_M: int
    block_N: int
    seqlen_q: int
    seqlen_kv: int

    def loop_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (b', h', q block): first and one-past-last non-empty kv block (lo == hi: none)."""
        nonempty = self.classes != EMPTY
        nkb = nonempty.shape[-1]
        ar = torch.arange(nkb, dtype=torch.int32, device=nonempty.device)
        big = torch.full_like(ar, nkb)
        lo = torch.where(nonempty, ar, big).amin(-1)
        hi = torch.where(nonempty, ar + 1, torch.zeros_like(ar)).amax(-1)
        lo = torch.minimum(lo, hi)
        return lo.to(torch.int32), hi.to(torch.int32)

    def full_run(self, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (b', h', q block): the longest run [start, end) of FULL kv blocks (any one of
        several as long; start == end == `lo`, loop_bounds()' first block, where no block is
        full). A kernel walks it with the unmasked body alone, without reading the class per
        block."""
        full = self.classes == FULL
        nkb = full.shape[-1]
        ar = torch.arange(nkb, dtype=torch.int32, device=full.device)
        # length of the run of full blocks ending at each block
        last_gap = torch.where(full, torch.full_like(ar, -1), ar).cummax(-1).values
        run = torch.where(full, ar - last_gap, torch.zeros_like(ar))
        length, last = run.max(-1)
        start = torch.where(length > 0, last - length + 1, lo)
        return start.to(torch.int32), (start + length).to(torch.int32)

    def density(self) -> float:
        """Fraction of blocks that are not empty (FlexAttention's block sparsity convention)."""
        return float((self.classes != EMPTY).float().mean())


def reads_data(mask: Expr | None) -> bool:
    """Whether the mask reads CustomIO tensors (e.g. document ids): its block tables then
    depend on the data, and evaluating it costs memory reads."""
    return mask is not None and bool(custom_names([mask]))


def mask_reads(mask: Expr | None, sym: str) -> bool:
    """Whether the mask reads index `sym` ("b", "h", ...), directly or through a CustomIO
    tensor indexed by it."""
    nodes = topo([mask]) if mask is not None else []
    return any((n.op == "idx" and n.attr == sym) or (n.op == "custom" and sym in n.attr[2])
               for n in nodes)


def table_dims(mask: Expr | None, batch: int, heads: int) -> tuple[int, int]:
    """Leading dims of a mask's block tables: B and H only when the mask reads b / h; 1
    otherwise."""
    return (batch if mask_reads(mask, "b") else 1), (heads if mask_reads(mask, "h") else 1)


def _block_interval(n: int, block: int, device: torch.device | str = "cpu"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.arange(0, n, block, dtype=torch.float64, device=device)
    return starts, torch.clamp(starts + block - 1, max=n - 1)


def _block_pool(y: torch.Tensor, d: int, blk: int, pad: int, fn, fill: float) -> torch.Tensor:
    """Reduce dim `d` of `y` in blocks of `blk` (padding the tail with `fill`)."""
    y = y.movedim(d, -1)
    if pad:
        y = torch.cat([y, torch.full((*y.shape[:-1], pad), fill, dtype=y.dtype,
                                     device=y.device)], -1)
    y = y.reshape(*y.shape[:-1], -1, blk)
    return fn(y).movedim(-1, d)


def _custom_interval(
    t: torch.Tensor,
    index: tuple,
    B: int,
    H: int,
    block_M: int,
    block_N: int,
    b_used: bool,
    h_used: bool,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    x = t.detach().to(device, torch.float64)
    lo, hi = x, x
    out_dims = {"b": 0, "h": 1, "q": 2, "kv": 3}
    for d, sym in enumerate(index):
        if sym in ("q", "kv"):
            blk = block_M if sym == "q" else block_N
            n = lo.shape[d]
            pad = (-n) % blk

            lo = _block_pool(lo, d, blk, pad, lambda y: y.amin(-1), _INF)
            hi = _block_pool(hi, d, blk, pad, lambda y: y.amax(-1), -_INF)
    # Arrange the dims as [b, h, q, kv] (size 1 where not indexed; index 0 selects entry 0).
    sel = []
    for sym in index:
        sel.append(slice(None) if isinstance(sym, str) else 0)
    lo, hi = lo[tuple(sel)], hi[tuple(sel)]
    syms = [s for s in index if isinstance(s, str)]
    shape_lo = [1, 1, 1, 1]
    perm_src = []
    for s in ("b", "h", "q", "kv"):
        if s in syms:
            perm_src.append(syms.index(s))
    lo = lo.permute(*perm_src) if perm_src else lo
    hi = hi.permute(*perm_src) if perm_src else hi
    it = iter(lo.shape)
    for s in ("b", "h", "q", "kv"):
        if s in syms:
            shape_lo[out_dims[s]] = next(it)
    return lo.reshape(shape_lo), hi.reshape(shape_lo)


def classify(
    mask: Expr | None,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_kv: int,
    block_M: int,
    block_N: int,
    customs: dict[str, torch.Tensor] | None = None,
    stride: int = 1,
    device: torch.device | str = "cpu",
) -> BlockClasses:
    """Classify every (q block, kv block) pair as EMPTY, PARTIAL or FULL. With `stride`, the
    rows and keys are those of a folded kernel (engine.plan.fold): row i of
    residue r is position i * stride + r, and a block is FULL (EMPTY) only where it is for
    every residue. Such a mask reads neither b, h nor data. On `device` with no copy from the
    host and no read back, so a CUDA graph can capture it (engine.runtime.mask_tables)."""
    q_lo, q_hi = _block_interval(seqlen_q, block_M, device)
    k_lo, k_hi = _block_interval(seqlen_kv, block_N, device)
    nqb, nkb = len(q_lo), len(k_lo)
    # A kv block that runs past Skv needs bounds masking, so it is at most partial.
    tail = torch.zeros(1, 1, 1, nkb, dtype=torch.bool, device=device)
    if seqlen_kv % block_N:
        tail[..., -1] = True
    if mask is None:
        classes = torch.where(tail, PARTIAL, FULL).to(torch.int8).expand(1, 1, nqb, nkb)
        classes = classes.contiguous()
        return BlockClasses(classes, block_M, block_N, seqlen_q, seqlen_kv)
    nodes = topo([mask])
    b_used = any(n.op == "idx" and n.attr == "b" for n in nodes) or any(
        n.op == "custom" and "b" in n.attr[2] for n in nodes
    )
    h_used = any(n.op == "idx" and n.attr == "h" for n in nodes) or any(
        n.op == "custom" and "h" in n.attr[2] for n in nodes
    )
    if stride > 1 and (b_used or h_used or customs):
        raise ValueError("a folded mask's tables read no b, h or data")
    idx = {
        "b": (torch.arange(batch, dtype=torch.float64, device=device).view(-1, 1, 1, 1),) * 2,
        "h": (torch.arange(heads, dtype=torch.float64, device=device).view(1, -1, 1, 1),) * 2,
    }
    shape = (batch if b_used else 1, heads if h_used else 1, nqb, nkb)
    lowest, highest = None, None
    for r in range(stride):
        idx["q"] = (q_lo.view(1, 1, -1, 1) * stride + r, q_hi.view(1, 1, -1, 1) * stride + r)
        idx["kv"] = (k_lo.view(1, 1, 1, -1) * stride + r, k_hi.view(1, 1, 1, -1) * stride + r)
        iv: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for n in nodes:
            iv[n.key] = _interval(n, [iv[a.key] for a in n.args], idx, customs or {}, batch,
                                  heads, block_M, block_N, b_used, h_used, device)
        lo, hi = (x.expand(shape) for x in iv[mask.key])
        lowest = lo if lowest is None else torch.minimum(lowest, lo)
        highest = hi if highest is None else torch.maximum(highest, hi)
    classes = torch.where(lowest > 0.5, FULL,
                          torch.where(highest < 0.5, EMPTY, PARTIAL)).to(torch.int8)
    classes = torch.where((classes == FULL) & tail, PARTIAL, classes)
    return BlockClasses(classes.contiguous(), block_M, block_N, seqlen_q, seqlen_kv)


def _const(v: float, device) -> torch.Tensor:
    # a fill, not torch.tensor: no copy from the host, which a CUDA graph capture refuses
    return torch.full((), v, dtype=torch.float64, device=device)


def _unknown(device) -> tuple[torch.Tensor, torch.Tensor]:
    return _const(-_INF, device), _const(_INF, device)


def _interval(n: Expr, a: list, idx, customs, B, H, bM, bN, b_used, h_used, device="cpu"):
    op = n.op
    if op == "const":
        v = _const(float(n.attr), device)
        return v, v
    if op == "idx":
        return idx[n.attr]
    if op == "custom":
        name, _, index = n.attr
        if name not in customs:
            return _unknown(device)
        return _custom_interval(customs[name], index, B, H, bM, bN, b_used, h_used, device)
    if op == "gather":
        return _table_interval(customs.get(n.attr[0]), device)
    if op == "add":
        return a[0][0] + a[1][0], a[0][1] + a[1][1]
    if op == "sub":
        return a[0][0] - a[1][1], a[0][1] - a[1][0]
    if op == "neg":
        return -a[0][1], -a[0][0]
    if op == "mul":
        c = [torch.nan_to_num(x * y, nan=0.0) for x in a[0] for y in a[1]]
        return _min(c), _max(c)
    if op == "div":
        (ylo, yhi) = a[1]
        safe = (ylo > 0) | (yhi < 0)
        c = [x / torch.where(safe, y, torch.ones_like(y)) for x in a[0] for y in a[1]]
        return (torch.where(safe, _min(c), -_INF), torch.where(safe, _max(c), _INF))
    if op in ("max", "min"):
        f = torch.maximum if op == "max" else torch.minimum
        return f(a[0][0], a[1][0]), f(a[0][1], a[1][1])
    if op == "abs":
        lo, hi = a[0]
        pos, neg = lo >= 0, hi <= 0
        return (
            torch.where(pos, lo, torch.where(neg, -hi, torch.zeros_like(lo))),
            torch.where(pos, hi, torch.where(neg, -lo, torch.maximum(-lo, hi))),
        )
    if op in _INCREASING:
        f = _INCREASING[op]
        return f(a[0][0]), f(a[0][1])
    if op == "rsqrt":
        return torch.rsqrt(a[0][1]), torch.rsqrt(a[0][0])
    if op in ("sin", "cos"):
        return _const(-1.0, device), _const(1.0, device)
    if op in ("floordiv", "mod"):
        return _floor_division(op, a[0], float(n.args[1].attr), n.dtype == "int")
    if op in ("ge", "gt", "le", "lt", "eq", "ne"):
        (alo, ahi), (blo, bhi) = a
        if op in ("le", "lt"):
            (alo, ahi), (blo, bhi) = (blo, bhi), (alo, ahi)
            op = "ge" if op == "le" else "gt"
        if op == "ge":
            t, f = alo >= bhi, ahi < blo
        elif op == "gt":
            t, f = alo > bhi, ahi <= blo
        else:
            t = (alo == ahi) & (blo == bhi) & (alo == blo)
            f = (ahi < blo) | (bhi < alo)
            if op == "ne":
                t, f = f, t
        return _tri(t, f)
    if op == "and":
        return torch.minimum(a[0][0], a[1][0]), torch.minimum(a[0][1], a[1][1])
    if op == "or":
        return torch.maximum(a[0][0], a[1][0]), torch.maximum(a[0][1], a[1][1])
    if op == "not":
        return 1.0 - a[0][1], 1.0 - a[0][0]
    if op == "where":
        (clo, chi), x, y = a
        lo = torch.where(clo > 0.5, x[0], torch.where(chi < 0.5, y[0], torch.minimum(x[0], y[0])))
        hi = torch.where(clo > 0.5, x[1], torch.where(chi < 0.5, y[1], torch.maximum(x[1], y[1])))
        return lo, hi
    # pow and anything else: unknown
    return _unknown(device)


def _table_interval(t: torch.Tensor | None, device="cpu"):
    """A table lookup is bounded by the whole table's range (unknown without the data)."""
    if t is None or t.numel() == 0:
        return _unknown(device)
    t = t.detach().to(device, torch.float64)  # where the tables are built
    return t.min(), t.max()


def _floor_division(op: str, x, c: float, integer: bool):
    """Interval of x // c or x % c (floor semantics), c a nonzero constant."""
    lo, hi = x
    qlo, qhi = torch.floor(lo / c), torch.floor(hi / c)
    if op == "floordiv":
        return torch.minimum(qlo, qhi), torch.maximum(qlo, qhi)
    # x % c = x - c * floor(x / c): exact where the interval stays within one period
    same = qlo == qhi
    top = c - 1 if integer and c > 0 else (c + 1 if integer else c)  # ints: c - 1 (c > 0)
    span_lo, span_hi = (0.0, top) if c > 0 else (top, 0.0)
    r_lo, r_hi = lo - c * qlo, hi - c * qlo
    return (torch.where(same, torch.minimum(r_lo, r_hi), torch.full_like(r_lo, span_lo)),
            torch.where(same, torch.maximum(r_lo, r_hi), torch.full_like(r_hi, span_hi)))


def _tri(true: torch.Tensor, false: torch.Tensor):
    lo = true.to(torch.float64)
    hi = 1.0 - false.to(torch.float64)
    return lo, hi


def _min(c):
    out = c[0]
    for x in c[1:]:
        out = torch.minimum(out, x)
    return out


def _max(c):
    out = c[0]
    for x in c[1:]:
        out = torch.maximum(out, x)
    return out


def count_unmasked(
    mask: Expr | None,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_kv: int,
    customs: dict[str, torch.Tensor] | None = None,
    block: int = 128,
) -> int:
    """Exact number of unmasked (b, h, q, kv) entries: full blocks are counted by size, only
    partial blocks are evaluated element by element."""
    if mask is None:
        return batch * heads * seqlen_q * seqlen_kv
    from engine.reference.evaluate import Env, evaluate, index_tensors

    bc = classify(mask, batch, heads, seqlen_q, seqlen_kv, block, block, customs)
    cls = bc.classes.expand(batch, heads, -1, -1)
    q_sz = torch.clamp(seqlen_q - torch.arange(cls.shape[2]) * block, max=block)
    k_sz = torch.clamp(seqlen_kv - torch.arange(cls.shape[3]) * block, max=block)
    sizes = q_sz.view(-1, 1) * k_sz.view(1, -1)
    total = int((sizes * (cls == FULL)).sum())
    part = (bc.classes == PARTIAL).nonzero().tolist()
    for bb, hh, qb, kb in part:
        q_idx = torch.arange(qb * block, min((qb + 1) * block, seqlen_q))
        kv_idx = torch.arange(kb * block, min((kb + 1) * block, seqlen_kv))
        env = Env(
            dtype=torch.float64,
            device=torch.device("cpu"),
            index=index_tensors(batch, heads, q_idx, kv_idx, torch.device("cpu")),
            customs={k: v.detach().cpu() for k, v in (customs or {}).items()},
        )
        (m,) = evaluate([mask], env)
        m = m.expand(batch, heads, len(q_idx), len(kv_idx))
        if bc.classes.shape[0] == 1 and bc.classes.shape[1] == 1:
            total += int(m.sum())
        else:
            bsel = slice(None) if bc.classes.shape[0] == 1 else bb
            hsel = slice(None) if bc.classes.shape[1] == 1 else hh
            total += int(m[bsel, hsel].sum())
    return total
