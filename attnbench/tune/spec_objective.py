"""The objective behind `AttentionEngine(tune=True)`: the forward kernel of any traced spec,
timed and checked on the user's own inputs.

The engine saves the inputs of the call that triggered tuning (q, k, v and the CustomIO
tensors, on the CPU) to `inputs_path`; worker processes load them once. The spec travels by
pickling (it is data: the user's hook functions are not needed, and may not pickle). The output
is checked against the engine's reference executor on the same inputs, row-chunked so that it
never materialises B·H·Sq·Skv scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnbench.tune.engine_objective import (
    _torch_dtype,
    check_close,
    compile_kernels,
    gpu_name,
    median_ms,
)
from attnbench.tune.objective import Measurement, TrialFailed, require_cuda
from attnbench.tune.problem import Problem
from engine.dsl.io import CustomIO
from engine.ir.spec import TracedSpec
from engine.plan.config import KernelConfig

# Per worker process: loaded inputs and the reference output, keyed by the inputs file.
_LOADED: dict[str, dict[str, Any]] = {}
_REFERENCE: dict[str, Any] = {}


@dataclass(frozen=True)
class SpecObjective:
    problem: Problem
    spec: TracedSpec
    custom_io: CustomIO
    inputs_path: str
    reps: int = 30
    warmup: int = 5
    rtol: float = 1e-2

    def spec_hash(self) -> str:
        return str(self.spec.hash)

    def traced_spec(self) -> TracedSpec:
        return self.spec

    def gpu_name(self, device: int | None) -> str:
        return gpu_name(device)

    def _inputs(self, device: str = "cpu") -> dict[str, Any]:
        import torch

        key = f"{self.inputs_path}@{device}"
        if key not in _LOADED:
            data = torch.load(self.inputs_path, map_location=device, weights_only=True)
            missing = {"q", "k", "v", *self.custom_io.names()} - set(data)
            if missing:
                raise TrialFailed(f"inputs file {self.inputs_path} lacks {sorted(missing)}")
            _LOADED[key] = data
        return _LOADED[key]

    def unmasked_fraction(self) -> float:
        from engine.mask.analysis import count_unmasked

        p = self.problem
        if self.spec.mask is None:
            return 1.0
        data = self._inputs()
        customs = {n: data[n] for n in self.custom_io.names()}
        n = count_unmasked(self.spec.mask, p.batch, p.heads_q, p.seqlen_q, p.seqlen_kv, customs)
        return n / (p.batch * p.heads_q * p.seqlen_q * p.seqlen_kv)

    def module(self, cfg: KernelConfig | None, backend: str = "tilelang"):
        from engine import AttentionEngine, meta_tensor

        p, dt = self.problem, _torch_dtype(self.problem.dtype)
        meta = (
            meta_tensor(p.batch, p.heads_q, p.seqlen_q, p.head_dim, dtype=dt),
            meta_tensor(p.batch, p.heads_kv, p.seqlen_kv, p.head_dim, dtype=dt),
            meta_tensor(p.batch, p.heads_kv, p.seqlen_kv, p.head_dim_v, dtype=dt),
        )
        return AttentionEngine.from_traced(meta, self.spec, self.custom_io, backend=backend,
                                           config=cfg)

    def compile(self, cfg: KernelConfig) -> None:
        compile_kernels(self.module(cfg), "fwd")

    def evaluate(self, cfg: KernelConfig) -> Measurement:
        import os

        import torch

        from engine.reference import executor

        require_cuda()
        data = self._inputs("cuda")
        args = [data["q"], data["k"], data["v"], *(data[n] for n in self.custom_io.names())]
        if self.inputs_path not in _REFERENCE:
            customs = {n: data[n] for n in self.custom_io.names()}
            ref, _ = executor.forward(self.spec, data["q"], data["k"], data["v"], customs,
                                      mode="online", block_N=256, dtype=torch.float32)
            _REFERENCE[self.inputs_path] = ref
        mod = self.module(cfg)
        with torch.no_grad():
            out = mod(*args)
        err = check_close([("output", out, _REFERENCE[self.inputs_path])], self.rtol,
                          "the engine's reference executor on the tuned inputs")

        def step():
            with torch.no_grad():
                mod(*args)

        from attnbench.tune.timing import working_set_bytes

        med, n = median_ms(step, self.reps, self.warmup,
                           working_set_bytes(self.problem, args))
        return Measurement(med, {"rel_err": err, "reps": n,
                                 "gpu_env": os.environ.get("CUDA_VISIBLE_DEVICES", "")})

