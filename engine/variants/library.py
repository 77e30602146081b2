"""The variant library: each entry is the engine spec of a known attention variant plus an
independent plain-torch formulation (and FlexAttention/SDPA forms where those can express it).

All softmax-family variants scale scores by 1/sqrt(D) inside score_mod, as in the seeds.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from engine.dsl.expr import where
from engine.dsl.io import CustomIO
from engine.dsl.online import OnlineIdentity, OnlineRetention, OnlineSoftmax
from engine.variants.base import SpecParts, Variant

SLIDING_WINDOW = 1024
PREFIX = 1024
SOFTCAP = 30.0
DOC_BOUNDS = (0.15, 0.45, 0.7)  # fractions of the sequence where documents start


def _scale(sz: dict) -> float:
    return 1.0 / math.sqrt(sz["head_dim"])


def _no_customs(sz, gen):
    return {}


def _scores(q, k, scale):
    # q, k: [B, S, H, D] -> [B, H, Sq, Skv]
    return torch.einsum("bqhd,bkhd->bhqk", q, k) * scale


def _pv(p, v):
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _idx(sz, device):
    q = torch.arange(sz["seqlen_q"], device=device).view(-1, 1)
    kv = torch.arange(sz["seqlen_kv"], device=device).view(1, -1)
    return q, kv


def _softmax_ref(mask_fn, mod_fn=None):
    def ref(q, k, v, customs, sz):
        s = _scores(q, k, _scale(sz))
        qi, ki = _idx(sz, q.device)
        if mod_fn is not None:
            s = mod_fn(s, customs, qi, ki)
        if mask_fn is not None:
            m = mask_fn(customs, qi, ki)
            s = s.masked_fill(~m, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # fully masked rows give zeros
        return _pv(p, v)

    return ref


# ---------------------------------------------------------------- masks (engine DSL form)
def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window(width: int):
    """Causal with a sliding window of `width` keys, for symbols and tensors alike."""
    def allowed(q, k):
        return (q >= k) & (q - k < width)

    return allowed


def _softmax_spec(mask_mod, extra_mod=None, customs=None):
    def make(sz):
        scale = _scale(sz)
        cio = CustomIO(customs or {})

        def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
            s = score * scale
            return extra_mod(s, custom_fwd_inputs, b, h, q_idx, kv_idx) if extra_mod else s

        mm = (
            mask_mod(cio)
            if (mask_mod is not None and getattr(mask_mod, "needs_io", False))
            else mask_mod
        )
        return SpecParts(score_mod, mm, OnlineSoftmax(), cio)

    return make


def _flex(mask_fn=None, mod_fn=None):
    def make(customs, sz):
        def score_mod(score, b, h, q_idx, kv_idx):
            return mod_fn(score, customs, b, h, q_idx, kv_idx) if mod_fn else score

        def mask_mod(b, h, q_idx, kv_idx):
            return mask_fn(customs, b, h, q_idx, kv_idx)

        return (score_mod if mod_fn else None), (mask_mod if mask_fn else None)

    return make


def _mask_variant(name: str, description: str, causal: bool, allowed) -> Variant:
    """Softmax under a mask of the positions alone: `allowed(q, kv)`, written once for the
    DSL, torch and flex (the same operators on symbols and on tensors)."""
    return Variant(name, description, "softmax", name, causal,
                   _softmax_spec(lambda b, h, q, k: allowed(q, k)), _no_customs,
                   _softmax_ref(lambda c, q, k: allowed(q, k)),
                   flex_fn=_flex(lambda c, b, h, q, k: allowed(q, k)))


# ---------------------------------------------------------------- ALiBi
def _alibi_slopes(sz, gen):
    H = sz["heads_q"]
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)])
    return {"alibi_slopes": base * (1.0 + 0.05 * torch.rand(H, generator=gen))}


def _alibi_mod(s, io, b, h, q_idx, kv_idx):
    return s + io["alibi_slopes"] * (kv_idx - q_idx)


# ---------------------------------------------------------------- soft-capping
def _softcap(cap: float):
    """cap * tanh(s / cap) as a score_mod (DSL), and as the same function of a tensor."""
    def mod(s, io, b, h, q_idx, kv_idx):
        return (s * (1.0 / cap)).tanh() * cap

    return mod, lambda s: cap * torch.tanh(s / cap)


# ---------------------------------------------------------------- document mask
def _doc_ids(sz, gen):
    S = sz["seqlen_q"]
    ids = torch.zeros(sz["batch"], S)
    for f in DOC_BOUNDS:
        ids[:, int(f * S) :] += 1
    return {"doc_ids": ids}


def _document_mask_for(io: CustomIO):
    doc = io["doc_ids"]

    def document_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    return document_mask


_document_mask_for.needs_io = True


# ---------------------------------------------------------------- sigmoid attention
def _sigmoid_bias(sz, gen):
    H = sz["heads_q"]
    return {"bias": -math.log(sz["seqlen_kv"]) + 0.1 * torch.randn(H, generator=gen)}


def _sigmoid_spec(sz):
    scale = _scale(sz)

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return (score * scale + custom_fwd_inputs["bias"]).sigmoid()

    return SpecParts(score_mod, None, OnlineIdentity(), CustomIO({"bias": ("heads",)}))


def _sigmoid_ref(q, k, v, customs, sz):
    s = _scores(q, k, _scale(sz)) + customs["bias"].view(1, -1, 1, 1)
    return _pv(torch.sigmoid(s), v)


# ---------------------------------------------------------------- ReLU attention
def _relu_spec(sz):
    scale, inv_n = _scale(sz), 1.0 / sz["seqlen_kv"]

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return (score * scale).max(0.0) * inv_n

    return SpecParts(score_mod, None, OnlineIdentity(), CustomIO({}))


def _relu_ref(q, k, v, customs, sz):
    return _pv(torch.relu(_scores(q, k, _scale(sz))) / sz["seqlen_kv"], v)


# ---------------------------------------------------------------- RetNet parallel retention
def _retnet_decay(sz, gen):
    H = sz["heads_q"]
    gamma = 1.0 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H))
    return {"log_decay": torch.log(gamma)}


def _retnet_spec(sz):
    scale = _scale(sz)

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        decay = ((q_idx - kv_idx) * custom_fwd_inputs["log_decay"]).exp()
        return score * scale * decay

    return SpecParts(score_mod, causal_mask, OnlineRetention(), CustomIO({"log_decay": ("heads",)}))


def _retnet_ref(q, k, v, customs, sz):
    qi, ki = _idx(sz, q.device)
    # exp of the clamped distance: above the diagonal the unclamped exponent overflows to inf.
    dist = (qi - ki).clamp(min=0).to(q.dtype)
    decay = torch.exp(dist.view(1, 1, *dist.shape) * customs["log_decay"].view(1, -1, 1, 1))
    decay = torch.where(qi >= ki, decay, torch.zeros((), dtype=q.dtype, device=q.device))
    s = _scores(q, k, _scale(sz)) * decay
    r = s.abs().sum(-1, keepdim=True).clamp(min=1.0)
    return _pv(s / r, v)


# ---------------------------------------------------------------- the table
def _causal_t(c, q, k):
    return q >= k


VARIANTS: dict[str, Variant] = {}


def _add(v: Variant) -> None:
    VARIANTS[v.name] = v


_add(
    Variant(
        "softmax",
        "softmax attention, no mask",
        "softmax",
        "none",
        False,
        _softmax_spec(None),
        _no_customs,
        _softmax_ref(None),
        flex_fn=None,
        sdpa_causal=False,
    )
)
_add(
    Variant(
        "softmax_causal",
        "causal softmax attention",
        "softmax",
        "causal",
        True,
        _softmax_spec(causal_mask),
        _no_customs,
        _softmax_ref(_causal_t),
        flex_fn=_flex(lambda c, b, h, q, k: q >= k),
        sdpa_causal=True,
    )
)
# Same spec as softmax_causal; suites pair it with grouped-query shapes.
_add(
    dataclasses.replace(
        VARIANTS["softmax_causal"], name="softmax_gqa",
        description="causal softmax attention (grouped-query shapes)",
    )
)
_add(
    Variant(
        "alibi",
        "causal softmax with ALiBi slopes per head (learnable)",
        "softmax",
        "causal",
        True,
        _softmax_spec(causal_mask, _alibi_mod, {"alibi_slopes": ("heads",)}),
        _alibi_slopes,
        _softmax_ref(
            _causal_t, lambda s, c, q, k: s + c["alibi_slopes"].view(1, -1, 1, 1) * (k - q)
        ),
        flex_fn=_flex(
            lambda c, b, h, q, k: q >= k,
            lambda s, c, b, h, q, k: s + c["alibi_slopes"][h] * (k - q),
        ),
        learnable=("alibi_slopes",),
    )
)
_add(
    Variant(
        "softcap",
        f"causal softmax with tanh soft-capping at {SOFTCAP:g}",
        "softmax",
        "causal",
        True,
        _softmax_spec(causal_mask, _softcap(SOFTCAP)[0]),
        _no_customs,
        _softmax_ref(_causal_t, lambda s, c, q, k: _softcap(SOFTCAP)[1](s)),
        flex_fn=_flex(lambda c, b, h, q, k: q >= k,
                      lambda s, c, b, h, q, k: _softcap(SOFTCAP)[1](s)),
    )
)
_add(_mask_variant("sliding_window", f"causal sliding-window softmax (window {SLIDING_WINDOW})",
                   True, _window(SLIDING_WINDOW)))
_add(
    Variant(
        "document",
        "causal softmax over packed documents (document ids per token)",
        "softmax",
        "document",
        True,
        _softmax_spec(_document_mask_for, None, {"doc_ids": ("batch", "seq_len")}),
        _doc_ids,
        _softmax_ref(
            lambda c, q, k: (
                (q >= k)
                & (
                    c["doc_ids"][:, q.view(-1)].unsqueeze(-1)
                    == c["doc_ids"][:, k.view(-1)].view(-1, 1, k.numel())
                ).unsqueeze(1)
            )
        ),
        flex_fn=_flex(lambda c, b, h, q, k: (q >= k) & (c["doc_ids"][b, q] == c["doc_ids"][b, k])),
        needs_equal_seqlens=True,
    )
)
_add(_mask_variant("prefix_lm", f"prefix-LM softmax (bidirectional prefix of {PREFIX}, causal "
                   "after)", False, lambda q, k: (k < PREFIX) | (q >= k)))
_add(
    Variant(
        "sigmoid",
        "sigmoid attention with a learnable per-head bias",
        "sigmoid",
        "none",
        False,
        _sigmoid_spec,
        _sigmoid_bias,
        _sigmoid_ref,
        learnable=("bias",),
    )
)
_add(
    Variant(
        "relu",
        "ReLU attention (relu(q.k/sqrt(D)) / Skv)",
        "relu",
        "none",
        False,
        _relu_spec,
        _no_customs,
        _relu_ref,
    )
)
_add(
    Variant(
        "retnet",
        "RetNet parallel retention, per-head decay (learnable log decay)",
        "retention",
        "causal",
        True,
        _retnet_spec,
        _retnet_decay,
        _retnet_ref,
        learnable=("log_decay",),
    )
)


# ---------------------------------------------------------------- reach (issue 19): what people
# write for FlexAttention - table lookups, index arithmetic, learned gates
T5_BUCKETS = 32  # causal T5: exact distances below 16, log-spaced up to 128, then the last
DILATION = 2
IMAGE_WIDTH = 64  # the 2-D neighbourhood mask: tokens are an image of 64-pixel rows
NEIGHBOURHOOD = 8  # radius of the window, in rows and columns


def _rel_bias_table(sz, gen):
    return {"rel_bias": 0.5 * torch.randn(sz["heads_q"], sz["seqlen_q"] + sz["seqlen_kv"] - 1,
                                          generator=gen)}


def t5_bucket(rel):
    """T5's causal bucket of rel = q_idx - kv_idx (clamped at 0): the distance itself below 16,
    then 16 log-spaced buckets up to 128, the last one beyond. Written in torch, as FlexAttention
    users write it; the same function traces into the DSL."""
    d = torch.clamp(rel, min=0)
    far = (16 + torch.log(d.float() / 16.0) * (16 / math.log(8))).long()
    return torch.where(d < 16, d, torch.clamp(far, max=T5_BUCKETS - 1))


def _t5_table(sz, gen):
    return {"t5_bias": 0.5 * torch.randn(sz["heads_q"], T5_BUCKETS, generator=gen)}


def _gate(sz, gen):
    return {"key_gate": torch.randn(sz["heads_q"], generator=gen)}


def _dilated(q, k):
    return (q >= k) & ((q - k) % DILATION == 0)


def _neighbourhood(q, k):
    rows = (q // IMAGE_WIDTH - k // IMAGE_WIDTH).abs() <= NEIGHBOURHOOD
    return rows & ((q % IMAGE_WIDTH - k % IMAGE_WIDTH).abs() <= NEIGHBOURHOOD)


def _rel_bias_spec(sz):
    """The table spans every q_idx - kv_idx, read at offset Skv - 1."""
    skv = sz["seqlen_kv"]

    def mod(s, io, b, h, q_idx, kv_idx):
        return s + io["rel_bias"][h, q_idx - kv_idx + (skv - 1)]

    return _softmax_spec(causal_mask, mod, {"rel_bias": ("heads", sz["seqlen_q"] + skv - 1)})(sz)


def _rel_bias_flex(customs, sz):
    skv = sz["seqlen_kv"]
    return _flex(lambda c, b, h, q, k: q >= k,
                 lambda s, c, b, h, q, k: s + c["rel_bias"][h, q - k + skv - 1])(customs, sz)


def _rel_bias_ref(q, k, v, customs, sz):
    skv = sz["seqlen_kv"]
    return _softmax_ref(_causal_t, lambda s, c, qi, ki: s + c["rel_bias"][:, qi - ki + skv - 1])(
        q, k, v, customs, sz)


_add(
    Variant(
        "rel_bias",
        "causal softmax with a learnable relative-position bias table (heads x (Sq + Skv - 1))",
        "softmax",
        "causal",
        True,
        _rel_bias_spec,
        _rel_bias_table,
        _rel_bias_ref,
        flex_fn=_rel_bias_flex,
        learnable=("rel_bias",),
    )
)
_add(
    Variant(
        "t5_bias",
        f"causal softmax with T5's learnable relative buckets ({T5_BUCKETS} per head, log-spaced)",
        "softmax",
        "causal",
        True,
        _softmax_spec(causal_mask, lambda s, io, b, h, q, k: s + io["t5_bias"][h, t5_bucket(q - k)],
                      {"t5_bias": ("heads", T5_BUCKETS)}),
        _t5_table,
        _softmax_ref(_causal_t, lambda s, c, q, k: s + c["t5_bias"][:, t5_bucket(q - k)]),
        flex_fn=_flex(lambda c, b, h, q, k: q >= k,
                      lambda s, c, b, h, q, k: s + c["t5_bias"][h, t5_bucket(q - k)]),
        learnable=("t5_bias",),
    )
)
_add(_mask_variant("dilated", f"causal softmax over every {DILATION}nd key (a dilated mask)",
                   True, _dilated))
_add(_mask_variant(
    "neighbourhood_2d",
    f"softmax over a {2 * NEIGHBOURHOOD + 1}x{2 * NEIGHBOURHOOD + 1} pixel neighbourhood "
    f"(tokens: an image {IMAGE_WIDTH} pixels wide)", False, _neighbourhood))
_add(
    Variant(
        "key_gate",
        "causal softmax with a learnable per-head key gate (q.k * sigmoid(gate[h]))",
        "softmax",
        "causal",
        True,
        _softmax_spec(causal_mask, lambda s, io, b, h, q, k: s * io["key_gate"].sigmoid(),
                      {"key_gate": ("heads",)}),
        _gate,
        _softmax_ref(_causal_t, lambda s, c, q, k: s * torch.sigmoid(c["key_gate"]).view(1, -1, 1, 1)),
        flex_fn=_flex(lambda c, b, h, q, k: q >= k,
                      lambda s, c, b, h, q, k: s * torch.sigmoid(c["key_gate"][h])),
        learnable=("key_gate",),
    )
)


# ---------------------------------------------------------------- published models (issue 20)
GEMMA2_WINDOW, GEMMA2_SOFTCAP = 4096, 50.0  # Gemma 2: sliding_window, attn_logit_softcapping
MISTRAL_WINDOW = 4096  # Mistral 7B v0.1: sliding_window
PREFIX_FRACTION = 0.25  # document_prefix: the first quarter of each document sees itself whole


_add(
    Variant(
        "gemma2",
        f"Gemma 2: causal softmax, soft-cap {GEMMA2_SOFTCAP:g}, sliding window {GEMMA2_WINDOW}",
        "softmax",
        "sliding_window",
        True,
        _softmax_spec(lambda b, h, q, k: _window(GEMMA2_WINDOW)(q, k),
                      _softcap(GEMMA2_SOFTCAP)[0]),
        _no_customs,
        _softmax_ref(lambda c, q, k: _window(GEMMA2_WINDOW)(q, k),
                     lambda s, c, q, k: _softcap(GEMMA2_SOFTCAP)[1](s)),
        flex_fn=_flex(lambda c, b, h, q, k: _window(GEMMA2_WINDOW)(q, k),
                      lambda s, c, b, h, q, k: _softcap(GEMMA2_SOFTCAP)[1](s)),
    )
)
_add(_mask_variant("mistral_window",
                   f"Mistral 7B: causal sliding-window softmax (window {MISTRAL_WINDOW})", True,
                   _window(MISTRAL_WINDOW)))


def _doc_prefix_data(sz, gen):
    """Document ids as `document`'s, and per position the end of its document's prefix (the
    first PREFIX_FRACTION of the document, attended bidirectionally)."""
    ids = _doc_ids(sz, gen)["doc_ids"]
    S = ids.shape[1]
    starts = [0, *(int(f * S) for f in DOC_BOUNDS), S]
    end = torch.zeros_like(ids)
    for a, z in itertools.pairwise(starts):
        end[:, a:z] = a + max(1, int(PREFIX_FRACTION * (z - a)))
    return {"doc_ids": ids, "prefix_end": end}


def _doc_prefix_mask_for(io: CustomIO):
    doc, end = io["doc_ids"], io["prefix_end"]

    def mask(b, h, q_idx, kv_idx):  # per-key data (doc) and per-query data (doc, prefix end)
        return (doc[b, q_idx] == doc[b, kv_idx]) & ((q_idx >= kv_idx) | (kv_idx < end[b, q_idx]))

    return mask


_doc_prefix_mask_for.needs_io = True


def _doc_prefix_t(c, q, k):
    doc, end = c["doc_ids"], c["prefix_end"]
    same = doc[:, q.view(-1)].unsqueeze(-1) == doc[:, k.view(-1)].unsqueeze(1)
    return (same & ((q >= k) | (k < end[:, q.view(-1)].unsqueeze(-1)))).unsqueeze(1)


_add(
    Variant(
        "document_prefix",
        "packed documents, each with a bidirectional prefix (a document id per query and key, "
        "a prefix end per query)",
        "softmax",
        "document",
        False,
        _softmax_spec(_doc_prefix_mask_for, None,
                      {"doc_ids": ("batch", "seq_len"), "prefix_end": ("batch", "seq_len")}),
        _doc_prefix_data,
        _softmax_ref(_doc_prefix_t),
        flex_fn=_flex(lambda c, b, h, q, k: (c["doc_ids"][b, q] == c["doc_ids"][b, k])
                      & ((q >= k) | (k < c["prefix_end"][b, q]))),
        needs_equal_seqlens=True,
    )
)

# Expose the select used by users writing their own variants alongside these.
__all__ = ["VARIANTS", "where"]
