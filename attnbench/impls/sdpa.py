"""PyTorch `scaled_dot_product_attention` with one backend forced per implementation:
`sdpa-cudnn`, `sdpa-flash`, `sdpa-efficient`, `sdpa-math` (the last also on CPU).

SDPA takes [B, H, S, D]: q, k, v are transposed and made contiguous in `prepare`, so only the
attention call is timed. GQA goes through `enable_gqa=True`; a backend that refuses a case
("No available kernel", an unsupported head dim, ...) gives a `skipped` row with its message.
"""

from __future__ import annotations

from attnbench.cases import Case
from attnbench.impls.base import (
    ALL_DTYPES,
    HALF,
    PLAIN_SOFTMAX,
    Capabilities,
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


class SdpaImpl(Impl):
    def __init__(self, name: str, backend: str, dtypes: frozenset[str], devices: frozenset[str],
                 max_head_dim: int | None, max_score_elems: int | None = None) -> None:
        self.name = name
        self.backend = backend  # attribute name in torch.nn.attention.SDPBackend
        self.description = f"torch SDPA, {backend} backend"
        self._caps = Capabilities(
            devices=devices, dtypes=dtypes, variants=PLAIN_SOFTMAX, max_head_dim=max_head_dim,
            max_score_elems=max_score_elems,
        )
        self.gpu_only = devices == frozenset({"cuda"})

    @property
    def caps(self) -> Capabilities:
        return self._caps

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kw = variant.sdpa_kwargs(inputs)
        if kw is None:
            raise Unsupported(f"variant {case.variant} has no SDPA form")
        if kw.get("is_causal") and case.seqlen_q != case.seqlen_kv:
            raise Unsupported("SDPA's is_causal aligns the mask top-left; needs seqlen_q == "
                              "seqlen_kv")
        backend = getattr(SDPBackend, self.backend)

        def arrange(t: torch.Tensor) -> torch.Tensor:
            return t.detach().transpose(1, 2).contiguous().requires_grad_(needs_grad)

        q, k, v = (arrange(inputs[n]) for n in ("q", "k", "v"))
        extra = {"enable_gqa": True} if case.heads_q != case.heads_kv else {}
        is_causal, scale = bool(kw.get("is_causal", False)), kw.get("scale")

        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                                  **extra)

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
            forward=forward, leaves=(q, k, v), to_common=lambda t: t.transpose(1, 2),
            from_common=lambda t: t.transpose(1, 2).contiguous(), context=context,
            refusal=_refusal,
        )


def sdpa_impls() -> list[SdpaImpl]:
    cuda, both = frozenset({"cuda"}), frozenset({"cpu", "cuda"})
    return [
        SdpaImpl("sdpa-cudnn", "CUDNN_ATTENTION", HALF, cuda, 256),
        SdpaImpl("sdpa-flash", "FLASH_ATTENTION", HALF, cuda, 256),
        SdpaImpl("sdpa-efficient", "EFFICIENT_ATTENTION", ALL_DTYPES, cuda, None),
        # the math backend materialises the score matrix
        SdpaImpl("sdpa-math", "MATH", ALL_DTYPES, both, None, max_score_elems=2**31),
    ]
