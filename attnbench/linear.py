"""Linear-attention cases: the chunked/recurrent layer of engine.variants.linear.

A linear case is a `Case` of kind "linear" whose variant is a `LinearVariant` (Mamba2, simple
GLA, RetNet's linear retention, ...). Its sizes (`linear_sizes`) are the variant's: batch,
heads_q (HQ), heads_k (HK, the case's heads_kv), heads (H, the value and output heads; HQ and
HK divide it), seqlen (T, the case's seqlen_q), head_dim (D) and head_dim_v (Dv). Its inputs, in
the engine's layout (`make_linear_inputs`, from the variant's `make_inputs`):

    q      [B, HQ, T, D]        k  [B, HK, T, D]        v  [B, H, T, Dv]
    decay  [B, H, T] float32    and the variant's custom tensors (dims batch, heads, seq_len or 1)

The layer computes o [B, H, T, Dv]: o_t = sum_{s <= t} (q_t . k_s) exp(G_t - G_s) v_s after the
variant's q/k/v mods, G the running sum of g = decay_mod(decay). Every implementation is checked
against the variant's own torch formulation (`reference_fn`, the quadratic masked form), which
`linear_reference` runs one sequence and group of heads at a time.

A continuation case (seqlen_q < seqlen_kv: generation, or a prefill continued in pieces) is
the last T = seqlen_q positions of sequences of seqlen_kv: its inputs are those positions and
`initial_state` [B, H, D, Dv] float32, the state of the seqlen_kv - T positions before them
(the engine's reference executor over them), and a call returns (o, final state), both
checked: o against `reference_fn` over the whole sequences, the final state against the
reference executor's (`continuation_reference`). Forward only.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attnbench.cases import Case
from engine.dtypes import torch_dtype

LINEAR_TENSORS = ("q", "k", "v", "decay")  # the call's leading tensors, in order
STATE = "initial_state"  # a continuation case's state input (module docstring)
GRAD_TENSORS = ("q", "k", "v")  # checked in every gradient row, with `learned_names`'
REF_CHUNK_ELEMS = 2**28  # T x T elements per reference slice (1 GiB in float32)


def linear_sizes(case: Case) -> dict[str, int]:
    """The variant's size dict of a linear case."""
    return {"batch": case.batch, "heads_q": case.heads_q, "heads_k": case.heads_kv,
            "heads": case.heads, "seqlen": case.seqlen_q, "head_dim": case.head_dim,
            "head_dim_v": case.head_dim_v}


def linear_customs(inputs: dict) -> dict[str, torch.Tensor]:
    """The variant's custom tensors among a linear case's inputs, in the call's order."""
    return {n: t for n, t in inputs.items() if n not in LINEAR_TENSORS and n != STATE}


def is_continuation(case: Case) -> bool:
    """Whether the case continues a state: its T = seqlen_q positions end sequences of
    seqlen_kv (module docstring)."""
    return case.seqlen_q < case.seqlen_kv


