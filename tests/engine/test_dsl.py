"""The DSL's operations, evaluated with torch, against the same formula written in torch; index
and CustomIO reads inside score_mod, mask_mod and a user-written OnlineFunc."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine import (
    AttentionEngine,
    CustomIO,
    DSLError,
    OnlineFunc,
    OnlineSoftmax,
    SymbolScalar,
    Var,
    exp,
    exp2,
    log,
    log2,
    maximum,
    meta_tensor,
    minimum,
    sigmoid,
    tanh,
    where,
)
from engine.dsl.expr import index_leaf, leaf
from engine.ir.trace import trace_spec
from engine.reference import executor
from engine.reference.evaluate import Env, evaluate

B, H, M, N = 2, 3, 5, 7


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def tiles():
    """A random score tile [B,H,M,N] (bounded away from 0) and a random row scale [B,H,M,1]."""
    g = _gen(1)
    s = torch.randn(B, H, M, N, generator=g, dtype=torch.float64)
    s = torch.where(s.abs() < 0.1, s + 0.3 * torch.sign(s + 1e-9), s)
    r = torch.randn(B, H, M, 1, generator=g, dtype=torch.float64)
    return s, r


def _eval(expr, s, r, mask=None):
    env = Env(
        dtype=torch.float64,
        device=torch.device("cpu"),
        leaves={"score": s},
        rowscale={"r": r},
        mask=mask,
    )
    (out,) = evaluate([expr], env)
    return out


S_LEAF = leaf("score", ("m", "n"))
R_LEAF = leaf("rowscale", ("m",), "r")

# (name, DSL form of f(s, r), torch form of f(s, r))
ELEMENTWISE = [
    ("add", lambda s, r: s + r, lambda s, r: s + r),
    ("radd_const", lambda s, r: 1.5 + s, lambda s, r: 1.5 + s),
    ("sub", lambda s, r: s - r, lambda s, r: s - r),
    ("rsub_const", lambda s, r: 2 - s, lambda s, r: 2 - s),
    ("mul", lambda s, r: s * r, lambda s, r: s * r),
    ("rmul_const", lambda s, r: 0.25 * s, lambda s, r: 0.25 * s),
    ("div", lambda s, r: s / (r.abs() + 0.5), lambda s, r: s / (r.abs() + 0.5)),
    ("rdiv_const", lambda s, r: 3.0 / s, lambda s, r: 3.0 / s),
    ("neg", lambda s, r: -s, lambda s, r: -s),
    ("exp", lambda s, r: s.exp(), lambda s, r: torch.exp(s)),
    ("exp_fn", lambda s, r: exp(s - r), lambda s, r: torch.exp(s - r)),
    ("exp2", lambda s, r: s.exp2(), lambda s, r: torch.exp2(s)),
    ("exp2_fn", lambda s, r: exp2(s), lambda s, r: torch.exp2(s)),
    ("log", lambda s, r: (s.abs() + 0.1).log(), lambda s, r: torch.log(s.abs() + 0.1)),
    ("log_fn", lambda s, r: log(s * s + 1.0), lambda s, r: torch.log(s * s + 1.0)),
    ("log2", lambda s, r: (s.abs() + 0.1).log2(), lambda s, r: torch.log2(s.abs() + 0.1)),
    ("log2_fn", lambda s, r: log2(s * s + 1.0), lambda s, r: torch.log2(s * s + 1.0)),
    ("tanh", lambda s, r: s.tanh(), lambda s, r: torch.tanh(s)),
    ("tanh_fn", lambda s, r: tanh(s * 0.5), lambda s, r: torch.tanh(s * 0.5)),
    ("sigmoid", lambda s, r: s.sigmoid(), lambda s, r: torch.sigmoid(s)),
    ("sigmoid_fn", lambda s, r: sigmoid(s + r), lambda s, r: torch.sigmoid(s + r)),
    ("abs", lambda s, r: s.abs(), lambda s, r: s.abs()),
    ("abs_builtin", lambda s, r: abs(s - r), lambda s, r: (s - r).abs()),
    ("max_row", lambda s, r: s.max(r), lambda s, r: torch.maximum(s, r)),
    ("max_const", lambda s, r: s.max(0.0), lambda s, r: torch.clamp(s, min=0.0)),
    ("maximum_fn", lambda s, r: maximum(r, s), lambda s, r: torch.maximum(s, r)),
    ("min_row", lambda s, r: s.min(r), lambda s, r: torch.minimum(s, r)),
    ("minimum_fn", lambda s, r: minimum(s, -0.5), lambda s, r: torch.clamp(s, max=-0.5)),
    ("pow2", lambda s, r: s.pow(2), lambda s, r: s**2),
    ("pow3_op", lambda s, r: s**3, lambda s, r: s**3),
    ("pow_half", lambda s, r: (s * s + 0.5).pow(0.5), lambda s, r: torch.sqrt(s * s + 0.5)),
    ("pow_neg", lambda s, r: (s.abs() + 1.0) ** -1.5, lambda s, r: (s.abs() + 1.0) ** -1.5),
    ("rpow_const", lambda s, r: 2.0**s, lambda s, r: torch.pow(2.0, s)),
    ("where", lambda s, r: where(s > r, s, r * 2.0), lambda s, r: torch.where(s > r, s, r * 2.0)),
    (
        "where_logic",
        lambda s, r: where((s > 0) & ~(s > 1.0) | (r < -1.0), s, 0.0),
        lambda s, r: torch.where(((s > 0) & ~(s > 1.0)) | (r < -1.0), s, torch.zeros_like(s)),
    ),
    (
        "where_cmp_all",
        lambda s, r: where((s >= r) & (s != 0.5) & (s <= 2.0) & (s < 3.0), 1.0, -1.0),
        lambda s, r: torch.where((s >= r) & (s != 0.5) & (s <= 2.0) & (s < 3.0), 1.0, -1.0),
    ),
]


@pytest.mark.parametrize("name,dsl,ref", ELEMENTWISE, ids=[e[0] for e in ELEMENTWISE])
def test_elementwise_ops_match_torch(tiles, name, dsl, ref):
    s, r = tiles
    expr = dsl(S_LEAF, R_LEAF)
    assert expr.axes == ("m", "n"), "a tile op with a row scale broadcasts to a tile"
    out = torch.broadcast_to(_eval(expr, s, r), s.shape)
    want = torch.broadcast_to(torch.as_tensor(ref(s, r), dtype=torch.float64), s.shape)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_row_scale_broadcasts_with_tile(tiles):
    s, r = tiles
    e = (S_LEAF - R_LEAF).exp() * R_LEAF
    assert R_LEAF.axes == ("m",) and e.axes == ("m", "n")
    torch.testing.assert_close(_eval(e, s, r), torch.exp(s - r) * r)
    row = R_LEAF * 2.0 + 1.0
    assert row.axes == ("m",)
    assert _eval(row, s, r).shape == (B, H, M, 1)


@pytest.mark.parametrize(
    "kind,ref",
    [
        ("max", lambda x: x.amax(-1, keepdim=True)),
        ("sum", lambda x: x.sum(-1, keepdim=True)),
        ("abssum", lambda x: x.abs().sum(-1, keepdim=True)),
        ("min", lambda x: x.amin(-1, keepdim=True)),
    ],
)
def test_row_reductions(tiles, kind, ref):
    s, r = tiles
    e = (S_LEAF * R_LEAF).get_reduce(kind)
    assert e.axes == ("m",)
    torch.testing.assert_close(_eval(e, s, r), ref(s * r))
    # Masked entries take no part in the reduction.
    mask = torch.rand(B, H, M, N, generator=_gen(5)) > 0.4
    mask[..., 0] = True
    x = s * r
    fill = {"max": -math.inf, "min": math.inf}.get(kind, 0.0)
    torch.testing.assert_close(_eval(e, s, r, mask=mask), ref(torch.where(mask, x, fill)))


def test_reduction_needs_a_tile():
    with pytest.raises(DSLError, match="get_reduce needs a score tile"):
        R_LEAF.get_reduce("sum")
    with pytest.raises(DSLError, match=r"get_reduce\('mean'\): expected one of"):
        S_LEAF.get_reduce("mean")


def test_index_leaves_evaluate_to_positions():
    b, h, q, kv = (index_leaf(n) for n in ("b", "h", "q", "kv"))
    e = b * 1000 + h * 100 + q * 10 - kv
    assert e.dtype == "int" and e.axes == ("m", "n")
    from engine.reference.evaluate import index_tensors

    q_idx, kv_idx = torch.arange(3, 3 + M), torch.arange(2, 2 + N)
    env = Env(
        dtype=torch.float64,
        device=torch.device("cpu"),
        index=index_tensors(B, H, q_idx, kv_idx, torch.device("cpu")),
    )
    (out,) = evaluate([e], env)
    bb, hh = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
    want = bb * 1000 + hh * 100 + q_idx.view(1, 1, -1, 1) * 10 - kv_idx.view(1, 1, 1, -1)
    assert torch.equal(out, want)


def test_misuse_of_the_dsl_raises():
    with pytest.raises(DSLError, match="constant exponent"):
        S_LEAF.pow(S_LEAF)
    with pytest.raises(DSLError, match="positive constant base"):
        (-2.0) ** S_LEAF
    with pytest.raises(DSLError, match="arithmetic 'mul' on a boolean"):
        (S_LEAF > 0) * S_LEAF
    with pytest.raises(DSLError, match="needs boolean operands"):
        (S_LEAF > 0) & S_LEAF
    with pytest.raises(DSLError, match="cond must be boolean"):
        where(S_LEAF, 1.0, 0.0)
    with pytest.raises(DSLError, match="no truth value"):
        bool(S_LEAF > 0)
    with pytest.raises(DSLError, match="cannot use a Tensor"):
        S_LEAF + torch.ones(3)
    with pytest.raises(DSLError, match="no operation 'cosh'"):
        S_LEAF.cosh()
    with pytest.raises(DSLError, match="Python float"):
        float(S_LEAF)
    with pytest.raises(DSLError, match="cannot be iterated"):
        list(S_LEAF)
    with pytest.raises(DSLError, match="only CustomIO tensors can be indexed"):
        S_LEAF[0]


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"x": ("time",)}, "not one of"),
        ({"x": ("heads", "heads")}, "appears twice"),
        ({"x": (0,)}, "expected a named dim or a positive integer size"),
        ({"x": (2.5,)}, "expected a named dim or a positive integer size"),
        ({"x": (True,)}, "expected a named dim or a positive integer size"),
        ({"x": ()}, "at least one dim"),
        ({"q": ("heads",)}, "other than q, k, v"),
        ({"1x": ("heads",)}, "must be an identifier"),
    ],
)
def test_customio_declaration_errors(bad, match):
    with pytest.raises(DSLError, match=match):
        CustomIO(bad)


def test_var_and_symbolscalar_checks():
    assert Var("-inf").value == -math.inf and Var(2).value == 2.0
    for bad in ("abc", "nan", True, None):
        with pytest.raises(DSLError, match="Var"):
            Var(bad)
    with pytest.raises(DSLError, match="names must match keys"):
        OnlineFunc({"m": SymbolScalar("x", Var(0.0))}, {})
    with pytest.raises(DSLError, match="must be a SymbolScalar"):
        OnlineFunc({"m": 0.0}, {})


# ----------------------------------------------------------------------------- end to end
def _qkv(Bq=2, Hq=3, Sq=24, Skv=24, D=8, Dv=8, seed=0, dtype=torch.float32):
    g = _gen(seed)
    return (
        torch.randn(Bq, Sq, Hq, D, generator=g).to(dtype),
        torch.randn(Bq, Skv, Hq, D, generator=g).to(dtype),
        torch.randn(Bq, Skv, Hq, Dv, generator=g).to(dtype),
    )


def _meta(q, k, v):
    return tuple(
        meta_tensor(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype)
        for t in (q, k, v)
    )


def _softmax_torch(q, k, v, bias=None, allowed=None):
    """Plain softmax attention: q,k,v [B,S,H,D]; bias/allowed broadcast to [B,H,Sq,Skv]."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double())


