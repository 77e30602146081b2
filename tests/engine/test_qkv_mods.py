"""q/k/v mods on AttentionEngine (issue 19, seed 001): each mod and all three together against
the same computation written directly in torch (forward and the gradients of q, k, v and of
CustomIO tensors the mods read), both signatures, GQA (a key mod's h is the kv head), the
kernels unchanged by mods, torch.compile without graph breaks, and every malformed mod a
TraceError naming it. CPU, reference backend."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from engine import AttentionEngine, CustomIO, OnlineSoftmax, TraceError, meta_tensor, where
from engine.dsl.expr import leaf
from engine.ir.tensor_mods import mod_only_customs
from engine.reference.executor import rel_err

B, HQ, SQ, SKV, D = 2, 4, 20, 28, 16
IO = CustomIO({"gate": ("heads",), "q_scale": ("heads",), "shift": ("batch", "seq_len_kv")})
# ||got - want|| / ||want|| (bf16: the attention's dq, dk, dv are rounded before they reach
# the mods' backward, so a per-head gradient summed over many of them is off by a little more)
REL_ERR = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
    return score * D**-0.5


def causal(b, h, q_idx, kv_idx):
    return q_idx + (SKV - SQ) >= kv_idx


# The mods under test, and the same functions of plain tensors ([B, S, H, D] layout).
def query_mod(x, custom_fwd_inputs, b, h, pos):
    # QK-norm style: a learnable per-head scale (an elementwise mod cannot take a norm over D)
    return x * custom_fwd_inputs["q_scale"] + 0.01 * pos


def key_mod(x, custom_fwd_inputs, b, h, pos):
    return x * custom_fwd_inputs["gate"].sigmoid() + custom_fwd_inputs["shift"]


def value_mod(x, custom_fwd_inputs, b, h, pos):
    return where(pos % 2 == 0, x.tanh(), x * (b + 1))


def torch_query(x, c):
    return x * c["q_scale"].view(1, 1, -1, 1) + 0.01 * torch.arange(x.shape[1]).view(1, -1, 1, 1)


def torch_key(x, c):
    hkv = x.shape[2]  # the kv head indexes the "heads" input: gate[:Hkv]
    return x * torch.sigmoid(c["gate"][:hkv]).view(1, 1, hkv, 1) + c["shift"][:, :, None, None]


def torch_value(x, c):
    even = (torch.arange(x.shape[1]) % 2 == 0).view(1, -1, 1, 1)
    return torch.where(even, x.tanh(), x * (torch.arange(x.shape[0]) + 1).view(-1, 1, 1, 1))


MODS = {"query": (query_mod, torch_query), "key": (key_mod, torch_key),
        "value": (value_mod, torch_value)}


def _meta(dtype, hkv, sq=SQ, skv=SKV):
    return (meta_tensor(B, HQ, sq, D, dtype=dtype), meta_tensor(B, hkv, skv, D, dtype=dtype),
            meta_tensor(B, hkv, skv, D, dtype=dtype))


def _module(dtype=torch.float32, hkv=HQ, io=IO, **mods):
    return AttentionEngine(_meta(dtype, hkv), io, score_mod=score_mod, mask_mod=causal,
                           online_func=OnlineSoftmax(), backend="reference", **mods)


def _inputs(dtype, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(B, s, h, D, generator=g).to(dtype).requires_grad_()
           for s, h in ((SQ, HQ), (SKV, hkv), (SKV, hkv))]
    customs = {"gate": torch.randn(HQ, generator=g), "q_scale": torch.rand(HQ, generator=g) + 0.5,
               "shift": torch.randn(B, SKV, generator=g) * 0.1}
    return qkv, {n: t.requires_grad_() for n, t in customs.items()}


def _torch_attention(q, k, v):
    """Causal softmax attention of [B, S, H, D] tensors in float32 (GQA by repetition)."""
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))
    kh, vh = (t.repeat_interleave(groups, dim=1) for t in (kh, vh))
    allowed = torch.ones(SQ, SKV, dtype=torch.bool).tril(SKV - SQ)
    s = (qh @ kh.transpose(-1, -2) * D**-0.5).masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2).to(q.dtype)


def _torch_modded(which, q, k, v, c):
    """The direct computation: the mods in float32, cast back, then the attention."""
    out = []
    for name, x in zip(("query", "key", "value"), (q, k, v), strict=True):
        out.append(MODS[name][1](x.float(), c).to(x.dtype) if name in which else x)
    return _torch_attention(*out)


def _check_against_torch(mod, which, dtype, hkv, seed=0):
    (q, k, v), c = _inputs(dtype, hkv, seed)
    leaves = [q, k, v, *c.values()]
    got = mod(q, k, v, *c.values())
    do = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    got_grads = torch.autograd.grad(got, leaves, do, allow_unused=True)
    want = _torch_modded(which, q, k, v, c)
    want_grads = torch.autograd.grad(want, leaves, do, allow_unused=True)
    assert rel_err(got, want) < REL_ERR[dtype], f"o: relative error {rel_err(got, want):.2e}"
    for name, a, w in zip(("dq", "dk", "dv", *c), got_grads, want_grads, strict=True):
        if w is None:  # an input the direct computation does not read
            assert a is None or not a.any(), name
        else:
            assert rel_err(a, w) < REL_ERR[dtype], f"{name}: relative error {rel_err(a, w):.2e}"


# ----------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hkv", [HQ, 1], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("which", [("query",), ("key",), ("value",), ("query", "key", "value")],
                         ids=lambda w: "+".join(w))
def test_mods_match_the_direct_torch_computation(which, hkv, dtype):
    mod = _module(dtype, hkv, **{f"{n}_mod": MODS[n][0] for n in which})
    _check_against_torch(mod, which, dtype, hkv)


def test_key_mod_reads_heads_inputs_at_the_kv_head():
    """GQA 4: the key mod's h is the kv head (0 here), so only gate[0] gets a gradient."""
    mod = _module(hkv=1, key_mod=key_mod)
    (q, k, v), c = _inputs(torch.float32, 1)
    mod(q, k, v, *c.values()).sum().backward()
    assert c["gate"].grad[0] != 0 and not c["gate"].grad[1:].any()


