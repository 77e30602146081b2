"""Parameters the backward's kernels share: the inputs, block tables and per-query rows."""

from __future__ import annotations

from engine.codegen.emit import custom_decl
from engine.ir.spec import TracedSpec
from engine.plan.shape import KernelShape


def input_args(spec: TracedSpec, shape: KernelShape, dt: str) -> list[str]:
    B, Sq, Skv = shape.batch, shape.seqlen_q, shape.seqlen_kv
    args = [
        f'Q: T.Tensor(({B}, {Sq}, {shape.heads_q}, {shape.head_dim}), "{dt}")',
        f'K: T.Tensor(({B}, {Skv}, {shape.heads_kv}, {shape.head_dim}), "{dt}")',
        f'V: T.Tensor(({B}, {Skv}, {shape.heads_kv}, {shape.head_dim_v}), "{dt}")',
        f'dO: T.Tensor(({B}, {Sq}, {shape.heads_q}, {shape.head_dim_v}), "{dt}")',
    ]
    return args + [custom_decl(f"C_{name}", dims, B, shape.heads_q, Sq, Skv)
                   for name, dims in spec.customs]


def table_args(suffix: str, shape: KernelShape, n_outer: int, n_inner: int,
               order: bool = False) -> list[str]:
    """Block tables: per outer block (a thread block's), the range [Lo, Hi) of non-empty inner
    blocks and the class of each (outer, inner) pair; with `order`, the outer blocks longest
    walk first (Ord)."""
    lead = f"{shape.mask_batch}, {shape.mask_heads}"
    return [
        f'Lo{suffix}: T.Tensor(({lead}, {n_outer}), "int32")',
        f'Hi{suffix}: T.Tensor(({lead}, {n_outer}), "int32")',
        f'Cls{suffix}: T.Tensor(({lead}, {n_outer}, {n_inner}), "int8")',
    ] + ([f'Ord{suffix}: T.Tensor(({lead}, {n_outer}), "int32")'] if order else [])


def row_args(spec: TracedSpec, shape: KernelShape) -> list[str]:
    """The forward's final row scales and (when `bwd` reads it) Delta, [B, Hq, Sq] fp32."""
    rows = f"({shape.batch}, {shape.heads_q}, {shape.seqlen_q})"
    args = [f'F_{name}: T.Tensor({rows}, "float32")' for name in spec.final_names]
    if spec.uses_doosum:
        args.append(f'Delta: T.Tensor({rows}, "float32")')
    return args
