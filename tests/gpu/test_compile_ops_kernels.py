"""AttentionEngine inside torch.compile on the GPU (pytest -m gpu): the custom ops run the
generated kernels, forward and backward, with no graph break; opcheck on the kernels; a small
transformer trained in bf16 under torch.compile(fullgraph=True) against SDPA; torch.export
(issue 20)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from engine.reference.executor import rel_err
from engine.runtime.ops import attention_backward, attention_forward
from engine.variants import VARIANTS
from tests import small_transformer
from tests.gpu.cases import documents

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



@pytest.mark.parametrize("name", ["softmax_causal", "gemma2", "alibi", "document_prefix"])
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
        if "doc_ids" in fresh:  # other documents: the graph classifies their blocks
            fresh.update(documents(seed, fresh))
        with torch.no_grad():
            for n in names:
                inp[n].copy_(fresh[n])
        got, got_g = step(compiled)
        want, want_g = step(forward)
        assert rel_err(got, want) < 1e-3, f"seed {seed}"
        for n, a, b in zip(names, got_g, want_g, strict=True):
            assert rel_err(a, b) < 1e-2, f"d{n}, seed {seed}"


@pytest.mark.parametrize("name,head_dim,deterministic", [
    ("softmax_causal", 128, False), ("gemma2", 256, False), ("alibi", 128, True)])
def test_opcheck_on_the_kernels(name, head_dim, deterministic):
    """torch.library.opcheck of both ops where they run the kernels (schema, fake tensors,
    autograd registration, AOT dispatch with dynamic shapes): the forward with gradients
    wanted for q, k, v and the learnable inputs, the backward on its own. opcheck compares
    eager and AOT gradients at assert_close's tolerances, which an fp32 custom gradient summed
    by atomics in another order can miss (ALiBi's slopes did): ALiBi runs the deterministic
    backward, so the check is bitwise."""
    v = VARIANTS[name]
    sizes = {**SIZES, "head_dim": head_dim, "head_dim_v": head_dim}
    mod = v.build(**sizes, dtype=torch.bfloat16, backend="tilelang")
    mod.deterministic = deterministic
    inp = v.make_inputs(**sizes, dtype=torch.bfloat16, device="cuda", seed=4, requires_grad=True)
    names = mod.custom_io.names()
    custom = [inp[n] for n in names]
    args = (mod._op_handle, inp["q"], inp["k"], inp["v"], custom)
    result = torch.library.opcheck(attention_forward, args)
    assert set(result.values()) == {"SUCCESS"}, result
    q, k, v_, *cs = (t.detach() for t in (inp["q"], inp["k"], inp["v"], *custom))
    o, *finals = attention_forward(mod._op_handle, q, k, v_, cs)
    do = torch.randn_like(o)
    wants = [n in v.learnable for n in names]
    result = torch.library.opcheck(attention_backward,
                                   (mod._op_handle, q, k, v_, o, finals, do, cs, wants))
    assert set(result.values()) == {"SUCCESS"}, result


# Causal language modelling of rows that count by a stride (small_transformer.batches), 2
# layers of 4 heads at D 64.
LM = dict(dim=256, heads=4, seqlen=256, batch=8, vocab=128, layers=2)


def test_a_small_transformer_trains_in_bf16_compiled_like_sdpa():
    """50 Adam steps under bf16 autocast, both models compiled by inductor with fullgraph=True
    (so the rest of the model's numerics are the same): the engine's loss curve within bf16
    tolerance of SDPA's (0.5% of the loss plus 0.005 a step; on the H200 the curves, 5.02 ->
    0.38, differed by 0.0004 at most, and SDPA compiled from SDPA eager by 0.0003), and no
    graph break."""
    data = small_transformer.batches(50, LM["batch"], LM["seqlen"], LM["vocab"], counting=True,
                                     device="cuda")
    engine_model = small_transformer.model(True, **LM, attn_dtype=torch.bfloat16, device="cuda")
    sdpa_model = small_transformer.model(False, **LM, device="cuda")
    sdpa_model.load_state_dict(engine_model.state_dict())
    eager_model = small_transformer.model(False, **LM, device="cuda")
    eager_model.load_state_dict(engine_model.state_dict())
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(engine_model)(data[0][:, :-1])
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    kw = dict(vocab=LM["vocab"], optimizer="adam", lr=1e-3, autocast=torch.bfloat16)
    got = small_transformer.train(engine_model, data, compiled=True, **kw)
    want = small_transformer.train(sdpa_model, data, compiled=True, **kw)
    eager = small_transformer.train(eager_model, data, compiled=False, **kw)
    gaps = [abs(a - b) for a, b in zip(got, want, strict=True)]
    print("losses every 7 steps: engine", [round(x, 4) for x in got[::7]], "SDPA",
          [round(x, 4) for x in want[::7]], "SDPA eager", [round(x, 4) for x in eager[::7]])
    print(f"losses engine {got[0]:.4f} -> {got[-1]:.4f}, SDPA {want[0]:.4f} -> {want[-1]:.4f}; "
          f"largest gap {max(gaps):.4f} (SDPA compiled against eager: "
          f"{max(abs(a - b) for a, b in zip(want, eager, strict=True)):.4f})")
    assert want[-1] < want[0] - 0.5, "the reference model must learn something"
    assert all(g <= 0.005 * w + 0.005 for g, w in zip(gaps, want, strict=True)), (got, want)


def test_export_runs_the_kernels_like_the_eager_model():
    """torch.export of the small transformer in bf16 on the GPU: its attention layers stay the
    engine's op, and the exported program gives the eager model's logits."""
    net = small_transformer.model(True, **LM, attn_dtype=torch.bfloat16, device="cuda")
    net = net.to(torch.bfloat16)
    x = small_transformer.batches(1, LM["batch"], LM["seqlen"], LM["vocab"],
                                  device="cuda")[0][:, :-1]
    ep = torch.export.export(net, (x,))
    ops = [n for n in ep.graph.nodes if str(n.target) == "engine.attention_forward.default"]
    assert len(ops) == LM["layers"]
    with torch.no_grad():
        assert rel_err(ep.module()(x), net(x)) < 1e-3
