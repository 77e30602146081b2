"""The main kernel's frame: every text its pieces share, derived once from the spec, the
shape and the plan. The kernel works in the transposed frame: fragment rows i are keys,
columns j queries, so that P^T and dS^T feed the dV and dK wgmmas from registers."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.ir.spec import TracedSpec
from engine.kernels.attention_bwd.codegen.tiles import Bind, Dims, binder, dims, mask_text
from engine.kernels.attention_bwd.codegen.vectors import VectorGroup, hoisted_vectors, row_vectors
from engine.kernels.attention_bwd.exprs import BackwardExprs
from engine.kernels.attention_bwd.plan import BackwardPlan
from engine.plan.fold import index_texts
from engine.plan.shape import KernelShape


@dataclass(frozen=True)
class Frame:
    spec: TracedSpec
    shape: KernelShape
    plan: BackwardPlan
    ex: BackwardExprs
    d: Dims
    head: str  # the query head's text: hq when walking the heads, else by
    policy: str  # the gemms' warp policy
    # fp32 registers per thread of a [bN, bM] tile, of dq, dk and dv (wgmma spreads them evenly)
    tile_regs: int
    dq_regs: int
    dk_regs: int
    dv_regs: int
    q_idx: str  # the query (column j) and key (row i) of fragment element [i, j]
    kv_idx: str
    bind: Bind
    index_text: dict[str, str]
    mask: str  # what partial blocks evaluate
    finals: VectorGroup
    delta: VectorGroup
    by_kv: VectorGroup  # hoisted custom reads per key, loaded once
    by_q: VectorGroup  # and per query, each step
    # A step's Q, dO, dS^T and (head-split) P^T in shared memory (the ring's stage when
    # warp-specialised).
    q_sh: str
    do_sh: str
    ds_sh: str
    p_sh: str
    step: str = "k"  # the step whose ring stage q_sh, do_sh and the vectors' rings name

    def at_step(self, step: str) -> Frame:
        """The warp-specialised frame with Q, dO and the per-query vectors read from `step`'s
        ring stage (the next step's products, issued ahead: plan.products_ahead)."""
        st = self.plan.config.num_stages
        ring = (f"{step} % {st}", st)
        q_sh, do_sh = _qdo_stage(step, st)
        return replace(self, step=step, q_sh=q_sh, do_sh=do_sh,
                       finals=replace(self.finals, ring=ring), delta=replace(self.delta, ring=ring),
                       by_q=replace(self.by_q, ring=ring))

    @property
    def lo(self) -> str:
        return f"LoT[{self.d.mb}, {self.d.mh}, bx]"

    @property
    def hi(self) -> str:
        return f"HiT[{self.d.mb}, {self.d.mh}, bx]"

    def ds_at(self, i: str, j: str) -> str:
        """Element [i, j] of the step's dS^T in shared memory."""
        ring = "k % 2, " if self.plan.warp_specialized else ""
        return f"dsT_shared[{ring}{i}, {j}]"

    @property
    def q_rows(self) -> str:
        return f"qb * {self.d.bM}:(qb + 1) * {self.d.bM}"


def _qdo_stage(step: str, stages: int) -> tuple[str, str]:
    """Q's and dO's ring stage of `step` (warp-specialised)."""
    return f"Q_shared[{step} % {stages}, :, :]", f"dO_shared[{step} % {stages}, :, :]"


def frame(spec: TracedSpec, shape: KernelShape, plan: BackwardPlan) -> Frame:
    cfg = plan.config
    d = dims(shape, cfg)
    ex = BackwardExprs(spec, plan.custom_grads, plan.deterministic)
    head = "hq" if plan.heads_loop else "by"
    q_row, kv_row = f"(qb * {d.bM} + j)", f"(bx * {d.bN} + i)"
    q_idx, kv_idx, h = index_texts(plan.fold, q_row, kv_row, head)
    st = cfg.num_stages
    ring = (f"k % {st}", st) if plan.warp_specialized else None
    # Per-query vectors of whole query blocks come by TMA in the warp-specialised schedule:
    # filled element by element, the producer warp waited for their loads before each arrive
    # (NOTES 128, 129). A tail block, or dynamic shapes, keep the element fill and its clamp.
    whole = plan.warp_specialized and not shape.dynamic and shape.seqlen_q % d.bM == 0
    q_block = f"qb * {d.bM}:(qb + 1) * {d.bM}" if whole else ""
    hoisted, by_kv, by_q = hoisted_vectors(plan.hoisted, shape, d.bN, f"qb * {d.bM}", head,
                                           ring[0] if plan.q_reads_in_ring else None, q_block)
    finals, delta = row_vectors(spec, shape, f"qb * {d.bM}", head, q_block)
    bind, index_text = binder(shape, q_idx, kv_idx, {"rawscore": "sT", "dp": "dpT", "p": "pT"},
                              "j", hoisted, h, ring[0] if plan.rows_in_ring else None)
    if plan.warp_specialized:
        (q_sh, do_sh), ds_sh, p_sh = _qdo_stage("k", st), "dsT_shared[k % 2, :, :]", \
            "pT_shared[k % 2, :, :]"
    else:
        q_sh, do_sh, ds_sh, p_sh = "Q_shared", "dO_shared", "dsT_shared", "pT_shared"
    return Frame(
        spec=spec, shape=shape, plan=plan, ex=ex, d=d, head=head,
        policy=f"T.GemmWarpPolicy.{cfg.gemm_policy}",
        tile_regs=d.bN * d.bM // cfg.threads, dq_regs=d.bM * d.D // cfg.threads,
        dk_regs=d.bN * d.D // cfg.threads, dv_regs=d.bN * d.Dv // cfg.threads,
        q_idx=q_idx, kv_idx=kv_idx, bind=bind,
        index_text=index_text, mask=mask_text(spec, bind, q_row, kv_row, shape),
        finals=VectorGroup(tuple(finals), d.bM, ring, in_registers=not plan.rows_in_ring),
        delta=VectorGroup(tuple(delta), d.bM, ring, in_registers=not plan.rows_in_ring),
        by_kv=VectorGroup(tuple(by_kv), d.bN),
        by_q=VectorGroup(tuple(by_q), d.bM, ring, in_registers=not plan.q_reads_in_ring),
        q_sh=q_sh, do_sh=do_sh, ds_sh=ds_sh, p_sh=p_sh,
    )
