"""The decode kind's objective: build the module with the trial's DecodeConfig, run it on a
decode case's inputs (attnbench.decode: the KV cache, its lengths, ragged or full, its page
table), check it against the decode reference, time it as EngineObjective does (CUDA events,
the runner's L2 policy). The study minimises the time; the measurement also reports the bytes
a decode step must move and the TB/s (attnbench.decode.case_traffic).

The check runs the reference on two sequences only, the longest and the shortest (a ragged
batch's edge cases; one sequence when all lengths are equal): the reference widens the cache to
float32 per query head, which for a whole batch of 128k-token caches is tens of GiB.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from attnbench.tune.engine_objective import check_close, gpu_name, median_ms
from attnbench.tune.objective import Measurement, compile_failures, require_cuda
from attnbench.tune.problem import Problem

# Per benchmark-worker process, as in engine_objective: inputs and the reference's slice,
# built once per (problem, seed) and reused by every trial.
_INPUTS: dict[tuple, dict] = {}
_REFERENCE: dict[tuple, tuple] = {}

# The SM count the compile workers generate for (the split count depends on it). They must
# not touch the GPU; on a GPU with another count the benchmark worker's build is a cache miss
# and compiles there (the trial is still right, only slower to run).
H100_SMS = 132


def decode_case(p: Problem):
    """The decode suite case (attnbench.cases.Case, kind "decode") of a tuning problem."""
    from attnbench.cases import Case
    from attnbench.dtypes import dtype_name
    from engine.tuning.tune_file import shape_tag

    return Case(**p.sizes(), suite="tune", name=f"{p.variant}/{shape_tag(p.shape())}",
                variant=p.variant, shape="", dtype=dtype_name(p.dtype), kind="decode",
                modes=("fwd",), impls=("engine",), baseline="engine", ragged=p.ragged,
                page_size=p.page_size)


@dataclass(frozen=True)
class DecodeObjective:
    problem: Problem
    reps: int = 30
    warmup: int = 5
    rtol: float = 1e-2
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.problem.decode:
            raise ValueError(f"DecodeObjective: problem of family {self.problem.family!r}, "
                             "expected 'decode'")

    @property
    def case(self):
        return decode_case(self.problem)

    def _variant(self):
        from engine.variants import get_variant

        return get_variant(self.problem.variant)

    def _module(self, cfg, backend: str = "tilelang"):
        from attnbench.decode import build_module

        mod = build_module(self.case, self._variant(), backend)
        mod.decode_config = cfg
        return mod

    @functools.cache  # noqa: B019 - one objective per study, cached per process
    def traced_spec(self):
        return self._module(None, backend="reference").spec

    def spec_hash(self) -> str:
        return str(self.traced_spec().hash)

    def gpu_name(self, device: int | None) -> str:
        return gpu_name(device)

    @functools.cache  # noqa: B019
    def traffic(self) -> tuple[float, float]:
        """(bytes, flops) of one decode step on this objective's inputs."""
        from attnbench.decode import case_traffic

        return case_traffic(self.case, self._variant(), self.seed)

    def unmasked_fraction(self) -> float:
        """The attended (query, key) pairs over Sq x capacity (valid lengths, causal, windows):
        Problem.flops times it is the step's FLOPs."""
        return self.traffic()[1] / self.problem.flops_of("fwd")

    def _pages(self) -> int:
        p = self.problem
        return p.batch * p.seqlen_kv // p.page_size if p.page_size else 0

    def compile(self, cfg) -> None:
        """nvcc-compile the decode kernels of `cfg` (TileLang's disk cache then serves the
        benchmark worker's build)."""
        with compile_failures():
            mod = self._module(cfg)
            mod.decode_kernels(self.problem.page_size, self._pages(), H100_SMS).compile()

    def evaluate(self, cfg) -> Measurement:
        import torch

        from attnbench.decode import DECODE_TENSORS, decode_customs
        from attnbench.tune.timing import working_set_bytes

        require_cuda()
        mod = self._module(cfg)
        inputs = self._inputs()
        customs = decode_customs(inputs)
        args = [customs[n] for n in mod.custom_io.names()]
        q, k_cache, v_cache, lens, table = (inputs[n] for n in DECODE_TENSORS)

        def step():
            with torch.no_grad():
                return mod(q, k_cache, v_cache, *args, cache_seqlens=lens, block_table=table)

        rel_err = self._check(step())  # the first call checks the lengths and the table
        mod.check_cache_values = False  # then timed as a server runs it (attnbench.impls)
        med, n = median_ms(step, self.reps, self.warmup,
                           working_set_bytes(self.problem, inputs.values()))
        from engine.runtime.device import sm_count

        plan = mod.decode_kernels(self.problem.page_size, self._pages(),
                                  sm_count(q.device)).plan
        nbytes = self.traffic()[0]
        return Measurement(med, {"rel_err": rel_err, "reps": n, "bytes": nbytes,
                                 "tbps": nbytes / med / 1e9, "splits": plan.splits,
                                 "gpu_env": os.environ.get("CUDA_VISIBLE_DEVICES", "")})

    def _inputs(self) -> dict:
        from attnbench.decode import make_decode_inputs

        key = (self.problem, self.seed)
        if key not in _INPUTS:
            _INPUTS.clear()  # one study per worker: free the last one's cache first
            _REFERENCE.clear()
            _INPUTS[key] = make_decode_inputs(self.case, self._variant(), "cuda", self.seed)
        return _INPUTS[key]

    def checked_sequences(self) -> list[int]:
        """The longest sequence and the shortest (one when all lengths are equal)."""
        from attnbench.decode import cache_lengths

        p = self.problem
        lengths = cache_lengths(p.batch, p.seqlen_kv, p.seqlen_q, p.ragged, self.seed)
        longest = max(range(p.batch), key=lambda b: (lengths[b], -b))
        shortest = min(range(p.batch), key=lambda b: (lengths[b], b))
        return [longest] if lengths[longest] == lengths[shortest] else [longest, shortest]

    def _check(self, out) -> float:
        from attnbench.decode import decode_reference

        seqs = self.checked_sequences()
        key = (self.problem, self.seed)
        if key not in _REFERENCE:
            _REFERENCE[key] = (decode_reference(self.case, self._variant(), self._inputs(),
                                                seqs),)
        (ref,) = _REFERENCE[key]
        return check_close([("output", out[seqs], ref)], self.rtol,
                           f"sequences {seqs} of {self.case.name}")
