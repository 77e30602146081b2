"""The Variant record shared by tests, suites and users."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.dsl.io import CustomIO, meta_tensor


@dataclass(frozen=True)
class SpecParts:
    """What AttentionEngine needs for one variant at one problem size."""

    score_mod: Callable
    mask_mod: Callable | None
    online_func: Any
    custom_fwd_inputs: CustomIO


@dataclass(frozen=True)
class Variant:
    """An attention variant: the engine spec, its inputs, and independent formulations.

    make_spec(sizes) -> SpecParts; custom_tensors(sizes, dtype, device, gen) -> dict;
    reference(q, k, v, customs, sizes) -> o in float32 (plain torch, no engine code);
    flex(customs, sizes) -> (score_mod, mask_mod) for torch flex_attention, or None;
    sdpa_causal: for plain softmax variants, the SDPA is_causal flag (None: SDPA cannot express it).
    """

    name: str
    description: str
    family: str
    mask: str
    causal: bool
    make_spec: Callable[[dict], SpecParts]
    custom_tensors: Callable[..., dict[str, torch.Tensor]]
    reference_fn: Callable[..., torch.Tensor]
    flex_fn: Callable[..., tuple] | None = None
    sdpa_causal: bool | None = None
    learnable: tuple[str, ...] = ()
    needs_equal_seqlens: bool = False
    params: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def sizes(
        batch: int,
        heads_q: int,
        heads_kv: int,
        seqlen_q: int,
        seqlen_kv: int,
        head_dim: int,
        head_dim_v: int,
    ) -> dict:
        return dict(
            batch=batch,
            heads_q=heads_q,
            heads_kv=heads_kv,
            seqlen_q=seqlen_q,
            seqlen_kv=seqlen_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
        )

    @staticmethod
    def sizes_of(inputs: dict[str, torch.Tensor]) -> dict:
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        return Variant.sizes(
            q.shape[0], q.shape[2], k.shape[2], q.shape[1], k.shape[1], q.shape[3], v.shape[3]
        )

    def supports(
        self,
        *,
        head_dim: int,
        head_dim_v: int,
        heads_q: int,
        heads_kv: int,
        seqlen_q: int | None = None,
        seqlen_kv: int | None = None,
    ) -> str | None:
        if heads_q % heads_kv:
            return f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}"
        if self.needs_equal_seqlens and seqlen_q is not None and seqlen_q != seqlen_kv:
            return f"{self.name} needs seqlen_q == seqlen_kv"
        return None

    # ------------------------------------------------------------------ engine
    def spec_parts(self, **sizes) -> SpecParts:
        return self.make_spec(self.sizes(**sizes))

    def build(
        self,
        *,
        batch: int,
        heads_q: int,
        heads_kv: int,
        seqlen_q: int,
        seqlen_kv: int,
        head_dim: int,
        head_dim_v: int,
        dtype: torch.dtype,
        backend: str = "auto",
        config: Any = None,
        tune: bool = False,
        tune_file: str | None = None,
        backward_config: Any = None,
    ):
        from engine.api import AttentionEngine

        sz = self.sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v)
        why = self.supports(
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            heads_q=heads_q,
            heads_kv=heads_kv,
            seqlen_q=seqlen_q,
            seqlen_kv=seqlen_kv,
        )
        if why:
            raise ValueError(f"variant {self.name}: {why}")
        parts = self.make_spec(sz)
        meta = (
            meta_tensor(batch, heads_q, seqlen_q, head_dim, dtype=dtype),
            meta_tensor(batch, heads_kv, seqlen_kv, head_dim, dtype=dtype),
            meta_tensor(batch, heads_kv, seqlen_kv, head_dim_v, dtype=dtype),
        )
        return AttentionEngine(
            meta,
            parts.custom_fwd_inputs,
            score_mod=parts.score_mod,
            mask_mod=parts.mask_mod,
            online_func=parts.online_func,
            tune=tune,
            tune_file=tune_file,
            backend=backend,
            config=config,
            backward_config=backward_config,
        )

    def make_inputs(
        self,
        *,
        batch: int,
        heads_q: int,
        heads_kv: int,
        seqlen_q: int,
        seqlen_kv: int,
        head_dim: int,
        head_dim_v: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        seed: int = 0,
        requires_grad: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Random q, k, v (standard normal, never zeros) and the variant's custom tensors."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        sz = self.sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v)
        out = {
            "q": torch.randn(batch, seqlen_q, heads_q, head_dim, generator=gen),
            "k": torch.randn(batch, seqlen_kv, heads_kv, head_dim, generator=gen),
            "v": torch.randn(batch, seqlen_kv, heads_kv, head_dim_v, generator=gen),
        }
        out = {n: t.to(device=device, dtype=dtype) for n, t in out.items()}
        for n, t in self.custom_tensors(sz, gen).items():
            out[n] = t.to(device)
        if requires_grad:
            for n in ("q", "k", "v", *self.learnable):
                out[n].requires_grad_(True)
        return out

    # ------------------------------------------------------------------ other formulations
    def torch_reference(
        self, inputs: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The variant written directly in torch (float32 math by default), o [B, Sq, Hq, Dv]."""
        sz = self.sizes_of(inputs)
        q, k, v = (inputs[n].to(dtype) for n in "qkv")
        g = sz["heads_q"] // sz["heads_kv"]
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        customs = {
            n: t.to(dtype) if t.is_floating_point() else t
            for n, t in inputs.items()
            if n not in "qkv"
        }
        return self.reference_fn(q, k, v, customs, sz)

    def flex_mods(self, inputs: dict[str, torch.Tensor]) -> tuple | None:
        if self.flex_fn is None:
            return None
        customs = {n: t for n, t in inputs.items() if n not in "qkv"}
        return self.flex_fn(customs, self.sizes_of(inputs))

    def sdpa_kwargs(self, inputs: dict[str, torch.Tensor]) -> dict | None:
        if self.sdpa_causal is None:
            return None
        # 1/sqrt(D) as the library's score_mods write it (D ** -0.5 differs in the last bit),
        # so the same functions through engine.flex_attention make the same kernel
        return {"is_causal": self.sdpa_causal, "scale": 1.0 / math.sqrt(inputs["q"].shape[-1])}

    def unmasked_fraction(self, seqlen_q: int, seqlen_kv: int) -> float:
        """Exact fraction of (q, kv) pairs not masked (custom tensors from make_inputs)."""
        from engine.ir.trace import trace_spec
        from engine.mask.analysis import count_unmasked

        sz = self.sizes(1, 1, 1, seqlen_q, seqlen_kv, 16, 16)
        parts = self.make_spec(sz)
        if parts.mask_mod is None:
            return 1.0
        spec = trace_spec(
            parts.score_mod, parts.mask_mod, parts.online_func, parts.custom_fwd_inputs
        )
        customs = self.custom_tensors(sz, torch.Generator().manual_seed(0))
        return count_unmasked(spec.mask, 1, 1, seqlen_q, seqlen_kv, customs) / (
            seqlen_q * seqlen_kv
        )
