"""The linear kinds' objective: the variant's LinearAttentionEngine with the trial's LinearConfig
(linear_fwd: `config`; linear_bwd: `config` and `backward_config`, the pair a training step
then runs: the trial's config for both passes, except the engine's default, which stands for
the untuned pair, plan.training_configs), called on a linear case's inputs
(attnbench.linear), checked against the variant's own torch formulation on batch row 0: the
output and the gradients of q, k, v and of the learnable inputs that row owns (sequences are
independent; the reference materialises T x T per head, so the whole batch would cost B times
more), timed as EngineObjective does (CUDA events, the runner's L2
policy). The study minimises the time.

The kernels take no traced spec (the mods are a torch pre-pass), so studies and tune-file
entries are keyed by engine.runtime.linear_tuning.TUNE_SPEC: one entry serves every variant.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from attnbench.tune.engine_objective import check_close, gpu_name, median_ms
from attnbench.tune.objective import Measurement, compile_failures, require_cuda
from attnbench.tune.problem import Problem

# Per benchmark-worker process, as in engine_objective: inputs and the reference's row, built
# once per (problem, seed) and reused by every trial.
_INPUTS: dict[tuple, tuple] = {}
_REFERENCE: dict[tuple, tuple] = {}


def linear_case(p: Problem):
    """The linear suite case (attnbench.cases.Case, kind "linear") of a tuning problem."""
    from attnbench.cases import Case
    from attnbench.dtypes import dtype_name
    from engine.tuning.tune_file import shape_tag

    modes = ("fwd+bwd",) if p.mode == "bwd" else ("fwd",)
    return Case(**p.sizes(), heads=p.heads, suite="tune",
                name=f"{p.variant}/{shape_tag(p.shape())}", variant=p.variant, shape="",
                dtype=dtype_name(p.dtype), kind="linear", modes=modes, impls=("engine",),
                baseline="engine")


@dataclass(frozen=True)
class LinearObjective:
    problem: Problem
    reps: int = 30
    warmup: int = 5
    rtol: float = 2e-2  # the linear kernels' GPU tests' bound (tests/gpu/test_linear_kernels)
    learned_rtol: float = 3e-2  # theirs for the decays' and value weights' gradients
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.problem.linear:
            raise ValueError(f"LinearObjective: problem of family {self.problem.family!r}, "
                             "expected 'linear'")

    @property
    def case(self):
        return linear_case(self.problem)

    @property
    def backward(self) -> bool:
        return self.problem.mode == "bwd"

    def _variant(self):
        from engine.variants.linear import get_linear_variant

        return get_linear_variant(self.problem.variant)

    def _shape(self):
        from engine.kernels.linear_fwd.tune_shape import shape_from

        return shape_from(self.problem.shape(), self.case.dtype)

    def _backward_config(self, cfg):
        """The backward's config beside `cfg` in a training step (the pair a tune-file entry
        of cfg then runs: engine.kernels.linear_fwd.plan.training_configs)."""
        from engine.kernels.linear_fwd.plan import training_configs

        return training_configs(self._shape(), cfg)[1]

    def _module(self, cfg):
        from attnbench.linear import build_linear

        mod = build_linear(self.case, self._variant(), "tilelang")
        mod.config = cfg
        mod.backward_config = self._backward_config(cfg) if self.backward else None
        return mod

    def traced_spec(self) -> None:
        return None  # the kernels run the core problem: no spec picks the default

    def spec_hash(self) -> str:
        from engine.runtime.linear_tuning import TUNE_SPEC

        return TUNE_SPEC

    def gpu_name(self, device: int | None) -> str:
        return gpu_name(device)

    def unmasked_fraction(self) -> float:
        return 1.0  # Problem.flops counts a linear problem's work itself

    def compile(self, cfg) -> None:
        """nvcc-compile the kernels the timed call runs (no initial or final state): the
        forward's, and in 'bwd' mode the backward's (at its config beside cfg), found through
        the registry."""
        from attnbench.linear import decay_needs_grad
        from engine.kernels.registry import kind_for

        shape, family = self._shape(), self.problem.family
        with compile_failures():
            kind_for(family, "fwd").build(shape, cfg).compile()
            if self.backward:
                kind_for(family, "bwd").build(shape, self._backward_config(cfg)).compile(
                    decay_grad=decay_needs_grad(self._variant()))

    def evaluate(self, cfg) -> Measurement:
        import torch

        from attnbench.tune.timing import tensor_bytes

        require_cuda()
        mod = self._module(cfg)
        inputs, args, learned, grad_out = self._inputs()
        qkv = [inputs[n] for n in ("q", "k", "v")]
        if self.backward:  # q, k, v and the learnable inputs, as in training
            qkv = [t.detach().requires_grad_(True) for t in qkv]
            leaves = [*qkv, *learned]

            def step():
                o = mod(*qkv, *args)
                return o, torch.autograd.grad(o, leaves, grad_out)
        else:

            def step():
                with torch.no_grad():
                    return mod(*qkv, *args), ()

        rel_err = self._check(*step())
        nbytes = tensor_bytes(inputs.values()) + 2 * tensor_bytes([grad_out])
        med, n = median_ms(step, self.reps, self.warmup, nbytes)
        return Measurement(med, {"rel_err": rel_err, "reps": n,
                                 "gpu_env": os.environ.get("CUDA_VISIBLE_DEVICES", "")})

    def _inputs(self) -> tuple[dict, list, tuple, object]:
        """(the case's inputs, the call's arguments after q, k, v, the leaves among them that
        a backward differentiates, the output gradient)."""
        from attnbench.linear import linear_args, make_linear_inputs

        key = (self.problem, self.seed)
        if key not in _INPUTS:
            _INPUTS.clear()  # one study per worker: free the last one's inputs first
            _REFERENCE.clear()
            inputs, grad_out = make_linear_inputs(self.case, self._variant(), "cuda", self.seed)
            args, learned = linear_args(self._variant(), inputs, self.backward)
            _INPUTS[key] = (inputs, args, learned, grad_out)
        return _INPUTS[key]

    def _check(self, out, grads) -> float:
        """The worst relative error of row 0's output and gradients against the variant's
        reference: q, k, v's, and each learnable input's whose first axis is the batch's
        (Mamba2's dt, a learned decay: their gradients carry the decays', which the dQ/dK
        kernel computes per config); one the rows share (Mamba2's A) sums over all rows, so
        only at batch 1. Those cancel as the decays' gradient does: learned_rtol."""
        from attnbench.linear import batch_major, learned_names

        key = (self.problem, self.seed)
        if key not in _REFERENCE:
            _REFERENCE[key] = self._reference()
        want = _REFERENCE[key]
        inputs = self._inputs()[0]
        learned = learned_names(self._variant(), inputs)
        names = ["output", "dq", "dk", "dv", *("d" + n for n in learned)]
        per_row = [True] * 4 + [batch_major(inputs[n], self.case.batch) for n in learned]
        pairs = [(n, got[:1], w) for n, got, w, row in
                 zip(names, (out, *grads), want, per_row, strict=False) if row]
        where = f"batch row 0 of {self.case.name}"
        return max(check_close(pairs[:4], self.rtol, where),
                   check_close(pairs[4:], self.learned_rtol, where))

    def _reference(self) -> tuple:
        import torch

        from attnbench.linear import linear_reference, slice_inputs

        case = self.case
        inputs, _, _, grad_out = self._inputs()
        # sequence 0 of every input (the rest shared whole, a tensor under two names one)
        row = slice_inputs(inputs, 0, slice(None), case, torch.float32)
        one = dataclasses.replace(case, batch=1)
        return linear_reference(one, self._variant(), row, grad_out[:1], torch.float32,
                                self.backward)