def _positions(Bq, Hq, Sq, Skv):
    return (
        torch.arange(Bq).view(-1, 1, 1, 1),
        torch.arange(Hq).view(1, -1, 1, 1),
        torch.arange(Sq).view(1, 1, -1, 1),
        torch.arange(Skv).view(1, 1, 1, -1),
    )


def test_alibi_relative_bias_and_b_h_in_score_mod():
    q, k, v = _qkv()
    g = _gen(3)
    slopes = torch.rand(3, generator=g) * 0.5 + 0.1
    scale = 1 / math.sqrt(q.shape[-1])

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        alibi = custom_fwd_inputs["slopes"] * (kv_idx - q_idx)
        rel = -0.05 * abs(q_idx - kv_idx) + 0.1 * b - 0.2 * h
        return score * scale + alibi + rel

    mod = AttentionEngine(
        _meta(q, k, v),
        CustomIO({"slopes": ("heads",)}),
        score_mod=score_mod,
        mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        backend="reference",
    )
    out = mod(q, k, v, slopes)
    b, h, qi, ki = _positions(2, 3, 24, 24)
    bias = (
        slopes.double().view(1, -1, 1, 1) * (ki - qi) - 0.05 * (qi - ki).abs() + 0.1 * b - 0.2 * h
    )
    want = _softmax_torch(q, k, v, bias=bias, allowed=qi >= ki)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_sliding_window_and_document_ids_in_mask_mod():
    q, k, v = _qkv(Sq=40, Skv=40)
    window = 6
    docs = torch.tensor([[0] * 10 + [1] * 17 + [2] * 13, [0] * 25 + [1] * 15])
    io = CustomIO({"doc": ("batch", "seq_len")})
    doc = io["doc"]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window) & (doc[b, q_idx] == doc[b, kv_idx])

    mod = AttentionEngine(
        _meta(q, k, v),
        io,
        score_mod=lambda s, b, h, qi, ki: s * (1 / math.sqrt(8)),
        mask_mod=mask_mod,
        backend="reference",
    )
    out = mod(q, k, v, doc=docs)
    _, _, qi, ki = _positions(2, 3, 40, 40)
    same_doc = (docs[:, :, None] == docs[:, None, :]).unsqueeze(1)
    allowed = (qi >= ki) & (qi - ki < window) & same_doc
    torch.testing.assert_close(
        out.double(), _softmax_torch(q, k, v, allowed=allowed), rtol=1e-5, atol=1e-5
    )


