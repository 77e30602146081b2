"""The backward's tile expressions, derived from a spec once: P, dS' (the user's `bwd`),
d score_mod / d score and the derivatives by each custom read whose gradient is wanted, all
over the raw score (leaf `rawscore`); and what the kernels cannot do (a refusal, with why)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.dsl.expr import Expr, leaf, leaves, topo
from engine.ir.diff import diff, score_mod_derivatives
from engine.ir.rewrite import positive, substitute
from engine.ir.spec import TracedSpec

# What the recomputed P and the user's `bwd` may read in a kernel.
_KERNEL_LEAVES = {"const", "score", "final", "dp", "p", "doosum", "idx", "custom"}


def check_spec(spec: TracedSpec) -> None:
    """NotImplementedError when the backward kernels cannot run `spec`'s rules."""
    for name, root in (("fwd_recompute", spec.fwd_recompute), ("bwd", spec.bwd)):
        if any(n.op == "reduce" for n in topo([root])):
            raise NotImplementedError(
                f"backward kernel: {name} uses a row reduction; only elementwise rules are supported"
            )
        bad = {n.op for n in leaves([root])} - _KERNEL_LEAVES
        if bad:
            raise NotImplementedError(f"backward kernel: {name} reads {sorted(bad)}")


def custom_grad_problem(spec: TracedSpec, name: str, deterministic: bool = False) -> str | None:
    """Why the kernel cannot produce the gradient of CustomIO tensor `name` (None: it can).
    The kernel sums a plain read's gradient over the query positions of its kv block in
    registers, so a read indexed by the query position is left to the reference rules; a table
    lookup's gradient is added per element with fp32 atomics, which the deterministic mode
    does not use."""
    if name in spec.online_custom_reads():
        return f"custom input {name!r} is read in the online functions"
    reads = [r for r, _ in score_mod_derivatives(spec)[1].values() if r.attr[0] == name]
    if not reads:
        return f"custom input {name!r} is not read in score_mod (its gradient is zero)"
    for read in reads:
        if read.op == "gather":
            if deterministic:
                return (f"custom input {name!r} is a table lookup, whose gradient the kernels "
                        "add with atomics (deterministic=True)")
            continue
        syms = [s for s in read.attr[2] if isinstance(s, str)]
        if "q" in syms:
            return f"custom input {name!r} is indexed by the query position"
        if len(syms) != len(set(syms)):
            return f"custom input {name!r} is read with a repeated index"
    return None


# Entries of a table row a thread block sums in shared memory before its global atomics: per
# element atomics to few entries (T5's 32 buckets) serialise (58x the backward's time at
# llama3-8b S 4k on the H100).
HIST_MAX = 1024


def per_block(arg: Expr) -> bool:
    """Whether a lookup's index is the thread block's own batch or head (b or h)."""
    return arg.op == "idx" and arg.attr in ("b", "h")


def hist_dim(read: Expr) -> int | None:
    """The one dim of table lookup `read` that varies within a thread block, when every other
    dim is read at the block's own batch or head and that dim has at most HIST_MAX entries.
    A dim read at b or h is one value per thread block whether it is named "batch"/"heads"
    or an integer size (engine.flex_attention's captured tables: `bias[h, bucket]`), the
    latter's index clamped as every lookup's is."""
    rest = [i for i, arg in enumerate(read.args) if not per_block(arg)]
    if len(rest) != 1 or not isinstance(read.attr[1][rest[0]], int):
        return None
    return rest[0] if read.attr[1][rest[0]] <= HIST_MAX else None


_FLIPPED = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq", "ne": "ne"}
_COMPARE_TEXT = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "eq": "==", "ne": "!="}


def diagonal_text(node: Expr, diagonal: str) -> str | None:
    """`node` written with `diagonal` (the text of q - kv) where it reads the positions only
    through their difference: q - kv, kv - q and a comparison of q with kv. None otherwise."""
    if len(node.args) != 2 or not all(a.op == "idx" for a in node.args):
        return None
    pair = tuple(a.attr for a in node.args)
    if pair not in (("q", "kv"), ("kv", "q")):
        return None
    flipped = pair == ("kv", "q")
    if node.op == "sub":
        return f"(-({diagonal}))" if flipped else f"({diagonal})"
    if node.op in _COMPARE_TEXT:
        op = _FLIPPED[node.op] if flipped else node.op
        return f"(({diagonal}) {_COMPARE_TEXT[op]} 0)"
    return None


