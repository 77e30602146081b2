"""One table of dtype spellings (attnbench/dtypes.py), shared by suite files and `tune`."""

from __future__ import annotations

import pytest

from attnbench.dtypes import dtype_name, short_dtype_name
from attnbench.suites import SuiteError, parse_suite


@pytest.mark.parametrize("spellings, torch_name, short", [
    (("bf16", "bfloat16", "BFloat16"), "bfloat16", "bf16"),
    (("fp16", "float16", "half"), "float16", "fp16"),
    (("fp32", "float32", "float"), "float32", "fp32"),
])
def test_every_spelling_names_one_dtype(spellings, torch_name, short):
    assert {dtype_name(s) for s in spellings} == {torch_name}
    assert {short_dtype_name(s) for s in spellings} == {short}


def test_unknown_dtype_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; known dtypes: float16 \(fp16\)"):
        short_dtype_name("int8")


def test_suites_take_both_spellings_through_the_table():
    data = {"impls": ["reference"], "modes": ["fwd"],
            "cases": [{"variants": ["softmax"], "shapes": ["llama3-8b"], "seqlens": [128]}]}
    got = [parse_suite({**data, "dtypes": [d]}, name="t", variant_names=["softmax"]).cases[0].dtype
           for d in ("bf16", "bfloat16", "fp16", "float16")]
    assert got == ["bfloat16", "bfloat16", "float16", "float16"]
    with pytest.raises(SuiteError, match="unknown dtype 'int8'"):
        parse_suite({**data, "dtypes": ["int8"]}, name="t", variant_names=["softmax"])