def test_one_argument_form_and_torch_functions():
    (q, k, v), c = _inputs(torch.float32, HQ)
    plain = _module()
    cases = [
        (dict(query_mod=lambda q: q * 0.5), (q * 0.5, k, v)),
        (dict(key_mod=torch.sigmoid), (q, torch.sigmoid(k), v)),  # a builtin: no signature
        (dict(value_mod=lambda v: torch.sin(v) * 2), (q, k, torch.sin(v) * 2)),
    ]
    for mods, modded in cases:
        got = _module(**mods)(q, k, v, *c.values())
        torch.testing.assert_close(got, plain(*modded, *c.values()), rtol=1e-5, atol=1e-5)


def test_explicit_index_reads_as_the_default_read():
    def indexed(x, custom_fwd_inputs, b, h, pos):
        g = custom_fwd_inputs["gate"][h].sigmoid()
        return x * g + custom_fwd_inputs["shift"][b, pos]

    (q, k, v), c = _inputs(torch.float32, 2)
    got = _module(hkv=2, key_mod=indexed)(q, k, v, **c)  # customs by name
    want = _module(hkv=2, key_mod=key_mod)(q, k, v, *c.values())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_mod_that_ignores_x_is_broadcast():
    (q, k, v), c = _inputs(torch.float32, HQ)
    mod = _module(value_mod=lambda x, custom_fwd_inputs, b, h, pos: pos * 0.1)
    ramp = (torch.arange(SKV) * 0.1).view(1, SKV, 1, 1).expand(v.shape)
    torch.testing.assert_close(mod(q, k, v, *c.values()), _torch_attention(q, k, ramp))


