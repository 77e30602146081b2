"""Tracing: the spec hash is stable, and malformed hooks raise a TraceError that names the hook
and the fault."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import CustomIO, OnlineFunc, OnlineSoftmax, SymbolScalar, TraceError, Var, where
from engine.ir.trace import trace_spec

ROOT = Path(__file__).resolve().parents[2]


def scaled(c: float):
    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return score * c

    return score_mod


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# ----------------------------------------------------------------------------- hash
def test_hash_is_stable_and_independent_of_object_identity():
    a = trace_spec(scaled(0.125), causal, OnlineSoftmax())
    # Another closure, another lambda, another OnlineSoftmax instance: same spec, same hash.
    b = trace_spec(scaled(0.125), lambda b_, h_, qi, ki: qi >= ki, OnlineSoftmax())
    assert a.hash == b.hash and len(a.hash) == 16
    assert a is not b and a.canonical_text() == b.canonical_text()
    assert all(x.key == y.key for x, y in zip(a.roots().values(), b.roots().values(), strict=True))


def test_equal_specs_compare_equal_and_share_a_dict_slot():
    a = trace_spec(scaled(0.125), causal, OnlineSoftmax())
    b = trace_spec(scaled(0.125), causal, OnlineSoftmax())
    assert a == b
    assert {a: 1}[b] == 1  # e.g. a kernel cache keyed by the spec


@pytest.mark.parametrize(
    "other",
    [
        lambda: trace_spec(scaled(0.25), causal, OnlineSoftmax()),  # constant
        lambda: trace_spec(scaled(0.125), None, OnlineSoftmax()),  # no mask
        lambda: trace_spec(
            scaled(0.125), lambda b, h, qi, ki: qi > ki, OnlineSoftmax()
        ),  # ge -> gt
        lambda: trace_spec(scaled(0.125), causal, OnlineSoftmax(), CustomIO({"x": ("heads",)})),
    ],
)
def test_hash_changes_with_the_spec(other):
    assert trace_spec(scaled(0.125), causal, OnlineSoftmax()).hash != other().hash


def test_hash_is_the_same_in_another_process():
    """No dependence on id(), PYTHONHASHSEED or dict order of a particular process."""
    here = trace_spec(scaled(0.125), causal, OnlineSoftmax()).hash
    code = textwrap.dedent("""
        from engine import OnlineSoftmax
        from engine.ir.trace import trace_spec
        def sm(score, io, b, h, q_idx, kv_idx):
            return score * 0.125
        print(trace_spec(sm, lambda b, h, q, k: q >= k, OnlineSoftmax()).hash)
    """)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == here


# ----------------------------------------------------------------------------- online funcs
class _Softmax(OnlineFunc):
    """OnlineSoftmax whose hooks the tests below replace one at a time."""

    def __init__(self):
        super().__init__(
            {"m": SymbolScalar("m", Var("-inf")), "r": SymbolScalar("r", Var(0.0))},
            {"lse": SymbolScalar("lse", Var(0.0))},
        )

    online_fwd = staticmethod(OnlineSoftmax.online_fwd)
    online_fwd_epilogue = staticmethod(OnlineSoftmax.online_fwd_epilogue)
    forward = staticmethod(OnlineSoftmax.forward)
    backward = staticmethod(OnlineSoftmax.backward)


def _online(**hooks) -> OnlineFunc:
    cls = type("Broken", (_Softmax,), {k: staticmethod(v) for k, v in hooks.items()})
    return cls()


def _fwd_two_values(scores, rs, b, h, q_idx):
    return scores.exp(), rs


def _fwd_list(scores, rs, b, h, q_idx):
    return [scores.exp(), rs, 1.0]


def _fwd_wrong_keys(scores, rs, b, h, q_idx):
    m_new = rs["m"].max(scores.get_reduce("max"))
    return (scores - m_new).exp(), {"m": m_new, "rr": rs["r"]}, 1.0


def _fwd_rowscale_not_dict(scores, rs, b, h, q_idx):
    return scores, (rs["m"], rs["r"]), 1.0


def _fwd_rowscale_along_keys(scores, rs, b, h, q_idx):
    m_new = rs["m"].max(scores)  # forgot get_reduce("max")
    return (scores - m_new).exp(), {"m": m_new, "r": rs["r"]}, 1.0


def _fwd_oscale_along_keys(scores, rs, b, h, q_idx):
    return scores, {"m": rs["m"], "r": rs["r"]}, scores


def _epi_three(o, rs, b, h, q_idx):
    return o, {"lse": rs["m"]}, 1.0


def _epi_wrong_keys(o, rs, b, h, q_idx):
    return o / rs["r"], {"logsumexp": rs["r"].log() + rs["m"]}


def _epi_final_from_o(o, rs, b, h, q_idx):
    return o / rs["r"], {"lse": o}


def _epi_reduce(o, rs, b, h, q_idx):
    return o / o.get_reduce("sum"), {"lse": rs["m"]}


def _forward_reduce(scores, fin, b, h, q_idx, kv_idx):
    return (scores - scores.get_reduce("max")).exp()


def _backward_reduce(dp, p, fin, doosum, b, h, q_idx, kv_idx):
    return (dp - (dp * p).get_reduce("sum")) * p


def _forward_torch(scores, fin, b, h, q_idx, kv_idx):
    return torch.cumsum(scores - fin["lse"], -1)  # torch.exp works; a scan has no DSL form


def _backward_math(dp, p, fin, doosum, b, h, q_idx, kv_idx):
    return dp * math.exp(p)


_LEAK: dict = {}


def _fwd_leak(scores, rs, b, h, q_idx):
    _LEAK["m"] = rs["m"]
    return OnlineSoftmax.online_fwd(scores, rs, b, h, q_idx)


def _forward_reads_leak(scores, fin, b, h, q_idx, kv_idx):
    return (scores - _LEAK["m"]).exp()


def _backward_if(dp, p, fin, doosum, b, h, q_idx, kv_idx):
    if dp > 0:
        return dp
    return p


ONLINE_ERRORS = [
    (
        "fwd_arity",
        dict(online_fwd=_fwd_two_values),
        r"online_fwd: must return 3 values .*got a 2-tuple",
    ),
    ("fwd_list", dict(online_fwd=_fwd_list), r"online_fwd: must return 3 values .*got list"),
    (
        "fwd_keys",
        dict(online_fwd=_fwd_wrong_keys),
        r"online_fwd: new_online_rowscales has keys \['m', 'rr'\]; expected \['m', 'r'\]",
    ),
    (
        "fwd_not_dict",
        dict(online_fwd=_fwd_rowscale_not_dict),
        r"online_fwd: new_online_rowscales must be a dict",
    ),
    (
        "fwd_rowscale_varies",
        dict(online_fwd=_fwd_rowscale_along_keys),
        r"online_fwd: row scale 'm' varies along \('m', 'n'\).*reduce it with get_reduce",
    ),
    (
        "fwd_oscale_varies",
        dict(online_fwd=_fwd_oscale_along_keys),
        r"online_fwd: o_scale varies along \('m', 'n'\)",
    ),
    (
        "epi_arity",
        dict(online_fwd_epilogue=_epi_three),
        r"online_fwd_epilogue: must return 2 values \(o, final_rowscales\), got a 3-tuple",
    ),
    (
        "epi_keys",
        dict(online_fwd_epilogue=_epi_wrong_keys),
        r"online_fwd_epilogue: final_rowscales has keys \['logsumexp'\]; expected \['lse'\]",
    ),
    (
        "epi_final_varies",
        dict(online_fwd_epilogue=_epi_final_from_o),
        r"online_fwd_epilogue: final row scale 'lse' varies along \('m', 'd'\)",
    ),
    (
        "epi_reduce",
        dict(online_fwd_epilogue=_epi_reduce),
        r"online_fwd_epilogue: get_reduce needs a score tile",
    ),
    (
        "forward_reduce",
        dict(forward=_forward_reduce),
        r"forward: the result uses get_reduce\('max'\); reductions are only allowed in online_fwd",
    ),
    (
        "backward_reduce",
        dict(backward=_backward_reduce),
        r"backward: the result uses get_reduce\('sum'\); reductions are only allowed in online_fwd",
    ),
    ("forward_torch", dict(forward=_forward_torch),
     r"forward: torch function torch.cumsum has no DSL equivalent.*\(at test_trace_errors.py:\d+\)"),
    (
        "backward_math",
        dict(backward=_backward_math),
        r"backward: .*cannot be converted to a Python float",
    ),
    (
        "forward_reads_rowscale",
        dict(online_fwd=_fwd_leak, forward=_forward_reads_leak),
        r"forward: the result reads 'rowscale', which this hook cannot see",
    ),
    (
        "backward_if",
        dict(backward=_backward_if),
        r"backward: .*no truth value.*where\(cond, a, b\) instead of if",
    ),
]


@pytest.mark.parametrize(
    "hooks,match", [e[1:] for e in ONLINE_ERRORS], ids=[e[0] for e in ONLINE_ERRORS]
)
def test_online_func_errors_name_hook_and_fault(hooks, match):
    with pytest.raises(TraceError, match=match):
        trace_spec(scaled(0.1), causal, _online(**hooks))


# ----------------------------------------------------------------------------- score_mod / mask_mod
def _sm(body):
    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return body(score, custom_fwd_inputs, b, h, q_idx, kv_idx)

    return score_mod


def _sm_if(score, io, b, h, q_idx, kv_idx):
    if score > 0:
        return score
    return -score


SCORE_MOD_ERRORS = [
    (
        "cosh",
        _sm(lambda s, io, b, h, qi, ki: s.cosh()),
        r"score_mod: the DSL has no operation 'cosh'",
    ),
    (
        "torch_softmax",
        _sm(lambda s, io, b, h, qi, ki: torch.softmax(s, -1)),
        r"score_mod: torch function torch.softmax has no DSL equivalent",
    ),
    (
        "math_exp",
        _sm(lambda s, io, b, h, qi, ki: math.exp(s)),
        r"score_mod: a symbolic expression cannot be converted to a Python float",
    ),
    (
        "reduce",
        _sm(lambda s, io, b, h, qi, ki: s - s.get_reduce("max")),
        r"score_mod: the result uses get_reduce\('max'\); reductions are only allowed in "
        r"online_fwd",
    ),
    (
        "undeclared_custom",
        _sm(lambda s, io, b, h, qi, ki: s + io["bias"]),
        r"score_mod: CustomIO: no input named 'bias'; declared: none",
    ),
    ("python_if", _sm_if, r"score_mod: a symbolic expression has no truth value"),
    (
        "returns_bool",
        _sm(lambda s, io, b, h, qi, ki: s > 0),
        r"score_mod: the result is boolean; expected a number",
    ),
    (
        "returns_tensor",
        _sm(lambda s, io, b, h, qi, ki: torch.ones(2)),
        r"score_mod: the result: cannot use a Tensor in an attention expression",
    ),
    (
        "returns_none",
        _sm(lambda s, io, b, h, qi, ki: None),
        r"score_mod: the result: cannot use a NoneType",
    ),
    (
        "symbolic_pow",
        _sm(lambda s, io, b, h, qi, ki: s**s),
        r"score_mod: pow takes a constant exponent",
    ),
    (
        "bool_arith",
        _sm(lambda s, io, b, h, qi, ki: (qi >= ki) * s),
        r"score_mod: arithmetic 'mul' on a boolean",
    ),
    ("arity", lambda s, b, h: s, r"score_mod takes 3 positional parameters"),
]


@pytest.mark.parametrize(
    "score_mod,match", [e[1:] for e in SCORE_MOD_ERRORS], ids=[e[0] for e in SCORE_MOD_ERRORS]
)
def test_score_mod_errors_name_hook_and_fault(score_mod, match):
    with pytest.raises(TraceError, match=match):
        trace_spec(score_mod, causal, OnlineSoftmax())


def _mask_and(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) and (q_idx - kv_idx < 8)


def _mask_if(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:
        return True
    return False


MASK_ERRORS = [
    (
        "float_expr",
        lambda b, h, qi, ki: (qi - ki) * 1.0,
        r"mask_mod: must return a boolean expression \(e.g. q_idx >= kv_idx\), got a float value",
    ),
    (
        "int_expr",
        lambda b, h, qi, ki: qi - ki,
        r"mask_mod: must return a boolean expression .*got a int value",
    ),
    ("python_true", lambda b, h, qi, ki: True, r"mask_mod: returned a Python bool"),
    (
        "python_and",
        _mask_and,
        r"mask_mod: a symbolic expression has no truth value .*use & \| ~ instead of and",
    ),
    ("python_if", _mask_if, r"mask_mod: a symbolic expression has no truth value"),
    ("arity", lambda q_idx, kv_idx: q_idx >= kv_idx, r"mask_mod must take \(b, h, q_idx, kv_idx\)"),
    ("not_callable", 3, r"mask_mod must be callable, got int"),
]


@pytest.mark.parametrize(
    "mask_mod,match", [e[1:] for e in MASK_ERRORS], ids=[e[0] for e in MASK_ERRORS]
)
def test_mask_mod_errors_name_hook_and_fault(mask_mod, match):
    with pytest.raises(TraceError, match=match):
        trace_spec(scaled(0.1), mask_mod, OnlineSoftmax())


def test_undeclared_customio_read_from_another_customio_object():
    other = CustomIO({"temp": ("heads",)})

    def forward(scores, fin, b, h, q_idx, kv_idx):
        return (scores * other["temp"] - fin["lse"]).exp()

    with pytest.raises(
        TraceError,
        match=r"forward: reads CustomIO input 'temp', which is not declared "
        r"in custom_fwd_inputs \(\['bias'\]\)",
    ):
        trace_spec(scaled(0.1), None, _online(forward=forward), CustomIO({"bias": ("heads",)}))
    doc = CustomIO({"doc": ("batch", "seq_len")})["doc"]
    with pytest.raises(
        TraceError, match=r"mask_mod: reads CustomIO input 'doc', which is not declared"
    ):
        trace_spec(scaled(0.1), lambda b, h, qi, ki: doc[b, qi] == doc[b, ki], OnlineSoftmax())


def test_customio_index_must_be_an_integer_expression():
    io = CustomIO({"doc": ("batch", "seq_len")})

    def mask_mod(b, h, q_idx, kv_idx):
        return io["doc"][b, q_idx * 0.5] == io["doc"][b, kv_idx]

    with pytest.raises(
        TraceError, match=r"mask_mod: CustomIO 'doc' dim 'seq_len': index with an integer "
    ):
        trace_spec(scaled(0.1), mask_mod, OnlineSoftmax(), io)
    with pytest.raises(TraceError, match=r"mask_mod: CustomIO 'doc' has 2 dims .*indexed with 1"):
        trace_spec(scaled(0.1), lambda b, h, qi, ki: io["doc"][qi] >= 0, OnlineSoftmax(), io)


def test_table_lookups_only_in_score_mod_and_mask_mod():
    io = CustomIO({"t": ("heads", 8)})

    class Scaled(OnlineSoftmax):
        def online_fwd(self, scores, online_rowscales, b, h, q_idx):
            return super().online_fwd(scores * io["t"][h, q_idx % 8], online_rowscales, b, h,
                                      q_idx)

    with pytest.raises(TraceError, match="table lookups are for score_mod and mask_mod"):
        trace_spec(scaled(0.1), None, Scaled(), io)


def test_online_func_object_checks():
    with pytest.raises(TraceError, match="online_func must be an OnlineFunc instance"):
        trace_spec(scaled(0.1), None, OnlineSoftmax)

    class NoBackward(OnlineFunc):
        def __init__(self):
            super().__init__({}, {})

        online_fwd = staticmethod(lambda s, rs, b, h, q: (s, {}, 1.0))
        online_fwd_epilogue = staticmethod(lambda o, rs, b, h, q: (o, {}))
        forward = staticmethod(lambda s, f, b, h, q, k: s)

    with pytest.raises(TraceError, match=r"online_func NoBackward does not define backward\(\)"):
        trace_spec(scaled(0.1), None, NoBackward())
    with pytest.raises(TraceError, match="custom_fwd_inputs must be a CustomIO, got dict"):
        trace_spec(scaled(0.1), None, OnlineSoftmax(), {"x": ("heads",)})


def test_seed_doosum_alias_is_resolved():
    """Seed 000 names the parameter `doosum` but reads `doosum_rowscales`: it must still trace."""

    def backward(dp, scores, final_rowscales, doosum, b, h, q_idx, kv_idx):
        return (dp - doosum_rowscales) * scores  # noqa: F821 - resolved by the tracer

    spec = trace_spec(scaled(0.1), causal, _online(backward=backward))
    assert spec.uses_doosum
    assert spec.bwd.key == trace_spec(scaled(0.1), causal, OnlineSoftmax()).bwd.key


def test_where_in_hooks_traces():
    spec = trace_spec(
        _sm(lambda s, io, b, h, qi, ki: where(qi >= ki, s, s * 0.5)), None, OnlineSoftmax()
    )
    assert "where(" in spec.describe()
