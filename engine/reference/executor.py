"""The reference executor: runs a TracedSpec with plain torch ops on any device.

Two forward modes:
- `materialized`: the whole key range is one block, so each row is normalised in one pass;
  this is the definition the kernels are tested against.
- `online`: the key range is walked block by block, applying `online_fwd` per block exactly as
  a kernel does (block_N columns at a time); it checks the user's online algorithm.

Masked entries take no part in row reductions (they count as the reduction's neutral value),
get p = 0, and a row whose block holds no unmasked key leaves its online state unchanged. A row
with no unmasked key at all outputs zeros; its final row scales are the epilogue's values for
the initial state (lse = -inf for softmax), NaN replaced by the declared initial value.

The backward follows the user's rules: p is recomputed with `forward` from the saved final row
scales, `backward` gives d(score after score_mod), and the chain rule through score_mod uses
its symbolic derivative.
"""

from __future__ import annotations

import math

import torch

from engine.ir.diff import score_mod_derivatives
from engine.ir.spec import TracedSpec
from engine.problem import Problem
from engine.reference.evaluate import Env, evaluate, index_tensors, read_index


def _bhsd(x: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    x = x.transpose(1, 2).to(dtype)
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _mask_tile(spec: TracedSpec, env: Env, kv_idx: torch.Tensor,
               seqlen_kv: int | torch.Tensor) -> torch.Tensor:
    """The mask and the key bound (a length, or per-batch lengths shaped [B, 1, 1, 1])."""
    inb = kv_idx.view(1, 1, 1, -1) < seqlen_kv
    if spec.mask is None:
        return inb
    (m,) = evaluate([spec.mask], env)
    return m & inb


def _env(spec, prob, dtype, device, q_idx, kv_idx, customs) -> Env:
    return Env(
        dtype=dtype,
        device=device,
        index=index_tensors(prob.batch, prob.heads_q, q_idx, kv_idx, device),
        customs=customs,
    )


def forward(
    spec: TracedSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    customs: dict[str, torch.Tensor] | None = None,
    *,
    mode: str = "materialized",
    block_N: int = 64,
    dtype: torch.dtype = torch.float32,
    q_chunk: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns o [B, Sq, Hq, Dv] (in `dtype`) and the final row scales {name: [B, Hq, Sq]}."""
    if mode not in ("materialized", "online"):
        raise ValueError(f"mode={mode!r}: expected 'materialized' or 'online'")
    customs = customs or {}
    prob = Problem.of(q, k, v)
    device = q.device
    qh, kh, vh = _bhsd(q, 1, dtype), _bhsd(k, prob.groups, dtype), _bhsd(v, prob.groups, dtype)
    bn = prob.seqlen_kv if mode == "materialized" else block_N
    if q_chunk is None:
        # Keep the materialised score block near 64M elements.
        q_chunk = max(16, (1 << 26) // max(1, prob.batch * prob.heads_q * bn))
    outs, finals = [], {n: [] for n in spec.final_names}
    for q0 in range(0, prob.seqlen_q, q_chunk):
        q_idx = torch.arange(q0, min(q0 + q_chunk, prob.seqlen_q), device=device)
        o, fin = forward_rows(spec, prob, qh[:, :, q_idx], kh, vh, customs, q_idx, bn, dtype)
        outs.append(o)
        for n in spec.final_names:
            finals[n].append(fin[n])
    o = torch.cat(outs, dim=2).transpose(1, 2)
    return o, {n: torch.cat(f, dim=2).squeeze(-1) for n, f in finals.items()}


def forward_rows(spec, prob, qh, kh, vh, customs, q_idx, bn, dtype, kv_limit=None,
                 custom_at=None):
    """Rows q_idx (positions: [M], or [B, 1, M, 1] per batch as in decode) against keys below
    `kv_limit` (default seqlen_kv; or per batch [B, 1, 1, 1]); `custom_at`: Env.custom_at.
    Returns (o, final row scales)."""
    o, state, seen = online_rows(spec, prob, qh, kh, vh, customs, q_idx, bn, dtype, kv_limit,
                                 custom_at)
    return epilogue_rows(spec, prob, o, state, seen, customs, q_idx, dtype, custom_at)


def online_rows(spec, prob, qh, kh, vh, customs, q_idx, bn, dtype, kv_limit=None,
                custom_at=None, kv_range: tuple[int, int] | None = None):
    """The online pass over keys [kv_range) (default all), block_N = bn at a time: (the
    unnormalised output, the online row scales, whether each row saw a key)."""
    kv_limit = prob.seqlen_kv if kv_limit is None else kv_limit
    k_lo, k_hi = kv_range or (0, prob.seqlen_kv)
    B, H, M = qh.shape[0], qh.shape[1], qh.shape[2]
    device = qh.device
    state = {
        n: torch.full((B, H, M, 1), init, dtype=dtype, device=device)
        for n, init in spec.online_init
    }
    o = torch.zeros(B, H, M, vh.shape[-1], dtype=dtype, device=device)
    seen = torch.zeros(B, H, M, 1, dtype=torch.bool, device=device)
    for k0 in range(k_lo, k_hi, bn):
        kv_idx = torch.arange(k0, min(k0 + bn, k_hi), device=device)
        env = _env(spec, prob, dtype, device, q_idx, kv_idx, customs)
        env.custom_at = custom_at or {}
        s = qh @ kh[:, :, kv_idx].transpose(-1, -2)
        env.leaves["score"] = s
        (s_mod,) = evaluate([spec.score_mod], env)
        mask = _mask_tile(spec, env, kv_idx, kv_limit).expand(B, H, M, len(kv_idx))
        env.leaves["score"] = torch.broadcast_to(s_mod, s.shape)
        env.rowscale = state
        env.mask = mask
        upd_exprs = [e for _, e in spec.online_updates]
        p, o_scale, *new = evaluate([spec.online_p, spec.o_scale, *upd_exprs], env)
        row_any = mask.any(dim=-1, keepdim=True)
        state = {
            n: torch.where(row_any, torch.broadcast_to(val, row_any.shape).to(dtype), state[n])
            for (n, _), val in zip(spec.online_updates, new, strict=True)
        }
        o_scale = torch.where(
            row_any,
            torch.broadcast_to(o_scale, row_any.shape).to(dtype),
            torch.ones((), dtype=dtype, device=device),
        )
        p = torch.where(
            mask,
            torch.broadcast_to(p, s.shape).to(dtype),
            torch.zeros((), dtype=dtype, device=device),
        )
        o = o * o_scale + p @ vh[:, :, kv_idx]
        seen = seen | row_any
    return o, state, seen


def epilogue_rows(spec, prob, o, state, seen, customs, q_idx, dtype, custom_at=None):
    """The epilogue of online_rows' result: (o, final row scales); rows that saw no key
    output zeros and report their final row scales' declared initial values for NaN."""
    device = o.device
    env = _env(spec, prob, dtype, device, q_idx, torch.arange(0, device=device), customs)
    env.custom_at = custom_at or {}
    env.leaves["o"], env.rowscale = o, state
    o_new, *fin = evaluate([spec.epilogue_o, *(e for _, e in spec.epilogue_final)], env)
    zero = torch.zeros((), dtype=dtype, device=device)
    o_new = torch.where(seen, torch.broadcast_to(o_new, o.shape), zero)
    init_final = dict(_final_inits(spec))
    finals = {}
    for (n, _), val in zip(spec.epilogue_final, fin, strict=True):
        val = torch.broadcast_to(val, seen.shape).to(dtype)
        finals[n] = torch.where(
            torch.isnan(val), torch.full((), init_final[n], dtype=dtype, device=device), val
        )
    return o_new, finals


def _final_inits(spec: TracedSpec) -> list[tuple[str, float]]:
    # The declared initial values of final row scales are what rows with no key report.
    return list(spec.final_init)


def backward(
    spec: TracedSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    customs: dict[str, torch.Tensor],
    o: torch.Tensor,
    finals: dict[str, torch.Tensor],
    do: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    q_chunk: int | None = None,
    custom_grads: tuple[str, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Gradients dq, dk, dv (in the inputs' layouts, `dtype`) and {custom name: grad}."""
    prob = Problem.of(q, k, v)
    device = q.device
    G = prob.groups
    qh, kh, vh = _bhsd(q, 1, dtype), _bhsd(k, G, dtype), _bhsd(v, G, dtype)
    oh, doh = _bhsd(o, 1, dtype), _bhsd(do, 1, dtype)
    dscore, dcustom = score_mod_derivatives(spec)
    dq = torch.zeros_like(qh)
    dk = torch.zeros_like(kh)
    dv = torch.zeros_like(vh)
    cgrads = {n: torch.zeros_like(customs[n], dtype=dtype) for n in custom_grads}
    if q_chunk is None:
        q_chunk = max(16, (1 << 25) // max(1, prob.batch * prob.heads_q * prob.seqlen_kv))
    kv_idx = torch.arange(prob.seqlen_kv, device=device)
    for q0 in range(0, prob.seqlen_q, q_chunk):
        q_idx = torch.arange(q0, min(q0 + q_chunk, prob.seqlen_q), device=device)
        qc, doc = qh[:, :, q_idx], doh[:, :, q_idx]
        env = _env(spec, prob, dtype, device, q_idx, kv_idx, customs)
        s = qc @ kh.transpose(-1, -2)
        env.leaves["score"] = s
        (s_mod,) = evaluate([spec.score_mod], env)
        mask = _mask_tile(spec, env, kv_idx, prob.seqlen_kv)
        env.leaves["score"] = torch.broadcast_to(s_mod, s.shape)
        env.final = {n: f.to(dtype)[:, :, q_idx].unsqueeze(-1) for n, f in finals.items()}
        zero = torch.zeros((), dtype=dtype, device=device)
        (p,) = evaluate([spec.fwd_recompute], env)
        p = torch.where(mask, torch.broadcast_to(p, s.shape), zero)
        dv += p.transpose(-1, -2) @ doc
        dp = doc @ vh.transpose(-1, -2)
        env.leaves.update(dp=dp, p=p, doosum=(doc * oh[:, :, q_idx]).sum(-1, keepdim=True))
        (ds_mod,) = evaluate([spec.bwd], env)
        ds_mod = torch.where(mask, torch.broadcast_to(ds_mod, s.shape), zero)
        env.leaves["score"] = s
        (dsm_ds, *dcs) = evaluate([dscore, *(d for _, d in dcustom.values())], env)
        # Masked entries: ds_mod is 0 but score_mod's derivative may be inf there (0 * inf = NaN).
        ds = torch.where(mask, ds_mod * dsm_ds, zero)
        dq[:, :, q_idx] = ds @ kh
        dk += ds.transpose(-1, -2) @ qc
        for (read, _), dcv in zip(dcustom.values(), dcs, strict=True):
            name = read.attr[0]
            if name in cgrads:
                g = torch.where(mask, ds_mod * dcv, zero)
                cgrads[name] += _scatter_custom_grad(customs[name], read_index(read, env), g)
    if G > 1:
        dk = dk.view(prob.batch, prob.heads_kv, G, prob.seqlen_kv, -1).sum(2)
        dv = dv.view(prob.batch, prob.heads_kv, G, prob.seqlen_kv, -1).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), cgrads


def _scatter_custom_grad(t: torch.Tensor, idx: list[torch.Tensor], g: torch.Tensor
                         ) -> torch.Tensor:
    """Accumulate a tile-shaped gradient `g` back into the shape of custom tensor `t`: the
    adjoint of reading `t` at index tensors `idx` (a scatter-add; no autograd, so that it also
    runs inside a custom op, where autograd is off)."""
    shape = torch.broadcast_shapes(g.shape, *(i.shape for i in idx))
    grad = torch.zeros(t.shape, dtype=g.dtype, device=g.device)
    grad.index_put_(tuple(i.expand(shape) for i in idx), g.expand(shape), accumulate=True)
    return grad


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (NaN if either has a NaN)."""
    x64, r64 = x.double(), ref.double()
    if torch.isnan(x64).any() or torch.isnan(r64).any():
        return math.nan
    denom = r64.norm().item()
    return (x64 - r64).norm().item() / (denom if denom > 0 else 1.0)


def first_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    customs: dict[str, torch.Tensor],
    decls: dict[str, tuple],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The inputs of batch 0 and of the query heads that share kv head 0 (custom tensors sliced
    along their declared "batch" and "heads" dims). Attention of this slice is exactly that
    slice of the full problem's output and gradients (b and h indices are unchanged), so a
    kernel run at full size can be checked against a reference that costs 1/(B·Hkv) of it."""
    G = q.shape[2] // k.shape[2]
    out = slice_customs(customs, decls, {"batch": slice(0, 1), "heads": slice(0, G)})
    return q[:1, :, :G], k[:1, :, :1], v[:1, :, :1], out


def slice_customs(customs: dict[str, torch.Tensor], decls: dict[str, tuple],
                  cut: dict[str, slice]) -> dict[str, torch.Tensor]:
    """The custom tensors cut along their declared named dims (`cut`: dim name -> slice),
    other dims whole."""
    return {name: t[tuple(cut.get(d, slice(None)) if isinstance(d, str) else slice(None)
                          for d in decls[name])]
            for name, t in customs.items()}
