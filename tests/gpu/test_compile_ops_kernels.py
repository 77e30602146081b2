"""AttentionEngine inside torch.compile on the GPU (pytest -m gpu): the custom ops run the
generated kernels, forward and backward, with no graph break (issue 20)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from engine.reference.executor import rel_err
from engine.variants import VARIANTS

pytestmark = pytest.mark.gpu

SIZES = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1024, seqlen_kv=1024, head_dim=128,
             head_dim_v=128)


@pytest.mark.parametrize("name", ["softmax_causal", "alibi"])
def test_compiled_module_matches_eager(name):
    v = VARIANTS[name]
    mod = v.build(**SIZES, dtype=torch.bfloat16, backend="tilelang")
    inp = v.make_inputs(**SIZES, dtype=torch.bfloat16, device="cuda", seed=3,
                        requires_grad=True)
    names = ["q", "k", "v", *v.learnable]
    customs = {n: inp[n] for n in mod.custom_io.names()}

    def step(q, k, v_, customs):
        return mod(q, k, v_, **customs).float().square().mean()

    explained = torch._dynamo.explain(step)(inp["q"], inp["k"], inp["v"], customs)
    assert explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(inp["q"], inp["k"], inp["v"], customs)
    got_g = torch.autograd.grad(got, [inp[n] for n in names])
    want = step(inp["q"], inp["k"], inp["v"], customs)
    want_g = torch.autograd.grad(want, [inp[n] for n in names])
    assert rel_err(got, want) < 1e-3
    for n, a, b in zip(names, got_g, want_g, strict=True):
        assert rel_err(a, b) < 1e-2, n



@pytest.mark.parametrize("name", ["softmax_causal", "gemma2", "alibi"])
def test_reduce_overhead_replays_forward_and_backward(name):
    """mode="reduce-overhead" records the compiled forward and its backward as CUDA graphs.
    Its warm-up routes allocations into the graphs' pool, where the module's cached block
    tables must not land (the models suite's engine-compiled rows failed so). Replayed on new
    data written into the same inputs, against eager calls."""
    v = VARIANTS[name]
    mod = v.build(**SIZES, dtype=torch.bfloat16, backend="tilelang")
    names = ["q", "k", "v", *v.learnable]
    inp = v.make_inputs(**SIZES, dtype=torch.bfloat16, device="cuda", seed=5, requires_grad=True)
    customs = {n: inp[n] for n in mod.custom_io.names()}
    leaves = [inp[n] for n in names]
    for t in leaves:
        torch._dynamo.mark_static_address(t)

    def forward():
        return mod(inp["q"], inp["k"], inp["v"], **customs)

    def step(fn):
        out = fn()
        grads = torch.autograd.grad(out.float().square().mean(), leaves)
        return out.detach().clone(), [g.clone() for g in grads]

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        step(compiled)
    for seed in (6, 7):
        fresh = v.make_inputs(**SIZES, dtype=torch.bfloat16, device="cuda", seed=seed)
        with torch.no_grad():
            for n in names:
                inp[n].copy_(fresh[n])
        got, got_g = step(compiled)
        want, want_g = step(forward)
        assert rel_err(got, want) < 1e-3, f"seed {seed}"
        for n, a, b in zip(names, got_g, want_g, strict=True):
            assert rel_err(a, b) < 1e-2, f"d{n}, seed {seed}"