def test_customs_read_by_score_mod_and_a_mod_get_both_gradients():
    io = CustomIO({"slopes": ("heads",)})

    def alibi(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return score * D**-0.5 + custom_fwd_inputs["slopes"] * (kv_idx - q_idx)

    def scaled_q(x, custom_fwd_inputs, b, h, pos):
        return x * custom_fwd_inputs["slopes"].exp()

    mod = AttentionEngine(_meta(torch.float32, HQ, SQ, SQ), io, score_mod=alibi,
                          online_func=OnlineSoftmax(), backend="reference", query_mod=scaled_q)
    assert mod_only_customs(mod.qkv_mods, mod.spec) == frozenset()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, SQ, HQ, D, generator=g).requires_grad_() for _ in range(3))
    slopes = (torch.rand(HQ, generator=g) * 0.3).requires_grad_()
    got = torch.autograd.grad(mod(q, k, v, slopes).sum(), (q, k, v, slopes))
    qm = (q * slopes.exp().view(1, 1, HQ, 1)).transpose(1, 2)
    rel = (torch.arange(SQ)[None, :] - torch.arange(SQ)[:, None]).float()
    s = qm @ k.transpose(1, 2).transpose(-1, -2) * D**-0.5 + slopes.view(HQ, 1, 1) * rel
    want_o = (s.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)
    want = torch.autograd.grad(want_o.sum(), (q, k, v, slopes))
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, atol=1e-4, rtol=1e-4)


def test_mod_only_customs_go_to_the_attention_detached():
    mod = _module(query_mod=query_mod, key_mod=key_mod)
    assert mod_only_customs(mod.qkv_mods, mod.spec) == {"gate", "q_scale", "shift"}
    (q, k, v), c = _inputs(torch.float32, HQ)
    _, _, _, customs = mod._apply_mods(q, k, v, list(c.values()))
    assert not any(t.requires_grad for t in customs)


def test_without_mods_nothing_changes():
    plain, modded = _module(), _module(query_mod=lambda q: q * 0.5, key_mod=key_mod)
    assert plain.qkv_mods is None and plain.ir_text == plain.spec.describe()
    assert modded.spec_hash == plain.spec_hash  # the mods are not part of the spec
    assert modded.ir_text.endswith(
        "query_mod = mul(tensor, 0.5)\n"
        "key_mod = add(mul(tensor, sigmoid(gate[h])), shift[b, kv])")
    meta = (meta_tensor(B, HQ, 256, 64, dtype=torch.bfloat16),) * 3
    kernels = [AttentionEngine(meta, IO, score_mod=score_mod, mask_mod=causal, **mods)
               .kernel_sources(("fwd", "bwd")) for mods in ({}, dict(key_mod=key_mod))]
    assert kernels[0] == kernels[1]


def test_fullgraph_compile_without_graph_breaks():
    mod = _module(query_mod=query_mod, key_mod=key_mod, value_mod=value_mod)
    (q, k, v), c = _inputs(torch.float32, HQ)
    leaves = (q, k, v, *c.values())

    def step(*args):
        return (mod(*args) ** 2).sum()

    explained = torch._dynamo.explain(step)(*leaves)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(*leaves)
    grads = torch.autograd.grad(got, leaves)
    want = step(*leaves)
    want_grads = torch.autograd.grad(want, leaves)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- errors
def _full(body):
    """A five-parameter mod returning body(x, custom_fwd_inputs, b, h, pos)."""
    def mod(x, custom_fwd_inputs, b, h, pos):
        return body(x, custom_fwd_inputs, b, h, pos)

    return mod


