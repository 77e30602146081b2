"""PyTorch `scaled_dot_product_attention` with one backend forced per implementation:
`sdpa-cudnn`, `sdpa-flash`, `sdpa-efficient`, `sdpa-math` (the last also on CPU).

SDPA takes [B, H, S, D]: q, k, v are transposed and made contiguous in `prepare`, so only the
attention call is timed. GQA goes through `enable_gqa=True`; a backend that refuses a case
("No available kernel", an unsupported head dim, ...) gives a `skipped` row with its message.

Decode cases: the cache as a [B, Hkv, capacity, D] tensor (the layout Hugging Face's cache
keeps), contiguous caches only. SDPA has no per-sequence lengths, so where the keys a token
may see are not simply all of them (ragged lengths, or Sq > 1 causal tokens, whose mask is
bottom-right aligned where `is_causal` is top-left), it gets what a user passes: a boolean
`attn_mask` over the whole capacity (attnbench.decode.valid_mask). That reads every cached
key, valid or not, and the time says so; the flash backend takes no mask, so it skips those
cases with the reason.
"""

from __future__ import annotations

import math

from attnbench.cases import Case
from attnbench.decode import valid_mask
from attnbench.impls.base import (
    ALL_DTYPES,
    HALF,
    PLAIN_SOFTMAX,
    Capabilities,
    DeviceInfo,
    Impl,
    Prepared,
    Unsupported,
)

_REFUSALS = ("no available kernel", "not supported", "unsupported", "only supports",
             "is not implemented for")


def _refusal(exc: BaseException) -> str | None:
    msg = str(exc)
    if isinstance(exc, (RuntimeError, NotImplementedError, ValueError)) and any(
        r in msg.lower() for r in _REFUSALS
    ):
        return "backend refused: " + " ".join(msg.split())[:300]
    return None


def needs_mask(case: Case, variant) -> bool:
    """Whether SDPA needs an attn_mask for the decode case (see the module docstring)."""
    return case.ragged or (bool(variant.causal) and case.seqlen_q > 1)


class SdpaImpl(Impl):
    def __init__(self, name: str, backend: str, dtypes: frozenset[str], devices: frozenset[str],
                 max_head_dim: int | None, max_score_elems: int | None = None) -> None:
        self.name = name
        self.backend = backend  # attribute name in torch.nn.attention.SDPBackend
        self.description = f"torch SDPA, {backend} backend"
        self._caps = Capabilities(
            devices=devices, dtypes=dtypes, variants=PLAIN_SOFTMAX, max_head_dim=max_head_dim,
            max_score_elems=max_score_elems, kinds=frozenset({"attention", "decode"}),
        )
        self.gpu_only = devices == frozenset({"cuda"})

    @property
    def caps(self) -> Capabilities:
        return self._caps

    def check(self, case: Case, variant, device: DeviceInfo) -> str | None:
        reason = super().check(case, variant, device)
        if reason is not None or case.kind != "decode":
            return reason
        if case.page_size:
            return ("SDPA takes contiguous K/V: a paged cache would need a gather copy per "
                    "step first")
        if self.backend == "FLASH_ATTENTION" and needs_mask(case, variant):
            why = "ragged lengths" if case.ragged else "Sq > 1 causal tokens (bottom-right)"
            return (f"the flash backend takes no attn_mask, which {why} need (SDPA has no "
                    "per-sequence lengths)")
        return None

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if case.kind == "decode":
            forward, leaves = self._decode_forward(case, variant, inputs)
        else:
            forward, leaves = self._attention_forward(case, variant, inputs, needs_grad)
        backend = getattr(SDPBackend, self.backend)

        def context():
            return sdpa_kernel([backend])

        # one untimed call so that a refusing backend is a skip, not an error row
        try:
            with context(), torch.no_grad():
                forward()
        except Exception as exc:
            reason = _refusal(exc)
            if reason:
                raise Unsupported(reason) from exc
            raise
        return Prepared(
            forward=forward, leaves=leaves, to_common=lambda t: t.transpose(1, 2),
            from_common=lambda t: t.transpose(1, 2).contiguous(), context=context,
            refusal=_refusal,
        )

    @staticmethod
    def _attention_forward(case: Case, variant, inputs: dict, needs_grad: bool):
        import torch.nn.functional as F

        kw = variant.sdpa_kwargs(inputs)
        if kw is None:
            raise Unsupported(f"variant {case.variant} has no SDPA form")
        if kw.get("is_causal") and case.seqlen_q != case.seqlen_kv:
            raise Unsupported("SDPA's is_causal aligns the mask top-left; needs seqlen_q == "
                              "seqlen_kv")
        q, k, v = (inputs[n].detach().transpose(1, 2).contiguous().requires_grad_(needs_grad)
                   for n in ("q", "k", "v"))
        extra = {"enable_gqa": True} if case.heads_q != case.heads_kv else {}
        is_causal, scale = bool(kw.get("is_causal", False)), kw.get("scale")

        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                                  **extra)

        return forward, (q, k, v)

    @staticmethod
    def _decode_forward(case: Case, variant, inputs: dict):
        import torch.nn.functional as F

        q, k, v = (inputs[n].transpose(1, 2).contiguous() for n in ("q", "k_cache", "v_cache"))
        mask = valid_mask(case, variant, inputs["cache_seqlens"]) if needs_mask(
            case, variant) else None
        extra = {"enable_gqa": True} if case.heads_q != case.heads_kv else {}
        scale = 1.0 / math.sqrt(case.head_dim)  # the library's scale

        def forward():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **extra)

        return forward, (q, k, v)


def sdpa_impls() -> list[SdpaImpl]:
    cuda, both = frozenset({"cuda"}), frozenset({"cpu", "cuda"})
    return [
        SdpaImpl("sdpa-cudnn", "CUDNN_ATTENTION", HALF, cuda, 256),
        SdpaImpl("sdpa-flash", "FLASH_ATTENTION", HALF, cuda, 256),
        SdpaImpl("sdpa-efficient", "EFFICIENT_ATTENTION", ALL_DTYPES, cuda, None),
        # the math backend materialises the score matrix
        SdpaImpl("sdpa-math", "MATH", ALL_DTYPES, both, None, max_score_elems=2**31),
    ]
