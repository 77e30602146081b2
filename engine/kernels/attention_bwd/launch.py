"""Build and launch the generated backward kernels (used by TileLangAttention.backward).

launch_backward(bk, q, k, v, o, finals, do, custom) -> (dq, dk, dv, dC) runs
  preprocess (Delta = rowsum(dO * O), only when the spec's bwd reads doosum),
  main (one thread block per kv block x query head x batch, or x kv head walking the GQA
    group's query heads; dQ by TMA reduce-adds into an fp32 buffer, dK and dV by fp32
    atomics over a group's heads unless one thread block walks them),
  postprocess (warp-specialised: a generated kernel turns the fragment-order dQ into rows in
    the input dtype; fp32 dK/dV sums are cast by torch).
Gradients of custom inputs that scale the raw score per (batch, head) (a key gate) come from
q . dQ afterwards (row_dot_grads), not from the kernels.
The block tables are the forward's mask classification transposed: for each kv block the range
of non-empty query blocks, and a query block's tail (rows past Sq) counts as partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ir.spec import TracedSpec
from engine.kernels.attention_bwd.codegen import (
    generate_backward,
    generate_backward_dq,
    generate_dq_postprocess,
    generate_preprocess,
)
from engine.kernels.attention_bwd.exprs import RowDotGrad
from engine.kernels.attention_bwd.plan import DQ_ROW, BackwardPlan, plan_backward
from engine.mask.analysis import FULL, PARTIAL, BlockClasses
from engine.plan.config import KernelConfig
from engine.plan.shape import KernelShape
from engine.reference.evaluate import Env, evaluate, index_tensors
from engine.runtime.kernel import Kernel
from engine.runtime.mask_tables import FORWARD_TABLES, MaskTables, forward_layout


@dataclass
class BackwardKernels:
    """The kernels of one backward plan and their block tables, each compiled on first use;
    `shape` is the one they tile (a dilated mask's folded shape: BackwardPlan.fold)."""

    shape: KernelShape
    plan: BackwardPlan
    main: Kernel
    tables: MaskTables
    preprocess: Kernel | None = None  # Delta, when the spec's bwd reads doosum
    post: Kernel | None = None  # fragment-order dQ into rows (warp-specialised)
    dq: Kernel | None = None  # the dQ kernel (plan.dq_layout "none")
    dq_tables: MaskTables | None = None  # and its (forward-layout) tables

    @property
    def config(self) -> KernelConfig:
        return self.plan.config

    @property
    def deterministic(self) -> bool:
        return self.plan.deterministic

    @property
    def warp_specialized(self) -> bool:
        return self.plan.warp_specialized

    @property
    def heads_loop(self) -> bool:
        return self.plan.heads_loop

    @property
    def custom_grads(self) -> tuple[str, ...]:
        return self.plan.custom_grads

    @property
    def custom_reads(self) -> tuple[tuple[str, tuple], ...]:
        return self.plan.custom_reads

    @property
    def dq_config(self) -> KernelConfig | None:
        return self.plan.dq_config

    @property
    def source(self) -> str:
        return self.main.source

    def kernels(self) -> list[Kernel]:
        return [k for k in (self.main, self.preprocess, self.dq, self.post) if k is not None]

    def sources(self) -> list[str]:
        return [k.source for k in self.kernels()]

    def compile(self) -> None:
        for k in self.kernels():
            k.compiled()


def build_backward(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig,
                   custom_grads: tuple[str, ...] = (), deterministic: bool = False,
                   **forced) -> BackwardKernels:
    """The backward kernels of `spec` at `shape` and `cfg` (already checked), generated (not
    compiled), also producing the gradients of the CustomIO tensors named in `custom_grads`.
    `forced`: plan decisions to force (plan_backward's keyword arguments; tests)."""
    plan = plan_backward(spec, shape, cfg, tuple(custom_grads), deterministic, **forced)
    stride = 1
    if plan.fold is not None:  # a dilated mask's kernels: the folded spec at its tiled shape
        spec, shape, stride = plan.fold.spec, plan.fold.tiled, plan.fold.stride
    tables = MaskTables(spec.mask, shape, cfg.block_M, cfg.block_N,
                        lambda bc: transposed_tables(bc, shape.seqlen_q, cfg.block_M),
                        ("LoT", "HiT", "ClsT", "OrdT"), stride)
    bk = BackwardKernels(shape, plan, Kernel(generate_backward(spec, shape, plan)), tables)
    if plan.preprocess:
        bk.preprocess = Kernel(generate_preprocess(shape))
    if plan.dq_layout == "fragment":
        bk.post = Kernel(generate_dq_postprocess(shape, cfg))
    if plan.dq_config is not None:
        dq_cfg = plan.dq_config
        bk.dq = Kernel(generate_backward_dq(spec, shape, dq_cfg, plan.fold))
        bk.dq_tables = MaskTables(spec.mask, shape, dq_cfg.block_M, dq_cfg.block_N, forward_layout,
                                  FORWARD_TABLES, stride)
    return bk


def transposed_tables(
    bc: BlockClasses, seqlen_q: int, block_M: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(LoT, HiT, ClsT, OrdT): per kv block, the non-empty query blocks [LoT, HiT) and the
    classes [.., kv block, q block]; a full block that holds the query tail becomes partial.
    OrdT lists the kv blocks longest walk first (ties in key order), the launch order of the
    warp-specialised kernel's panels: started last, a long block leaves the machine a tail
    (a document mask's longest blocks start its documents, not the sequence)."""
    cls = bc.classes.clone()
    if seqlen_q % block_M:
        last = cls[:, :, -1, :]  # where, not a masked store: no read back inside a capture
        last.copy_(torch.where(last == FULL, PARTIAL, last))
    clsT = cls.transpose(-1, -2).contiguous()
    lo, hi = BlockClasses(clsT, bc.block_N, block_M, bc.seqlen_kv, seqlen_q).loop_bounds()
    return lo, hi, clsT, torch.sort(lo - hi, dim=-1, stable=True).indices.to(torch.int32)


def launch_backward(
    bk: BackwardKernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    finals: list[torch.Tensor],
    do: torch.Tensor,
    custom: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """dq, dk, dv (input dtype and layouts) for output gradient `do`, and the gradients of the
    CustomIO tensors named in bk.custom_grads (each in its tensor's dtype).

    `finals` are the forward's final row scales ([B, Hq, Sq] fp32, in spec.final_names order);
    `custom` the CustomIO tensors by name."""
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    if bk.plan.fold is not None:
        return _folded(bk, q, k, v, o, finals, do)
    dq, dk, dv, cg = _launch(bk, q, k, v, o, finals, do, custom)
    if bk.plan.row_dot_grads:
        cg.update(row_dot_grads(bk.plan.row_dot_grads, q, dq, custom))
    return dq, dk, dv, cg


def row_dot_grads(grads: tuple[RowDotGrad, ...], q: torch.Tensor, dq: torch.Tensor,
                  custom: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients of custom inputs that scale the raw score per (batch, head)
    (exprs.RowDotGrad): coef * sum_i q_i . dQ_i per (batch, head) ([B, S, Hq, D] q and dq),
    summed into each custom tensor's layout and dtype."""
    B, _, H, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dots = (q * dq).sum(dim=(1, 3), dtype=acc)  # [B, Hq]
    # Nothing copied from the host and custom reads as views (Env.ranges), not gathers: either
    # would wait for the backward's kernels (a pageable copy, a 0-dim index), and the next
    # step's launches after them.
    none = torch.zeros(1, dtype=torch.long, device=q.device)
    env = Env(dtype=acc, device=q.device, index=index_tensors(B, H, none, none, q.device),
              customs={n: t.detach().to(acc) for n, t in custom.items()},
              ranges={"b": (0, B), "h": (1, H)})
    out: dict[str, torch.Tensor] = {}
    for g, coef in zip(grads, evaluate([g.coef for g in grads], env), strict=True):
        rows = (torch.broadcast_to(coef, (B, H, 1, 1)).reshape(B, H) * dots).unsqueeze(-1)
        grad = fold_rows(rows, g.index, tuple(custom[g.name].shape))
        out[g.name] = out[g.name] + grad if g.name in out else grad
    return {n: t.to(custom[n].dtype) for n, t in out.items()}


def _folded(bk: BackwardKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            o: torch.Tensor, finals: list[torch.Tensor], do: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A folded backward (engine.plan.fold): the inputs and gradients as views of the tiled
    shape, the row scales copied into its [B, stride * Hq, S / stride] rows."""
    t, d = bk.shape, bk.plan.fold.stride
    q, o, do = (x.view(t.batch, t.seqlen_q, t.heads_q, -1) for x in (q, o, do))
    k, v = (x.view(t.batch, t.seqlen_kv, t.heads_kv, -1) for x in (k, v))
    rows = [f.detach().float().view(t.batch, -1, t.seqlen_q, d).permute(0, 3, 1, 2)
            .reshape(t.batch, t.heads_q, t.seqlen_q) for f in finals]
    dq, dk, dv, _ = _launch(bk, q, k, v, o, rows, do, {})
    return (dq.view(t.batch, t.seqlen_q * d, t.heads_q // d, -1),
            *(x.view(t.batch, t.seqlen_kv * d, t.heads_kv // d, -1) for x in (dk, dv)), {})


def _launch(bk: BackwardKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            o: torch.Tensor, finals: list[torch.Tensor], do: torch.Tensor,
            custom: dict[str, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    p, dev = bk.shape, q.device
    names = [prm.name for prm in bk.main.params if prm.name.startswith("F_")]
    rows = dict(zip(names, (f.detach().float().contiguous() for f in finals), strict=True))
    if bk.preprocess is not None:
        rows["Delta"] = torch.empty(p.batch, p.heads_q, p.seqlen_q, dtype=torch.float32, device=dev)
        bk.preprocess(O=o, dO=do, Delta=rows["Delta"])
    inputs = {"Q": q, "K": k, "V": v, "dO": do,
              **{f"C_{n}": t.detach().float().contiguous() for n, t in custom.items()}, **rows}
    z = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=dev)  # noqa: E731
    dc = {n: z(*custom[n].shape) for n in bk.custom_grads}
    # Stored once: each element has one writer, in the input dtype (no zeroing, no cast).
    kv = ((lambda *shape: torch.empty(shape, dtype=q.dtype, device=dev))
          if bk.plan.kv_store == "once" else z)
    tables = bk.tables.named(custom, dev)
    if bk.deterministic:
        dk, dv, dq = _deterministic(bk, inputs, tables, custom, dc, kv, z)
    else:
        dk = kv(p.batch, p.seqlen_kv, p.heads_kv, p.head_dim)
        dv = kv(p.batch, p.seqlen_kv, p.heads_kv, p.head_dim_v)
        grads = {f"dC_{n}": g for n, g in dc.items()}
        if bk.plan.dq_layout == "fragment":
            bM = bk.config.block_M
            acc = z(p.batch, p.heads_q, -(-p.seqlen_q // bM), bM * p.head_dim // DQ_ROW, DQ_ROW)
            bk.main(**inputs, **tables, dQ=acc, dK=dk, dV=dv, **grads)
            dq = torch.empty_like(q)
            bk.post(acc=acc, dQ=dq)
        elif bk.plan.dq_layout == "none":
            bk.main(**inputs, **tables, dK=dk, dV=dv, **grads)
            dq = _dq_kernel(bk, inputs, custom)
        else:
            dq_bhsd = z(p.batch, p.heads_q, p.seqlen_q, p.head_dim)  # the main kernel's layout
            bk.main(**inputs, **tables, dQ=dq_bhsd, dK=dk, dV=dv, **grads)
            dq = dq_bhsd.transpose(1, 2)
    cg = {n: g.to(custom[n].dtype) for n, g in dc.items()}
    if dq.dtype != q.dtype:
        dq = torch.empty_like(q).copy_(dq)  # cast (and, fast mode, transpose) in one pass
    return dq, dk.to(q.dtype), dv.to(q.dtype), cg  # .to: no copy when stored once


def _dq_kernel(bk: BackwardKernels, inputs: dict, custom: dict) -> torch.Tensor:
    """dQ [B, Sq, Hq, D] in the input dtype from the dQ kernel, which writes every element
    once (a query block without keys writes zeros)."""
    p, q = bk.shape, inputs["Q"]
    dq = torch.empty(p.batch, p.seqlen_q, p.heads_q, p.head_dim, dtype=q.dtype, device=q.device)
    bk.dq(**inputs, **bk.dq_tables.named(custom, q.device), dQ=dq)
    return dq


def _deterministic(bk: BackwardKernels, inputs: dict, tables: dict, custom: dict, dc: dict,
                   kv, z) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dk, dv, dq) of the atomic-free kernels: dK/dV per query head and custom gradients per
    key row from the main kernel, dQ from the dQ kernel, then fixed-order sums."""
    p = bk.shape
    G = p.heads_q // p.heads_kv
    dkh = kv(p.batch, p.seqlen_kv, p.heads_q, p.head_dim)
    dvh = kv(p.batch, p.seqlen_kv, p.heads_q, p.head_dim_v)
    rows = {f"dCrow{r}": z(p.batch, p.heads_q, p.seqlen_kv) for r in range(len(bk.custom_reads))}
    bk.main(**inputs, **tables, dK=dkh, dV=dvh, **rows)
    dq = _dq_kernel(bk, inputs, custom)
    # Fixed-order sums: the query heads of each group (none without GQA: a sum over one head
    # would copy), and the rows of each custom read.
    dk, dv = dkh, dvh
    if G > 1:
        dk = dkh.view(p.batch, p.seqlen_kv, p.heads_kv, G, p.head_dim).sum(3)
        dv = dvh.view(p.batch, p.seqlen_kv, p.heads_kv, G, p.head_dim_v).sum(3)
    for (name, index), row in zip(bk.custom_reads, rows.values(), strict=True):
        dc[name] += fold_rows(row, index, tuple(custom[name].shape))
    return dk, dv, dq


def fold_rows(rows: torch.Tensor, index: tuple, shape: tuple[int, ...]) -> torch.Tensor:
    """A custom read's gradient from its per-(b, h, key) partial sums `rows` [B, Hq, Skv]:
    summed over the axes the read's index does not use, laid out as the custom tensor."""
    axis = {"b": 0, "h": 1, "kv": 2}
    used = [axis[s] for s in index if isinstance(s, str)]
    kept = rows.sum(dim=[a for a in range(3) if a not in used]) if len(used) < 3 else rows
    # kept's axes are the used ones in ascending order; put them in index order.
    kept = kept.permute(*[sorted(used).index(a) for a in used]) if used else kept
    return kept.reshape(shape)
