"""The real objective: build the engine's TileLang kernel for a config, check it against the
reference executor, time it with CUDA events. Runs in the tuner's worker processes; everything
CUDA is imported inside the methods so the CPU machinery never touches it.

One kernel per trial: the timed full-size kernel is also the one checked. Its output (and, in
'bwd' mode, its gradients) on batch 0 and kv head 0's query heads is compared with the
reference executor run on just that slice (engine.reference.executor.first_group), which
costs 1/(B·Hkv) of the full reference and is row-chunked, so it fits at any length.
"""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass

from attnbench.tune.objective import Measurement, TrialFailed, compile_failures, require_cuda
from attnbench.tune.problem import Problem
from engine.plan.config import KernelConfig

# Per benchmark-worker process: inputs and reference results, built once per (problem, seed)
# and reused by every trial (the reference costs far more than the kernel it checks).
_INPUTS: dict[tuple, dict] = {}
_REFERENCE: dict[tuple, tuple] = {}


def _torch_dtype(name: str):
    from engine.dtypes import torch_dtype

    return torch_dtype(name)


@dataclass(frozen=True)
class EngineObjective:
    problem: Problem
    reps: int = 30
    warmup: int = 5
    rtol: float = 1e-2
    seed: int = 0

    def _variant(self):
        from engine.variants import get_variant

        return get_variant(self.problem.variant)

    def _build(self, problem: Problem, cfg: KernelConfig | None, backend: str = "tilelang"):
        # 'bwd' studies tune the backward's main kernel; the forward keeps its own config.
        from engine.kernels.registry import get_kind

        which = get_kind(problem.template).config_arg
        return self._variant().build(
            **problem.shape(), dtype=_torch_dtype(problem.dtype), backend=backend,
            **{which: cfg},
        )

    @functools.cache  # noqa: B019 - one objective per study, cached per worker process
    def traced_spec(self):
        return self._build(self.problem, None, backend="reference").spec

    def spec_hash(self) -> str:
        return str(self.traced_spec().hash)

    def gpu_name(self, device: int | None) -> str:
        return gpu_name(device)

    def unmasked_fraction(self) -> float:
        p = self.problem
        return float(self._variant().unmasked_fraction(p.seqlen_q, p.seqlen_kv))

    def compile(self, cfg: KernelConfig) -> None:
        compile_kernels(self._build(self.problem, cfg), self.problem.mode)

    def evaluate(self, cfg: KernelConfig) -> Measurement:
        import torch

        require_cuda()
        mod = self._build(self.problem, cfg)
        require_kernel_backward(mod, self.problem.mode)
        rel_err = self._check(mod)
        inputs = self._inputs(self.problem, requires_grad=self.problem.mode == "bwd")
        if self.problem.mode == "bwd":
            out = mod(**inputs)
            dout = torch.randn_like(out)
            leaves = [inputs[k] for k in ("q", "k", "v")]

            def step():
                o = mod(**inputs)
                torch.autograd.grad(o, leaves, dout)
        else:

            def step():
                with torch.no_grad():
                    mod(**inputs)

        from attnbench.tune.timing import working_set_bytes

        med, n = median_ms(step, self.reps, self.warmup,
                           working_set_bytes(self.problem, inputs.values()))
        return Measurement(med, {"rel_err": rel_err, "reps": n,
                                 "gpu_env": os.environ.get("CUDA_VISIBLE_DEVICES", "")})

    def _inputs(self, p: Problem, requires_grad: bool) -> dict:
        key = (p, self.seed, requires_grad)
        if key not in _INPUTS:
            if len(_INPUTS) >= 2:  # one study per worker: its fwd and bwd inputs at most
                _INPUTS.clear()
                _REFERENCE.clear()
            _INPUTS[key] = self._variant().make_inputs(
                **p.shape(), dtype=_torch_dtype(p.dtype), device="cuda", seed=self.seed,
                requires_grad=requires_grad,
            )
        return _INPUTS[key]

    def _reference(self, mod, inputs: dict) -> tuple:
        """(output, dout, grads of q/k/v or None) of the reference executor on the first
        group's slice of `inputs` (dout is full size; its slice is what the reference saw)."""
        import torch

        from engine.reference import executor

        p = self.problem
        key = (p, self.seed)
        if key not in _REFERENCE:
            names = list(mod.custom_io.names())
            customs = {n: inputs[n].detach() for n in names}
            q, k, v, cs = executor.first_group(
                inputs["q"].detach(), inputs["k"].detach(), inputs["v"].detach(), customs,
                mod.custom_io.decls,
            )
            o, fin = executor.forward(mod.spec, q, k, v, cs, dtype=torch.float32)
            if p.mode == "bwd":
                gen = torch.Generator(device="cuda").manual_seed(self.seed + 1)
                full = inputs["q"].shape[:3] + (p.head_dim_v,)
                dout = torch.randn(full, generator=gen, device="cuda", dtype=inputs["q"].dtype)
                G = q.shape[2]
                grads = executor.backward(mod.spec, q, k, v, cs, o, fin, dout[:1, :, :G],
                                          dtype=torch.float32)[:3]
                _REFERENCE[key] = (o, dout, grads)
            else:
                _REFERENCE[key] = (o, None, None)
        return _REFERENCE[key]

    def _check(self, mod) -> float:
        import torch

        bwd = self.problem.mode == "bwd"
        inputs = self._inputs(self.problem, requires_grad=bwd)
        ref, dout, want = self._reference(mod, inputs)
        G, Bs = ref.shape[2], (slice(0, 1),)
        out = mod(**inputs)
        pairs = [("output", out[Bs + (slice(None), slice(0, G))], ref)]
        if bwd:
            leaves = [inputs[k] for k in ("q", "k", "v")]
            got = torch.autograd.grad(out, leaves, dout)
            heads = (slice(0, G), slice(0, 1), slice(0, 1))
            pairs += [(f"d{n}", g[Bs + (slice(None), h)], w)
                      for n, g, h, w in zip("qkv", got, heads, want, strict=True)]
        return check_close(pairs, self.rtol,
                           f"batch 0, query heads 0..{G - 1} of {self.problem.shape()}")


