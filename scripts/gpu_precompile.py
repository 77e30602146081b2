"""Compile the engine kernels a suite will need, in parallel (run before `attnbench run`)."""

from __future__ import annotations

import sys
import time

import torch

from attnbench.impls.base import TORCH_DTYPES
from attnbench.suites import load_suite
from engine.runtime.backward_kernels import backward_kernels_for
from engine.runtime.precompile import precompile
from engine.runtime.tilelang_backend import kernel_backward_problem, kernels_for
from engine.variants import get_variant


def main(names: list[str]) -> int:
    srcs = []
    for name in names:
        for c in load_suite(name).cases:
            engines = [i for i in ("engine", "engine-dynamic", "engine-deterministic")
                       if i in c.impls]
            if not engines or c.kind != "attention":
                continue
            v = get_variant(c.variant)
            if v.supports(
                head_dim=c.head_dim,
                head_dim_v=c.head_dim_v,
                heads_q=c.heads_q,
                heads_kv=c.heads_kv,
                seqlen_q=c.seqlen_q,
                seqlen_kv=c.seqlen_kv,
            ):
                continue
            sizes = dict(batch=c.batch, heads_q=c.heads_q, heads_kv=c.heads_kv,
                         seqlen_q=c.seqlen_q, seqlen_kv=c.seqlen_kv, head_dim=c.head_dim,
                         head_dim_v=c.head_dim_v, dtype=TORCH_DTYPES[c.dtype])
            mod = v.build(**sizes, backend="tilelang")
            srcs.append(kernels_for(mod).forward_source)
            if "engine-dynamic" in engines:
                dyn = v.build(**sizes, backend="tilelang")
                dyn.dynamic_shapes = True
                srcs.append(kernels_for(dyn).forward_source)
            if set(c.modes) - {"fwd"} and kernel_backward_problem(mod) is None:
                srcs += backward_kernels_for(mod).sources()
                if "engine-deterministic" in engines:
                    srcs += backward_kernels_for(mod, deterministic=True).sources()
    t = time.time()
    errors = precompile(srcs)
    print(f"precompiled {len(set(srcs))} kernels in {time.time() - t:.0f}s, {len(errors)} failed")
    for e in errors.values():
        print("  ", e[:300])
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main(sys.argv[1:]))