def test_customio_named_dims_in_score_mod():
    """Reads of tensors declared with every kind of named dim (and a broadcast 1)."""
    q, k, v = _qkv(Sq=12, Skv=20)
    g = _gen(7)
    t = {
        "temp": torch.rand(2, 3, generator=g) + 0.5,  # ("batch", "heads")
        "qbias": torch.randn(2, 3, 12, generator=g),  # ("batch", "heads", "seq_len")
        "kbias": torch.randn(20, generator=g),  # ("seq_len_kv",)
        "pair": torch.randn(12, 20, generator=g) * 0.3,  # ("seq_len", "seq_len_kv")
        "glob": torch.randn(1, generator=g),
    }  # (1,)
    io = CustomIO(
        {
            "temp": ("batch", "heads"),
            "qbias": ("batch", "heads", "seq_len"),
            "kbias": "seq_len_kv",
            "pair": ("seq_len", "seq_len_kv"),
            "glob": (1,),
        }
    )

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        c = custom_fwd_inputs.input_tensors
        return (
            score * (1 / math.sqrt(8)) * c["temp"] + c["qbias"] + c["kbias"] + c["pair"] + c["glob"]
        )

    mod = AttentionEngine(_meta(q, k, v), io, score_mod=score_mod, backend="reference")
    out = mod(q, k, v, *t.values())
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(8)
    s = (
        s * t["temp"].double().view(2, 3, 1, 1)
        + t["qbias"].double().unsqueeze(-1)
        + t["kbias"].double().view(1, 1, 1, -1)
        + t["pair"].double()
        + t["glob"].double()
    )
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


