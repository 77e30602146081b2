"""flash-linear-attention (`fla`, fla-core 0.6.0): `chunk_simple_gla` for linear cases.

Simple GLA, RetNet's linear retention (`chunk_retention` is `chunk_simple_gla` with a fixed
g_gamma per head) and Mamba2's SSD with a scalar decay per head are all one fla op; the case's
inputs are mapped onto it before timing (attnbench.impls.fla_inputs), the scale passed
explicitly, and its output and q/k/v gradients checked against the variant's reference like
every other row.

The gated backward on Hopper (`gated_backward_on_hopper`): fla 0.6.0's Triton kernel for dq/dk
with a data-dependent decay (`fla.ops.common.chunk_o.chunk_bwd_dqkwg`) raises on Hopper with
Triton >= 3.4 and < 3.7.1 ("produces incorrect results", fla issue #640; the GPU host has
torch 2.11's Triton 3.6), and fla's fix, its TileLang backend (`FLA_TILELANG`, on by default on
Hopper), refuses simple GLA's call: its verifier wants the chunk states in q's dtype and
`chunk_simple_gla_bwd` computes them in float32 (`states_in_fp32=True` for its recomputed h and
for dh, "for safety"; its forward stores h in q's dtype), so the dispatch falls back to Triton
and raises. Inside the row's timing context the adapter below has the backward's two state
passes write their states in q's dtype, as the forward's does, which fla's TileLang kernel
takes (the rounding shows in the row's rel_err). Until 2026-11-28 it converted float32 states
after the fact instead: two extra passes over h and dh (330 us of fla's 2.58 ms at Mamba2-2.7B
B 1 x T 8k, results/NOTES.md 142), which the gated forward+backward rows charged to fla.
Decays fixed per head (g_gamma: retention) never reach the check and run fla's own float32
states. Where the TileLang backend is unavailable (no nvcc), the refusal becomes a skipped
backward row.

A continuation case (attnbench.linear: a few positions after a state) runs as fla's layers run
generation: `fused_recurrent_simple_gla` for at most 64 positions (their
`'fused_recurrent' if q_len <= 64`), else `chunk_simple_gla`, with `initial_state` and
`output_final_state=True`; both take and return the state as the engine does ([N, H, K, V]
float32).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator

from attnbench.cases import Case
from attnbench.impls.base import HALF, Capabilities, Impl, Prepared, Unsupported
from attnbench.impls.fla_inputs import MAPPINGS, fla_call, from_fla, head_problem, to_fla
from attnbench.linear import STATE

ISSUE_640 = "#640"  # fla's error text for the Hopper gated-backward refusal
RECURRENT_MAX = 64  # fla's layers run at most this many positions with the recurrent kernel
# chunk_simple_gla_bwd's state passes (the chunk states h, recomputed, and their gradient dh)
STATE_PASSES = ("chunk_fwd_h", "chunk_bwd_dh")


def load_op() -> Callable:
    """fla's chunk_simple_gla (imported on first use: CUDA-only dependencies)."""
    return importlib.import_module("fla.ops.simple_gla").chunk_simple_gla


def load_recurrent_op() -> Callable:
    """fla's fused_recurrent_simple_gla, its generation kernel."""
    return importlib.import_module("fla.ops.simple_gla").fused_recurrent_simple_gla


def _with_state(result: tuple) -> tuple:
    """A continuation's (o, final state) in the common layout (the state's is fla's)."""
    return from_fla(result[0]), result[1]


@contextlib.contextmanager
def gated_backward_on_hopper() -> Iterator[None]:
    """simple GLA's gated dq/dk backward through fla's TileLang kernel (module docstring): the
    backward's two state passes write their states in the input dtype, as its forward's does."""
    chunk = importlib.import_module("fla.ops.simple_gla.chunk")
    originals = {n: getattr(chunk, n) for n in STATE_PASSES}

    def in_input_dtype(original: Callable) -> Callable:
        return lambda **kwargs: original(**{**kwargs, "states_in_fp32": False})

    before = os.environ.get("FLA_TILELANG")
    os.environ["FLA_TILELANG"] = "1"
    for n, f in originals.items():
        setattr(chunk, n, in_input_dtype(f))
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(chunk, n, f)
        if before is None:
            os.environ.pop("FLA_TILELANG", None)
        else:
            os.environ["FLA_TILELANG"] = before


def _refusal(exc: BaseException) -> str | None:
    if isinstance(exc, RuntimeError) and ISSUE_640 in str(exc):
        return ("fla refuses the gated backward on Hopper with this Triton (#640) and its "
                f"TileLang backend is unavailable here: {' '.join(str(exc).split())[:200]}")
    return None


class FlaImpl(Impl):
    name = "fla"
    description = "flash-linear-attention (fla-core) chunk_simple_gla"

    def __init__(self, op: Callable[[], Callable] = load_op,
                 backward_context: Callable[[], contextlib.AbstractContextManager]
                 = gated_backward_on_hopper,
                 recurrent_op: Callable[[], Callable] = load_recurrent_op) -> None:
        """`op`, `recurrent_op` and `backward_context` are for tests (torch stand-ins on a
        CPU)."""
        self.load_op = op
        self.load_recurrent_op = recurrent_op
        self.backward_context = backward_context

    @property
    def caps(self) -> Capabilities:
        return Capabilities(
            devices=frozenset({"cuda"}), dtypes=HALF, kinds=frozenset({"linear"}),
            variants=frozenset(MAPPINGS),
        )

    def unavailable(self) -> str | None:
        try:
            found = importlib.util.find_spec("fla") is not None
        except (ImportError, ValueError):
            found = False
        return None if found else "fla (fla-core) is not installed"

    def check(self, case: Case, variant, device) -> str | None:
        return super().check(case, variant, device) or head_problem(case)

    def prepare(self, case: Case, variant, inputs: dict, needs_grad: bool) -> Prepared:
        try:
            call = fla_call(case, inputs, needs_grad)
        except ValueError as exc:
            raise Unsupported(f"fla: {exc}") from exc
        if STATE in inputs:
            return self._continuation(case, call, inputs[STATE])
        op, kwargs = self.load_op(), call.kwargs()
        q, k, v = call.q, call.k, call.v

        def forward():
            return op(q, k, v, **kwargs)[0]  # (o, final_state)

        gated = needs_grad and call.g is not None
        return Prepared(
            forward=forward, leaves=call.leaves, to_common=from_fla, from_common=to_fla,
            grad_map=call.grads_back, refusal=_refusal,
            context=self.backward_context if gated else contextlib.nullcontext,
        )

    def _continuation(self, case: Case, call, state) -> Prepared:
        """fla's generation call from `state` (module docstring); forward only."""
        recurrent = case.seqlen_q <= RECURRENT_MAX
        op = self.load_recurrent_op() if recurrent else self.load_op()
        kwargs = {**call.kwargs(), "initial_state": state, "output_final_state": True}
        q, k, v = call.q, call.k, call.v

        def forward():
            return op(q, k, v, **kwargs)

        return Prepared(forward=forward, to_common=_with_state, refusal=_refusal)