ROWSCALE = leaf("rowscale", ("m",), "m")
TILE_O = leaf("o", ("m", "d"))
ERRORS = [
    (dict(query_mod=3), r"query_mod: expected a callable \(x\) or \(x, custom_fwd_inputs"),
    (dict(key_mod=lambda x, y: x), r"key_mod takes 2 positional parameters; expected \(x\)"),
    (dict(value_mod=lambda x: x > 0), r"value_mod: the result is boolean"),
    (dict(value_mod=lambda x: True), r"value_mod: the result is boolean"),
    (dict(query_mod=lambda x: None), r"query_mod: the result: cannot use a NoneType"),
    (dict(query_mod=lambda x: "x"), r"query_mod: the result: cannot use a str"),
    (dict(key_mod=lambda x: x.get_reduce("sum")), r"key_mod: .*get_reduce\('sum'\)"),
    (dict(query_mod=lambda x: x.get_reduce("max")), r"query_mod: get_reduce needs a score"),
    (dict(query_mod=lambda x: x.sum(-1)), r"query_mod: the DSL has no operation 'sum'"),
    (dict(query_mod=lambda x: F.normalize(x)), r"query_mod: torch function .*normalize"),
    (dict(query_mod=lambda x: x * ROWSCALE), r"query_mod: the result reads 'rowscale'"),
    (dict(query_mod=lambda x: x + TILE_O), r"query_mod: the result reads 'o'"),
    (dict(key_mod=_full(lambda x, c, b, h, pos: x * c["nope"])),
     r"key_mod: CustomIO: no input named 'nope'"),
    (dict(key_mod=_full(lambda x, c, b, h, pos: x * c["qpos"])),
     r"key_mod: the result varies along the query position \(q_idx\)"),
    (dict(query_mod=_full(lambda x, c, b, h, pos: x * c["shift"])),
     r"query_mod: the result varies along the key position \(kv_idx\)"),
]


@pytest.mark.parametrize("mods, match", ERRORS, ids=[m for _, m in ERRORS])
def test_malformed_mods_raise_a_trace_error_naming_them(mods, match):
    io = CustomIO({**IO.decls, "qpos": ("batch", "seq_len")})
    with pytest.raises(TraceError, match=match):
        _module(io=io, **mods)


@pytest.mark.parametrize("index, shape", [
    (("b", "h", "q"), (2, 3, 5)),      # [batch, heads, seq_len]: the axes permuted
    ((0, "h"), (1, 3)),                # [1, heads]: a unit dim read at 0
    (("q",), (7,)),                    # longer than the sequence: narrowed
    (("h", "b"), (3, 2)),              # dims in another order than the layout's
    (("b", 0, "q"), (2, 4, 5)),        # a dim read at 0 that is not of size 1
])
def test_custom_reads_at_whole_ranges_are_views_equal_to_the_gather(index, shape):
    """A custom read at the layout's aranges (every tensor mod's) is a strided view: the same
    values as the indexed gather, and the same gradient (as a sum instead of a scatter)."""
    from engine.reference.evaluate import Env, _as_tile, custom_index, custom_view
    from engine.reference.tensor_mods import _layout_index, _layout_ranges

    B, S, H = 2, 5, 3
    env = Env(dtype=torch.float32, device=torch.device("cpu"),
              index=_layout_index(B, S, H, "q", torch.device("cpu")),
              ranges=_layout_ranges(B, S, H, "q"))
    t = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    view = custom_view(t, index, env)
    gather = _as_tile(t[tuple(custom_index(index, env, t.device))])
    assert view is not None and view.shape == gather.shape and torch.equal(view, gather)
    w = torch.randn(B, S, H, 4, dtype=torch.float64)
    grads = [torch.autograd.grad((y * w).sum(), t)[0] for y in (view, gather)]
    torch.testing.assert_close(grads[0], grads[1])
    # outside the ranges (decode's absolute positions) or a name read twice: the gather
    assert custom_view(t, index, Env(dtype=torch.float32, device=torch.device("cpu"),
                                     index=env.index)) is None
    assert custom_view(torch.zeros(3, 3), ("h", "h"), env) is None
