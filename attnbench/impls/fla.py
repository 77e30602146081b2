"""flash-linear-attention (`fla`, fla-core): chunked linear-attention kernels for `linear`
cases. RetNet retention maps to `fla.ops.retention.chunk_retention` (fixed per-head decays
1 - 2^(-5 - h), no normalisation); its accuracy is checked against the engine variant's
`torch_reference` like every other row, so a definition mismatch shows as a failed row.
Layout [B, T, H, D] (`head_first=False` is passed where the installed version still has it).
"""

from __future__ import annotations

import importlib.util
import inspect

from attnbench.cases import Case
from attnbench.impls.base import HALF, Capabilities, Impl, Prepared, grad_leaves

# engine variant -> fla op (module, function)
OPS = {"retnet": ("fla.ops.retention", "chunk_retention")}


class FlaImpl(Impl):
    name = "fla"
    description = "flash-linear-attention (fla-core) chunked kernels"

    @property
    def caps(self) -> Capabilities:
        return Capabilities(
            devices=frozenset({"cuda"}), dtypes=HALF, kinds=frozenset({"linear"}),
            variants=frozenset(OPS), gqa=False,
        )

    def unavailable(self) -> str | None:
        try:
            found = importlib.util.find_spec("fla") is not None
        except (ImportError, ValueError):
            found = False
        return None if found else "fla (fla-core) is not installed"

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        module, func = OPS[case.variant]
        op = getattr(importlib.import_module(module), func)
        params = inspect.signature(op).parameters
        extra = {"head_first": False} if "head_first" in params else {}
        kw = variant.sdpa_kwargs(inputs) or {}
        scale = kw.get("scale", case.head_dim**-0.5)
        q, k, v = grad_leaves(inputs, needs_grad)

        def forward():
            out = op(q, k, v, scale=scale, **extra)
            return out[0] if isinstance(out, tuple) else out  # (o, final_state)

        return Prepared(forward=forward, leaves=(q, k, v))
