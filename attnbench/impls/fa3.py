"""FlashAttention-3 (`flash-attention-3`): the full `flash_attn_interface` when installed
(forward and backward, fp16/bf16), else `fa3_fwd_interface` from the fa3-fwd package (forward
only, bf16 only). Both take [B, S, H, D], the common layout; GQA is native. Only plain softmax
variants (no mask or causal) are expressed; causal is bottom-right aligned as in FlashAttention.

Decode cases run `flash_attn_with_kvcache` (cache_seqlens, page_table, causal bottom-right, a
window and a soft-cap), as far as the installed build compiled them in: its `*_config.CONFIG`
lists the FLASHATTENTION_DISABLE_* switches, and a case needing a disabled one is skipped with
the switch's name (the GPU bundle's fa3-fwd 0.0.3 has paged KV, sliding windows and fp16 off).
FA3's Hopper kernels have no ALiBi (alibi_slopes is FlashAttention-2's).
"""

from __future__ import annotations

import importlib
import importlib.util
import math

from attnbench.cases import Case
from attnbench.decode import DECODE_TENSORS, SOFTCAPS, WINDOWS, window_of
from attnbench.impls.base import (
    HALF,
    PLAIN_SOFTMAX,
    Capabilities,
    DeviceInfo,
    Impl,
    Prepared,
    Unsupported,
)

FULL, FWD_ONLY = "flash_attn_interface", "fa3_fwd_interface"
CONFIG_MODULES = {FULL: "flash_attn_config", FWD_ONLY: "fa3_fwd_config"}
DECODE_VARIANTS = PLAIN_SOFTMAX | set(SOFTCAPS) | set(WINDOWS)
# (D, Dv) pairs with D != Dv that FA3 compiles, and the switch that turns each off
HEAD_DIM_PAIRS = {(192, 128): "FLASH_ATTENTION_DISABLE_HDIMDIFF192",
                  (64, 256): "FLASH_ATTENTION_DISABLE_HDIMDIFF64",
                  (64, 512): "FLASH_ATTENTION_DISABLE_HDIMDIFF64"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def build_flags(module: str | None) -> dict[str, bool]:
    """The FA3 build's compile-time switches (FLASHATTENTION_DISABLE_*: True means compiled
    out) from its config module; {} when unknown (then every feature is assumed present)."""
    try:
        config = importlib.import_module(CONFIG_MODULES[module])
        return dict(config.CONFIG["build_flags"])
    except (ImportError, KeyError, AttributeError, TypeError):
        return {}


def decode_problem(case: Case, variant, flags: dict[str, bool]) -> str | None:
    """Why FA3 (with the build `flags`) cannot run the decode case, or None."""
    if case.variant not in DECODE_VARIANTS:
        if case.variant == "alibi":
            return "FA3's Hopper kernels take no ALiBi slopes (alibi_slopes is FlashAttention-2's)"
        return (f"variant {case.variant} has no FA3 form (FA3 takes causal, a sliding window "
                "and a soft-cap)")
    needs = [("FLASHATTENTION_DISABLE_PAGEDKV", case.page_size > 0, "paged KV caches"),
             ("FLASHATTENTION_DISABLE_LOCAL", window_of(variant) is not None, "sliding windows"),
             ("FLASHATTENTION_DISABLE_SOFTCAP", case.variant in SOFTCAPS, "soft-capping"),
             ("FLASHATTENTION_DISABLE_VARLEN", True, "cache_seqlens (varlen kernels)")]
    for flag, needed, what in needs:
        if needed and flags.get(flag):
            return f"this FA3 build compiled {what} out ({flag})"
    dims = (case.head_dim, case.head_dim_v)
    if dims[0] != dims[1]:
        flag = HEAD_DIM_PAIRS.get(dims)
        if flag is None or flags.get(flag):
            return (f"FA3 takes head_dim != head_dim_v only as 192/128 or 64/256-512 (got "
                    f"{dims[0]}/{dims[1]}" + (f"; {flag} is set)" if flag else ")"))
    return None


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

    def decode_caps(self, flags: dict[str, bool]) -> Capabilities:
        fp16 = self.module_name() == FULL and not flags.get("FLASHATTENTION_DISABLE_FP16")
        return Capabilities(
            devices=frozenset({"cuda"}), dtypes=HALF if fp16 else frozenset({"bfloat16"}),
            modes=frozenset({"fwd"}), kinds=frozenset({"decode"}), max_head_dim=256,
            min_capability=(9, 0), cuda_reason="needs a Hopper GPU",
        )

    def unavailable(self) -> str | None:
        if self.module_name() is None:
            return f"neither {FULL} nor {FWD_ONLY} is installed"
        return None

    def check(self, case: Case, variant, device: DeviceInfo) -> str | None:
        if case.kind != "decode":
            return super().check(case, variant, device)
        flags = build_flags(self.module_name())
        return (self.decode_caps(flags).check(case, device) or self.unavailable()
                or decode_problem(case, variant, flags))

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        mod = importlib.import_module(self.module_name() or FWD_ONLY)
        if case.kind == "decode":
            return self.prepare_decode(mod, case, variant, inputs)
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

    @staticmethod
    def prepare_decode(mod, case: Case, variant, inputs: dict) -> Prepared:
        """flash_attn_with_kvcache on the cache as it is (FA3's own layout, paged or not)."""
        q, k_cache, v_cache, lens, table = (inputs[n] for n in DECODE_TENSORS)
        window = window_of(variant)
        kw = dict(cache_seqlens=lens, page_table=table,
                  softmax_scale=1.0 / math.sqrt(case.head_dim),  # the library's scale
                  causal=bool(variant.causal),  # bottom-right: the new tokens are the last
                  # the library's window keeps p - w < k <= p: w - 1 keys left of the diagonal
                  window_size=(window - 1, 0) if window is not None else (-1, -1),
                  softcap=SOFTCAPS.get(case.variant, 0.0))

        def forward():
            out = mod.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
            return out[0] if isinstance(out, tuple) else out

        return Prepared(forward=forward)