class SinkTempSoftmax(OnlineFunc):
    """Softmax with a per-head temperature (read in online_fwd/forward/backward) and a per-head
    attention-sink logit (read in the epilogue): both are CustomIO tensors."""

    def __init__(self, io: CustomIO):
        super().__init__(
            {"m": SymbolScalar("m", Var("-inf")), "r": SymbolScalar("r", Var(0.0))},
            {"lse": SymbolScalar("lse", Var(0.0))},
            io,
        )

    io: CustomIO = CustomIO({"temp": ("heads",), "sink": ("heads",)})

    @staticmethod
    def online_fwd(scores, online_rowscales, b, h, q_idx):
        t = SinkTempSoftmax.io["temp"]
        m, r = online_rowscales["m"], online_rowscales["r"]
        x = scores * t
        m_new = m.max(x.get_reduce("max"))
        scale = (m - m_new).exp()
        p = (x - m_new).exp()
        return p, {"m": m_new, "r": r * scale + p.get_reduce("sum")}, scale

    @staticmethod
    def online_fwd_epilogue(o, online_rowscales, b, h, q_idx):
        sink = SinkTempSoftmax.io["sink"]
        m, r = online_rowscales["m"], online_rowscales["r"]
        m_f = m.max(sink)
        r_f = r * (m - m_f).exp() + (sink - m_f).exp()
        return o * (m - m_f).exp() / r_f, {"lse": r_f.log() + m_f}

    @staticmethod
    def forward(scores, final_rowscales, b, h, q_idx, kv_idx):
        return (scores * SinkTempSoftmax.io["temp"] - final_rowscales["lse"]).exp()

    @staticmethod
    def backward(dp, scores, final_rowscales, doosum, b, h, q_idx, kv_idx):
        return (dp - doosum) * scores * SinkTempSoftmax.io["temp"]