def make_linear_inputs(case: Case, variant, device: str,
                       seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The case's inputs (the variant's random tensors, never zeros) and the output gradient
    [B, H, T, Dv] in the input dtype."""
    dtype = torch_dtype(case.dtype)
    inputs = variant.make_inputs(linear_sizes(case), dtype, device, seed, False)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    grad_out = torch.randn(case.batch, case.heads, case.seqlen_q, case.head_dim_v,
                           generator=gen, device=device, dtype=dtype)
    return inputs, grad_out


def batch_major(t: torch.Tensor, batch: int) -> bool:
    """Whether input `t` holds one slice per sequence on its first axis (else the sequences
    share it: Mamba2's A, or a batch of one)."""
    return t.dim() >= 2 and t.shape[0] == batch


def _index(t: torch.Tensor, b: int, heads: slice, case: Case) -> tuple:
    """The part of input `t` that sequence `b`, heads `heads` read: dim 0 is the batch (or 1,
    shared), dim 1 the heads (H: cut; 1: shared); a tensor of fewer dims is shared whole."""
    if t.dim() < 2:
        return ()
    rows = slice(b, b + 1) if batch_major(t, case.batch) else slice(None)
    return (rows, heads if t.shape[1] == case.heads else slice(None))


def head_chunk(case: Case, budget: int | None = None) -> int:
    """Heads per reference slice: all H when q and k have H heads or one (the other head
    counts would need slices on group bounds), else as many as keep T x T per head within
    `budget` elements (default REF_CHUNK_ELEMS)."""
    if {case.heads_q, case.heads_kv} - {1, case.heads}:
        return case.heads
    budget = REF_CHUNK_ELEMS if budget is None else budget
    return max(1, min(case.heads, budget // (case.seqlen_q * case.seqlen_q)))


def linear_reference(case: Case, variant, inputs: dict[str, torch.Tensor],
                     grad_out: torch.Tensor | None, dtype: torch.dtype,
                     with_grads: bool) -> tuple[torch.Tensor, ...]:
    """(o,) or (o, dq, dk, dv, *the learnable inputs' gradients) in the engine's layout and
    `dtype`, from the variant's `reference_fn` run on `dtype` copies of the inputs one (sequence,
    group of heads) at a time: sequences and heads are independent, and the reference
    materialises T x T per head. The learnable inputs are `learned_names`' (one gradient per
    distinct tensor, as a training step's leaves); gradients of inputs a slice shares (one q head
    for all, Mamba2's A) add up over the slices."""
    v = inputs["v"]
    out = torch.empty(case.batch, case.heads, case.seqlen_q, case.head_dim_v, dtype=dtype,
                      device=v.device)
    names = (*GRAD_TENSORS, *learned_names(variant, inputs)) if with_grads else ()
    grads = {n: torch.zeros(inputs[n].shape, dtype=dtype, device=v.device) for n in names}
    per = head_chunk(case)
    for b in range(case.batch):
        for h0 in range(0, case.heads, per):
            heads = slice(h0, min(h0 + per, case.heads))
            sl = slice_inputs(inputs, b, heads, case, dtype)
            where = (slice(b, b + 1), heads)
            if not with_grads:
                with torch.no_grad():
                    out[where] = variant.reference_fn(sl)
                continue
            leaves = [sl[n].requires_grad_(True) for n in names]
            o = variant.reference_fn(sl)
            out[where] = o.detach()
            assert grad_out is not None
            for n, g in zip(names, torch.autograd.grad(o, leaves, grad_out[where].to(o.dtype)),
                            strict=True):
                grads[n][_index(inputs[n], b, heads, case)] += g
    return (out, *grads.values())


def slice_inputs(inputs: dict[str, torch.Tensor], b: int, heads: slice, case: Case,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Sequence `b`, heads `heads` of every input as `dtype` copies, one per distinct tensor
    (Mamba2's dt, the decay and a custom input, stays one tensor: one leaf, one gradient)."""
    copies: dict[int, torch.Tensor] = {}
    return {n: copies.setdefault(id(t), t.detach()[_index(t, b, heads, case)].to(dtype))
            if t.is_floating_point() else t for n, t in inputs.items()}


def learned_names(variant, inputs: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The inputs after q, k, v that a gradient-mode call differentiates, in the call's order
    (decay, then the customs), one name per distinct tensor (its first): the variant's
    learnable inputs and any name sharing a tensor with one (Mamba2's decay is its dt)."""
    learnable = set(getattr(variant, "learnable", ()))
    names = ["decay", *linear_customs(inputs)]
    seen: dict[int, str] = {}
    for n in names:
        t = inputs[n]
        if any(m in learnable for m in names if inputs[m] is t):
            seen.setdefault(id(t), n)
    return tuple(seen.values())


def linear_args(variant, inputs: dict[str, torch.Tensor],
                needs_grad: bool) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """The call's arguments after q, k, v (decay, then the customs in order) and those of them
    that a backward differentiates: in the gradient modes the inputs of `learned_names` are
    fresh leaves, one per distinct tensor (Mamba2's dt is the decay and a custom input: one
    leaf, so that both uses add to one gradient, as in training), in that order."""
    fresh = {id(inputs[n]): inputs[n].detach().clone().requires_grad_(True)
             for n in (learned_names(variant, inputs) if needs_grad else ())}
    args = [fresh.get(id(inputs[n]), inputs[n]) for n in ["decay", *linear_customs(inputs)]]
    return args, tuple(fresh.values())


def decay_needs_grad(variant) -> bool:
    """Whether a gradient-mode call differentiates the variant's decay (after decay_mod): where
    any input is learnable (all of them feed the decay in the library's variants; RetNet's,
    with none, runs the backward without the decays' gradient)."""
    return bool(getattr(variant, "learnable", ()))


def build_linear(case: Case, variant, backend: str):
    """The variant's LinearAttentionEngine for the case's sizes and dtype."""
    return variant.build(linear_sizes(case), torch_dtype(case.dtype), backend=backend)


def _whole(case: Case) -> Case:
    """A continuation case's whole sequences as a case of its own."""
    return replace(case, seqlen_q=case.seqlen_kv)


def _positions(t: torch.Tensor, lo: int, hi: int, length: int) -> torch.Tensor:
    """Positions lo..hi of an input whose dim 2 is the sequence (q, k, v, the decay and the
    custom tensors with a seq_len dim); the others (per head, per batch) whole."""
    return t[:, :, lo:hi] if t.dim() >= 3 and t.shape[2] == length else t


def _reference_module(case: Case, variant, seqlen: int):
    """The variant's LinearAttentionEngine on the engine's reference executor (plain torch,
    float32 math, any device) for `seqlen` positions."""
    return variant.build({**linear_sizes(case), "seqlen": seqlen}, torch_dtype(case.dtype),
                         backend="reference")


def _final_state(case: Case, variant, inputs: dict[str, torch.Tensor], seqlen: int
                 ) -> torch.Tensor:
    """The reference executor's final state [B, H, D, Dv] float32 after positions 0..seqlen."""
    part = {n: _positions(t, 0, seqlen, case.seqlen_kv) for n, t in inputs.items()}
    mod = _reference_module(case, variant, seqlen)
    with torch.no_grad():
        _, state = mod(part["q"], part["k"], part["v"], part["decay"],
                       *linear_customs(part).values(), output_final_state=True)
    return state.float().contiguous()


def make_continuation_inputs(case: Case, variant, device: str, seed: int
                             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the call's inputs: the last seqlen_q positions and STATE, the state before them;
    the whole sequences' inputs, for the reference) of a continuation case."""
    whole = variant.make_inputs(linear_sizes(_whole(case)), torch_dtype(case.dtype), device,
                                seed, False)
    prefix = case.seqlen_kv - case.seqlen_q
    call = {n: _positions(t, prefix, case.seqlen_kv, case.seqlen_kv).contiguous()
            for n, t in whole.items()}
    call[STATE] = _final_state(case, variant, whole, prefix)
    return call, whole


def continuation_reference(case: Case, variant, whole: dict[str, torch.Tensor],
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(o of the last seqlen_q positions from the variant's `reference_fn` over the whole
    sequences, in `dtype`; the final state from the reference executor, float32)."""
    o = linear_reference(_whole(case), variant, whole, None, dtype, False)[0]
    prefix = case.seqlen_kv - case.seqlen_q
    return o[:, :, prefix:], _final_state(case, variant, whole, case.seqlen_kv)