def _diagonal_only(arg: Expr) -> bool:
    """Whether index `arg` reads the positions through q - kv alone (diagonal_text), and no
    other tensor: then it is the same all along a diagonal of the score tile."""
    found, stack = False, [arg]
    while stack:
        node = stack.pop()
        if diagonal_text(node, "d") is not None:
            found = True
        elif node.op in ("custom", "gather") or (node.op == "idx" and node.attr in ("q", "kv")):
            return False
        else:
            stack.extend(node.args)
    return found


def diagonal_dim(read: Expr) -> int | None:
    """The one dim of table lookup `read` indexed by a function of q - kv (a relative
    position: T5's bucket, a bias per distance), when every other dim is read at the thread
    block's own batch or head or at a constant."""
    rest = [i for i, arg in enumerate(read.args) if not (per_block(arg) or arg.op == "const")]
    return rest[0] if len(rest) == 1 and _diagonal_only(read.args[rest[0]]) else None


@dataclass(frozen=True)
class TableGrad:
    """A table lookup whose gradient is wanted: the read, d score_mod / d read, the dim of a
    small row summed in shared memory (hist_dim) and the dim indexed by q - kv alone
    (diagonal_dim), each None where it does not apply; `ds_factor`: the constant that turns
    the kernel's dS^T element into this gradient's element, None where none does."""

    read: Expr
    d_read: Expr
    row_dim: int | None
    diag_dim: int | None
    ds_factor: float | None


_SCORE, _RAW = leaf("score", ("m", "n")), leaf("rawscore", ("m", "n"))


def raw_derivatives(spec: TracedSpec) -> tuple[Expr, list[tuple[Expr, Expr]]]:
    """d score_mod / d score, and (read, d score_mod / d read) per custom read of score_mod,
    all over the raw score (leaf `rawscore`)."""
    to_raw = {_SCORE.key: _RAW}
    return (substitute(diff(spec.score_mod, _SCORE), to_raw),
            [(read, substitute(d, to_raw))
             for read, d in score_mod_derivatives(spec)[1].values()])


def _raw_cofactor(e: Expr) -> Expr | None:
    """X with e == rawscore * X, read off e's structure (products, quotients, negations, sums
    of such terms); None where e is not of that form."""
    if e.op == "rawscore":
        return Expr.wrap(1.0)
    has = [_reads_score([a]) for a in e.args]
    if e.op == "neg" and has[0]:
        x = _raw_cofactor(e.args[0])
        return None if x is None else -x
    if e.op in ("mul", "div") and has[0] != has[1]:
        if e.op == "div" and has[1]:
            return None
        inner, other = (e.args[0], e.args[1]) if has[0] else (e.args[1], e.args[0])
        x = _raw_cofactor(inner)
        return None if x is None else (x * other if e.op == "mul" else x / other)
    if e.op in ("add", "sub") and all(has):
        xa, xb = (_raw_cofactor(a) for a in e.args)
        if xa is None or xb is None:
            return None
        return xa + xb if e.op == "add" else xa - xb
    return None


def _per_head(e: Expr) -> bool:
    """Whether `e` is one value per (batch, head): constants, b, h and custom reads at them."""
    return all(n.op == "const" or (n.op == "idx" and n.attr in ("b", "h"))
               or (n.op == "custom" and not {"q", "kv"} & set(n.attr[2]))
               for n in leaves([e]))


@dataclass(frozen=True, eq=False)
class RowDotGrad:
    """A custom read once per (batch, head) that scales the raw score (a per-head key gate, a
    learned temperature): d score_mod / d read = rawscore * X, with X and d score_mod /
    d score one value per (batch, head). Since dQ_i = sum_j dS'_ij (d score_mod / d score)
    k_j, sum_j dS'_ij rawscore_ij = q_i . dQ_i / (d score_mod / d score), so its gradient is
    `coef` * sum_i q_i . dQ_i per (batch, head), coef = X / (d score_mod / d score): no tile
    reduction in the kernel. Only where d score_mod / d score cannot be 0 (a gate that is 0
    leaves dQ 0 and its own gradient not): a sigmoid gate, exp(temperature), constants."""

    name: str
    index: tuple
    coef: Expr

    # Expressions overload ==: compare by structure.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowDotGrad) and (self.name, self.index, self.coef.key) == (
            other.name, other.index, other.coef.key)

    def __hash__(self) -> int:
        return hash((self.name, self.index, self.coef.key))