def _sink_torch(q, k, v, temp, sink):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]) * temp.view(1, -1, 1, 1)
    sk = sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sk], -1), -1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("mode,block_N", [("materialized", 0), ("online", 5), ("online", 16)])
def test_custom_online_func_reads_customio(mode, block_N):
    q, k, v = _qkv(Sq=16, Skv=24, Dv=12)
    g = _gen(11)
    temp, sink = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    of = SinkTempSoftmax(SinkTempSoftmax.io)
    spec = trace_spec(
        lambda s, io, b, h, qi, ki: s * (1 / math.sqrt(8)), None, of, SinkTempSoftmax.io
    )
    o, fin = executor.forward(
        spec,
        q,
        k,
        v,
        {"temp": temp, "sink": sink},
        mode=mode,
        block_N=block_N or 64,
        dtype=torch.float64,
    )
    want = _sink_torch(q.double(), k.double(), v.double(), temp.double(), sink.double())
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
    assert fin["lse"].shape == (2, 3, 16) and torch.isfinite(fin["lse"]).all()


def test_custom_online_func_backward_through_user_rules():
    q, k, v = _qkv(Sq=16, Skv=24, Dv=12)
    g = _gen(12)
    temp, sink = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    mod = AttentionEngine(
        _meta(q, k, v),
        SinkTempSoftmax.io,
        score_mod=lambda s, io, b, h, qi, ki: s * (1 / math.sqrt(8)),
        online_func=SinkTempSoftmax(SinkTempSoftmax.io),
        backend="reference",
    )
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = mod(*leaves, temp=temp, sink=sink)
    do = torch.randn(out.shape, generator=g)
    out.backward(do)
    ref_leaves = [t.double().clone().requires_grad_(True) for t in (q, k, v)]
    want = _sink_torch(*ref_leaves, temp.double(), sink.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    want.backward(do.double())
    for a, b_ in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad.double(), b_.grad, rtol=1e-4, atol=1e-5)


def test_default_online_func_is_softmax_and_flex_style_score_mod():
    q, k, v = _qkv()
    mod = AttentionEngine(
        _meta(q, k, v),
        score_mod=lambda s, b, h, qi, ki: s * (1 / math.sqrt(8)),
        backend="reference",
    )
    assert mod.spec.online_name == OnlineSoftmax.__name__
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(mod(q, k, v), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_constants_beside_tensors_keep_the_zero_dim_tensor_semantics(dtype):
    """Arithmetic with a constant takes the constant as a Python number (TensorIterator's
    vectorised path on CUDA) with exactly the values and dtypes of the 0-dim tensor it was:
    float tiles of every dtype, and integer indices (where the constant stays a tensor, so
    their float results keep the environment's dtype)."""
    x = leaf("tensor", ("m", "n"))
    q = index_leaf("q")
    env_dtype = torch.promote_types(dtype, torch.float32)
    t = torch.randn(2, 3, 5, 7).to(dtype)
    env = Env(dtype=env_dtype, device=torch.device("cpu"), leaves={"tensor": t},
              index={"q": torch.arange(5).view(1, 1, -1, 1)})
    c = lambda v: torch.tensor(v, dtype=env_dtype)  # noqa: E731 - the 0-dim constant
    positions = torch.arange(5).view(1, 1, -1, 1)
    cases = [(x * 0.1, t * c(0.1)), (0.3 - x, c(0.3) - t), (x / 3.0 + 1.0, t / c(3.0) + c(1.0)),
             (2.0 / (x * x + 1.0), c(2.0) / (t * t + c(1.0))), (q * 0.5, positions * c(0.5)),
             (q / 3.0, positions.to(env_dtype) / c(3.0))]
    for expr, want in cases:
        (got,) = evaluate([expr], env)
        assert got.dtype == want.dtype and torch.equal(got, want), expr
