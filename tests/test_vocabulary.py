"""One vocabulary: one problem record (engine.problem.Problem, with the FLOP count) that the
kernel shapes, the suites' cases and the tuner's problems extend, one dtype table and one place
that names GPUs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from attnbench.cases import Case
from attnbench.tune.problem import Problem as TuneProblem
from engine.dtypes import dtype_name, elem_bytes, short_dtype_name, torch_dtype
from engine.gpus import gpu_model, gpu_slug
from engine.plan.shape import KernelShape
from engine.problem import SIZE_KEYS, Problem
from engine.tuning.tune_file import normalize_dtype

SIZES = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_kv=300, head_dim=128,
             head_dim_v=64)


def test_every_record_of_a_problem_is_one():
    p = Problem(**SIZES)
    shape = KernelShape.for_problem(p, torch.bfloat16, None)
    tune = TuneProblem("softmax", **SIZES, dtype="bfloat16", mode="bwd")
    case = Case(suite="s", name="n", variant="softmax", shape="x", dtype="bfloat16",
                kind="attention", modes=("fwd",), impls=("engine",), baseline="engine", **SIZES)
    for rec in (shape, tune, case):
        assert isinstance(rec, Problem) and rec.sizes() == SIZES
    assert tuple(p.sizes()) == SIZE_KEYS and p.groups == 4
    fwd = 2.0 * 2 * 8 * 1000 * 300 * (128 + 64)
    assert p.flops_of("fwd", 0.5) == fwd * 0.5
    assert p.flops_of("fwd+bwd") == fwd + 2.0 * 2 * 8 * 1000 * 300 * (3 * 128 + 2 * 64)
    assert tune.flops() == p.flops_of("fwd+bwd") and tune.dtype == "bf16"
    with pytest.raises(ValueError, match="fwd, bwd, fwd\\+bwd"):
        p.flops_of("both")


@pytest.mark.parametrize("spelling, name, short", [
    ("bf16", "bfloat16", "bf16"), ("BFloat16", "bfloat16", "bf16"), (torch.bfloat16, "bfloat16", "bf16"),
    ("half", "float16", "fp16"), ("torch.float16", "float16", "fp16"), ("fp32", "float32", "fp32"),
    ("float", "float32", "fp32"), ("fp8", "float8_e4m3fn", "fp8"),
])
def test_one_dtype_table(spelling, name, short):
    assert dtype_name(spelling) == name and short_dtype_name(spelling) == short
    assert torch_dtype(spelling) == getattr(torch, name)
    assert elem_bytes(spelling) == getattr(torch, name).itemsize
    assert normalize_dtype(spelling) == short  # tune files: the same table


def test_an_unknown_dtype_names_the_known_ones():
    with pytest.raises(ValueError, match="known dtypes: float16 \\(fp16\\)"):
        dtype_name("float64")


@pytest.mark.parametrize(("name", "slug", "model"), [
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3", "h100"),
    ("NVIDIA H100 PCIe", "nvidia-h100-pcie", "h100"), ("NVIDIA H200", "nvidia-h200", "h200"),
    ("NVIDIA GH200 480GB", "nvidia-gh200-480gb", "gh200"), ("h100", "h100", "h100"),
    ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090", "nvidia-geforce-rtx-4090"),
    ("", "unknown-gpu", "unknown"),
])
def test_gpu_names(name, slug, model):
    assert (gpu_slug(name), gpu_model(name)) == (slug, model)
    assert gpu_model(None) == "unknown"


REPO = Path(__file__).resolve().parents[1]
GPU_NAMERS = {"gpu_slug", "gpu_model"}


def test_gpus_are_named_in_one_place():
    """No module but engine/gpus.py defines a function that names GPUs."""
    found = [(str(p.relative_to(REPO)), n.name)
             for top in ("engine", "attnbench", "scripts") for p in (REPO / top).rglob("*.py")
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.FunctionDef) and n.name in GPU_NAMERS]
    assert sorted(found) == [("engine/gpus.py", "gpu_model"), ("engine/gpus.py", "gpu_slug")]
