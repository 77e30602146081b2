"""Parameters the backward's kernels share: the inputs, block tables and per-query rows."""

from __future__ import annotations

from engine.codegen.params import KernelParam, custom_param, param
from engine.ir.spec import TracedSpec
from engine.plan.shape import KernelShape


def input_args(spec: TracedSpec, shape: KernelShape, dt: str) -> list[KernelParam]:
    B, Sq, Skv = shape.batch, shape.seqlen_q, shape.seqlen_kv
    return [
        param("Q", (B, Sq, shape.heads_q, shape.head_dim), dt),
        param("K", (B, Skv, shape.heads_kv, shape.head_dim), dt),
        param("V", (B, Skv, shape.heads_kv, shape.head_dim_v), dt),
        param("dO", (B, Sq, shape.heads_q, shape.head_dim_v), dt),
        *(custom_param(f"C_{name}", dims, B, shape.heads_q, Sq, Skv) for name, dims in spec.customs),
    ]


def table_args(suffix: str, shape: KernelShape, n_outer: int, n_inner: int,
               order: bool = False) -> list[KernelParam]:
    """Block tables: per outer block (a thread block's), the range [Lo, Hi) of non-empty inner
    blocks and the class of each (outer, inner) pair; with `order`, the outer blocks longest
    walk first (Ord)."""
    lead = (shape.mask_batch, shape.mask_heads)
    return [
        param(f"Lo{suffix}", (*lead, n_outer), "int32"),
        param(f"Hi{suffix}", (*lead, n_outer), "int32"),
        param(f"Cls{suffix}", (*lead, n_outer, n_inner), "int8"),
    ] + ([param(f"Ord{suffix}", (*lead, n_outer), "int32")] if order else [])


def row_args(spec: TracedSpec, shape: KernelShape) -> list[KernelParam]:
    """The forward's final row scales and (when `bwd` reads it) Delta, [B, Hq, Sq] fp32."""
    rows = (shape.batch, shape.heads_q, shape.seqlen_q)
    names = [f"F_{name}" for name in spec.final_names] + (["Delta"] if spec.uses_doosum else [])
    return [param(name, rows, "float32") for name in names]