def row_dot_grads(spec: TracedSpec, custom_grads: tuple[str, ...]
                  ) -> tuple[RowDotGrad, ...]:
    """The gradients of `custom_grads` that every read of theirs lets come from q . dQ."""
    if not custom_grads:
        return ()
    dsm_ds, reads = raw_derivatives(spec)
    if not _per_head(dsm_ds) or not positive(dsm_ds):
        return ()
    by_name: dict[str, list[RowDotGrad | None]] = {}
    for read, d in reads:
        if read.attr[0] not in custom_grads:
            continue
        x = _raw_cofactor(d) if read.op == "custom" else None
        ok = x is not None and _per_head(x) and not {"q", "kv"} & set(read.attr[2])
        by_name.setdefault(read.attr[0], []).append(
            RowDotGrad(read.attr[0], read.attr[2], x / dsm_ds) if ok else None)
    online = spec.online_custom_reads()
    return tuple(g for name, gs in sorted(by_name.items())
                 if name not in online and all(gs) for g in gs)


def _reads_score(roots: list[Expr]) -> bool:
    return any(n.op == "rawscore" for n in leaves(roots))


class BackwardExprs:
    """P, dS', d score_mod / d score, and per wanted custom read (name, index, d/d read)."""

    def __init__(self, spec: TracedSpec, custom_grads: tuple[str, ...],
                 deterministic: bool = False):
        check_spec(spec)
        for name in custom_grads:
            why = custom_grad_problem(spec, name, deterministic)
            if why is not None:
                raise NotImplementedError(f"backward kernel: {why}")
        smod = substitute(spec.score_mod, {_SCORE.key: _RAW})
        self.p = substitute(spec.fwd_recompute, {_SCORE.key: smod})
        self.ds_mod = substitute(spec.bwd, {_SCORE.key: smod})
        self.dsm_ds, reads = raw_derivatives(spec)
        wanted = [(read, d) for read, d in reads if read.attr[0] in custom_grads]
        # plain reads (name, index, d/d read), summed per key; table lookups (TableGrad),
        # summed along diagonals or added per element (the plan decides)
        self.dc_reads: list[tuple[str, tuple, Expr]] = [
            (read.attr[0], read.attr[2], d) for read, d in wanted if read.op == "custom"]
        self.dc_gathers: list[TableGrad] = [
            TableGrad(read, d, hist_dim(read), diagonal_dim(read), self._ds_factor(d))
            for read, d in wanted if read.op == "gather"]

    def _ds_factor(self, d_read: Expr) -> float | None:
        """c where dS' * d_read == c * dS (dS = dS' * d score_mod / d score, what dS^T holds):
        d_read constant and the chain rule's factor 1 or constant, or the two the same."""
        if d_read.key == self.dsm_ds.key:
            return 1.0
        if d_read.op != "const":
            return None
        if not self.chain_rule:
            return float(d_read.attr)
        if self.dsm_ds.op == "const" and float(self.dsm_ds.attr) != 0.0:
            return float(d_read.attr) / float(self.dsm_ds.attr)
        return None

    @property
    def ds_reads_score(self) -> bool:
        """Whether dS (or a custom gradient) reads the raw score, keeping S^T live after P."""
        return _reads_score([self.ds_mod, self.dsm_ds, *self._custom_derivatives()])

    @property
    def only_grads_read_score(self) -> bool:
        """Whether a custom gradient's derivative reads the raw score where dS' does not (S^T
        then stays live beside dP^T and dS^T for that gradient alone)."""
        return (_reads_score(self._custom_derivatives())
                and not _reads_score([self.ds_mod, self.dsm_ds]))

    @property
    def chain_rule(self) -> bool:
        """Whether dS' is multiplied by d score_mod / d score (not when that is 1)."""
        return not (self.dsm_ds.op == "const" and float(self.dsm_ds.attr) == 1.0)

    def tile_roots(self, spec: TracedSpec) -> list[Expr]:
        """Every expression a tile loop reads: P, dS', its chain rule, the custom derivatives
        and the mask."""
        roots = [self.p, self.ds_mod, self.dsm_ds, *self._custom_derivatives()]
        return roots + ([spec.mask] if spec.mask is not None else [])

    def _custom_derivatives(self) -> list[Expr]:
        return [d for _, _, d in self.dc_reads] + [g.d_read for g in self.dc_gathers]