def require_kernel_backward(mod, mode: str) -> None:
    """A 'bwd' trial must time the generated backward, never the reference rules."""
    if mode != "bwd":
        return
    reason = mod.backward_problem()
    if reason is not None:
        raise TrialFailed(f"no backward kernel to time: {reason}")


def compile_kernels(mod, mode: str) -> None:
    """nvcc-compile `mod`'s kernels in this (compile worker) process. TileLang's disk cache
    then makes the benchmark worker's build a cache hit, so compiles run in parallel on the
    CPU cores instead of serially on the GPU's worker. Building a module compiles nothing."""
    with compile_failures():
        require_kernel_backward(mod, mode)
        mod.compile_kernels(("fwd", mode))


def gpu_name(device: int | None) -> str:
    """The name of GPU `device` (nvidia-smi first: it does not initialise CUDA here)."""
    idx = 0 if device is None else device
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", str(idx)],
            capture_output=True, text=True, timeout=30, check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("attnbench tune needs a CUDA GPU (none found)") from None
        return torch.cuda.get_device_name(idx)


def check_close(pairs, rtol: float, where: str) -> float:
    """The worst relative error (Frobenius) over (name, got, want) pairs; TrialFailed on NaN/Inf
    or an error of `rtol` or more."""
    worst = 0.0
    for name, a, b in pairs:
        a, b = a.float(), b.float()
        if not bool(a.isfinite().all()):
            raise TrialFailed(f"output mismatch: {name} has NaN/Inf")
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        if not err < rtol:
            raise TrialFailed(
                f"output mismatch: {name} rel err {err:.3e} >= {rtol:g} against the reference "
                f"({where})"
            )
        worst = max(worst, err)
    return worst


def median_ms(step, reps: int, warmup: int, working_set_bytes: int) -> tuple[float, int]:
    """Median time of `step` in ms and the repetitions: the suite runner's timer and L2 policy
    (attnbench.tune.timing, over attnbench.timing.measure)."""
    from attnbench.tune.timing import time_step

    t = time_step(step, reps=reps, warmup=warmup, working_set_bytes=working_set_bytes)
    return t.median_ms, t.repeats

