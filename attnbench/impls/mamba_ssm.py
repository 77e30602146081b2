"""mamba_ssm's `mamba_chunk_scan_combined` (Mamba2's SSD kernels, Triton) for the mamba2
linear variant.

SSD computes y_t = sum_{s <= t} (C_t . B_s) exp(sum_{s < r <= t} dt_r A) dt_s x_s, which is the
variant's layer with q = C, k = B, v = x, decay = dt, A the per-head decay rate: the case's
tensors go in as they are, in mamba_ssm's layout [B, T, H, ...] (x [B, T, H, P], dt [B, T, H],
A [H], B and C [B, T, G, N] with G = 1 group).

Not runnable on the GPU host today (`unavailable`): PyPI has no mamba_ssm wheel, only the sdist
(mamba_ssm 2.3.2.post1), whose setup compiles CUDA extensions against the installed torch, and
the package's `__init__` imports them (selective_scan_cuda) even though the SSD kernels are
Triton; prebuilt wheels exist only as GitHub release assets built for specific torch/CUDA pairs
(none for torch 2.11 + CUDA 13.0), and the GPU host has no network to build one. The suite then
times fla's simple GLA on the Mamba2 shapes instead (attnbench.impls.fla_inputs).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from attnbench.cases import Case
from attnbench.impls.base import HALF, Capabilities, Impl, Prepared, Unsupported
from attnbench.impls.fla_inputs import from_fla, to_fla
from attnbench.linear import STATE

NOT_INSTALLED = (
    "mamba_ssm is not installed: PyPI has only its sdist (CUDA extensions built against the local "
    "torch at install); prebuilt wheels are GitHub release assets for specific torch/CUDA "
    "versions, none for torch 2.11 + CUDA 13.0, and the GPU host cannot build or download one"
)


def load_op() -> Callable:
    return importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined


class MambaSsmImpl(Impl):
    name = "mamba_ssm"
    description = "mamba_ssm's mamba_chunk_scan_combined (Mamba2 SSD, Triton)"
    chunk_size = 256  # Mamba2's default

    def __init__(self, op: Callable[[], Callable] = load_op) -> None:
        self.load_op = op  # a torch stand-in in tests

    @property
    def caps(self) -> Capabilities:
        return Capabilities(devices=frozenset({"cuda"}), dtypes=HALF, kinds=frozenset({"linear"}),
                            variants=frozenset({"mamba2"}))

    def unavailable(self) -> str | None:
        try:
            found = importlib.util.find_spec("mamba_ssm") is not None
        except (ImportError, ValueError):
            found = False
        return None if found else NOT_INSTALLED

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        if STATE in inputs:
            raise Unsupported("mamba_ssm: continuations from a state are not mapped (its "
                              "generation step is a separate op, selective_state_update)")
        if case.heads_q != 1 or case.heads_kv != 1:
            raise Unsupported("mamba_ssm: B and C of one group (heads_q = heads_k = 1) only")
        c, b, x = (to_fla(inputs[n]).requires_grad_(needs_grad) for n in ("q", "k", "v"))
        dt = to_fla(inputs["dt"].float()).requires_grad_(needs_grad)
        a = inputs["A"].float().reshape(-1).contiguous().requires_grad_(needs_grad)
        op, chunk = self.load_op(), self.chunk_size

        def forward():
            return op(x, dt, a, b, c, chunk_size=chunk)

        def grads_back(grads: tuple) -> tuple:  # dC, dB, dx, ddt, dA -> the case's (dt, A last)
            return (*(from_fla(g) for g in grads[:4]), grads[4].view_as(inputs["A"]))

        return Prepared(forward=forward, leaves=(c, b, x, dt, a), to_common=from_fla,
                        from_common=to_fla, grad_map=grads_back)
