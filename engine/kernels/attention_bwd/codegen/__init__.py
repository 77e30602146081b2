"""The backward's code generators (TileLang source from a TracedSpec and a BackwardPlan),
kernels mirroring the reference executor's `backward()`:

- passes.py: preprocess (only when the spec's `bwd` reads `doosum`): Delta[b, h, q] =
  sum_d dO * O (fp32); dQ postprocess (warp-specialised schedule): fragment order -> rows.
- main.py: the main kernel (dK, dV, dQ and the custom gradients), with step.py (one step of
  its walk), tiles.py (P and dS loops), vectors.py (per-position register vectors), roles.py
  (the warp-specialised schedule's rings and roles) and frame.py (the texts they share).
- dq_kernel.py: the dQ kernel (the deterministic mode's, and the head-split schedule's past
  D 128: plan.separate_dq), dQ in the input dtype.

The launcher (launch.py beside this package) casts the automatic pipeline's dQ and sums the
deterministic mode's per-head dK/dV under GQA.
"""

from engine.kernels.attention_bwd.codegen.dq_kernel import generate_backward_dq
from engine.kernels.attention_bwd.codegen.fragments import dq_fragment_index, dq_fragment_position
from engine.kernels.attention_bwd.codegen.main import generate_backward
from engine.kernels.attention_bwd.codegen.passes import generate_dq_postprocess, generate_preprocess

__all__ = [
    "dq_fragment_index",
    "dq_fragment_position",
    "generate_backward",
    "generate_backward_dq",
    "generate_dq_postprocess",
    "generate_preprocess",
]
