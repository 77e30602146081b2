"""AttentionEngine under torch.compile (issue 20, CPU part): the forward and backward as
torch.library custom ops (opcheck), fake implementations that give every variant's shapes,
fullgraph compilation without graph breaks, and a small transformer trained compiled against
the same model with SDPA. On the CPU the ops run the reference executor (the backend `aot_eager`
needs no C++ compiler); on a Hopper GPU the same ops run the kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from engine import AttentionEngine, CustomIO, OnlineSoftmax, meta_tensor
from engine.runtime.ops import attention_forward
from engine.variants import VARIANTS
from tests import small_transformer

SIZES = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=24, seqlen_kv=24, head_dim=16,
             head_dim_v=16)


def _alibi_module(B=2, H=4, S=24, D=16):
    io = CustomIO({"slopes": ("heads",)})

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return score * D**-0.5 + custom_fwd_inputs["slopes"] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    meta = tuple(meta_tensor(B, H, S, D, dtype=torch.float32) for _ in range(3))
    return AttentionEngine(meta, io, score_mod=score_mod, mask_mod=causal,
                           online_func=OnlineSoftmax())


def _inputs(mod_shape=(2, 24, 4, 16), seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*mod_shape, generator=g).requires_grad_(grad) for _ in range(3))
    slopes = (torch.rand(mod_shape[2], generator=g) * 0.5).requires_grad_(grad)
    return q, k, v, slopes


def test_opcheck_forward_and_its_backward():
    mod = _alibi_module()
    q, k, v, slopes = _inputs()
    result = torch.library.opcheck(attention_forward, (mod._op_handle, q, k, v, [slopes]))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fake_outputs_have_the_real_shapes(name):
    v = VARIANTS[name]
    mod = v.build(**SIZES, dtype=torch.float32, backend="reference")
    inp = v.make_inputs(**SIZES, dtype=torch.float32, seed=1)
    custom = [inp[n] for n in mod.custom_io.names()]
    real = attention_forward(mod._op_handle, inp["q"], inp["k"], inp["v"], custom)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        args = [fake.from_tensor(inp[n]) for n in "qkv"]
        faked = attention_forward(mod._op_handle, *args, [fake.from_tensor(c) for c in custom])
    assert [(t.shape, t.dtype) for t in faked] == [(t.shape, t.dtype) for t in real]


def test_fullgraph_compile_matches_eager_without_graph_breaks():
    mod = _alibi_module()
    q, k, v, slopes = _inputs()

    def step(q, k, v, slopes):
        return (mod(q, k, v, slopes) ** 2).sum()

    explained = torch._dynamo.explain(step)(q, k, v, slopes)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    targets = [str(n.target) for n in explained.graphs[0].graph.nodes]
    assert "engine.attention_forward.default" in targets, "the op, not an inlined eager path"
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, slopes)
    grads = torch.autograd.grad(got, (q, k, v, slopes))
    want = step(q, k, v, slopes)
    want_grads = torch.autograd.grad(want, (q, k, v, slopes))
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_a_small_transformer_trains_compiled_like_sdpa():
    torch._dynamo.reset()
    engine_model, sdpa_model = small_transformer.model(True), small_transformer.model(False)
    sdpa_model.load_state_dict(engine_model.state_dict())
    explained = torch._dynamo.explain(engine_model)(torch.zeros(4, 16, dtype=torch.long))
    assert explained.graph_break_count == 0
    torch._dynamo.reset()
    data = small_transformer.batches(20, batch=4, seqlen=16, vocab=50)
    got = small_transformer.train(engine_model, data, 50, compiled=True, backend="aot_eager")
    want = small_transformer.train(sdpa_model, data, 50, compiled=False)
    assert want[-1] < want[0] - 0.1, "the reference model must learn something"
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    assert all(math.isfinite(x) for x in got)


def test_a_copied_module_outlives_its_original_under_compile():
    import copy
    import gc

    original = _alibi_module()
    mod = copy.deepcopy(original)
    assert mod._op_handle != original._op_handle
    del original
    gc.collect()
    q, k, v, slopes = _inputs(grad=False)
    torch._dynamo.reset()
    got = torch.compile(lambda *a: mod(*a), fullgraph=True, backend="aot_eager")(q, k, v, slopes)
    torch.testing.assert_close(got, mod(q, k, v, slopes))


def test_export_keeps_the_ops_and_runs_beside_its_modules(tmp_path):
    """torch.export: the attention layers stay the engine's ops in the exported graph, which
    computes what the eager model does (custom inputs included) and survives a save and a
    load; once its modules are gone its ops say so, naming the handle."""
    import gc

    model, x = small_transformer.model(True), torch.randint(0, 50, (4, 16))
    ep = torch.export.export(model, (x,))
    ops = [n for n in ep.graph.nodes if str(n.target) == "engine.attention_forward.default"]
    assert len(ops) == 2
    torch.export.save(ep, tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)

    class Alibi(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.slopes = _alibi_module(), nn.Parameter(torch.rand(4) * 0.5)

        def forward(self, q, k, v):
            return self.attn(q, k, v, self.slopes)

    alibi, (q, k, v, _) = Alibi(), _inputs(grad=False)
    exported = torch.export.export(alibi, (q, k, v)).module()
    torch.testing.assert_close(exported(q, k, v), alibi(q, k, v), rtol=0, atol=0)
    del model, alibi
    gc.collect()
    with pytest.raises(RuntimeError, match=r"no AttentionEngine with handle \d+ in this process"):
        loaded(x)
