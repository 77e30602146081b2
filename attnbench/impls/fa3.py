"""FlashAttention-3 (`flash-attention-3`): the full `flash_attn_interface` when installed
(forward and backward, fp16/bf16), else `fa3_fwd_interface` from the fa3-fwd package (forward
only, bf16 only). Both take [B, S, H, D], the common layout; GQA is native. Only plain softmax
variants (no mask or causal) are expressed; causal is bottom-right aligned as in FlashAttention.
"""

from __future__ import annotations

import importlib
import importlib.util

from attnbench.cases import Case
from attnbench.impls.base import HALF, PLAIN_SOFTMAX, Capabilities, Impl, Prepared, Unsupported

FULL, FWD_ONLY = "flash_attn_interface", "fa3_fwd_interface"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class FA3Impl(Impl):
    name = "flash-attention-3"
    description = "FlashAttention-3 (flash_attn_interface, else fa3_fwd_interface)"

    def module_name(self) -> str | None:
        if _installed(FULL):
            return FULL
        if _installed(FWD_ONLY):
            return FWD_ONLY
        return None

    @property
    def caps(self) -> Capabilities:
        full = self.module_name() == FULL
        return Capabilities(
            devices=frozenset({"cuda"}),
            dtypes=HALF if full else frozenset({"bfloat16"}),
            modes=frozenset({"fwd", "bwd", "fwd+bwd"}) if full else frozenset({"fwd"}),
            variants=PLAIN_SOFTMAX, max_head_dim=256, equal_head_dims=True,
            min_capability=(9, 0), cuda_reason="needs a Hopper GPU",
        )

    def unavailable(self) -> str | None:
        if self.module_name() is None:
            return f"neither {FULL} nor {FWD_ONLY} is installed"
        return None

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        mod = importlib.import_module(self.module_name() or FWD_ONLY)
        kw = variant.sdpa_kwargs(inputs)
        if kw is None:
            raise Unsupported(f"variant {case.variant} has no plain-softmax form")
        causal, scale = bool(kw.get("is_causal", False)), kw.get("scale")
        grads = needs_grad and self.module_name() == FULL
        q, k, v = (inputs[n].detach().contiguous().requires_grad_(grads) for n in ("q", "k", "v"))

        def forward():
            out = mod.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
            return out[0] if isinstance(out, tuple) else out  # some builds return (out, lse)

        return Prepared(forward=forward, leaves=(q, k, v))
