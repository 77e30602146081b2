"""The GPU tests' case grid: (variant, dtype, B, Hq, Hkv, Sq, Skv, D, Dv) tuples."""

from __future__ import annotations

import torch

from engine.variants import VARIANTS

BF16, FP16 = torch.bfloat16, torch.float16


def cross_product(head_dims: list[tuple[int, int]]) -> list[tuple]:
    """Every variant x dtype x head dims x GQA ratio (1 and 4) at a length (600) that is not a
    multiple of any block size."""
    return [
        (name, dt, 1, 8, hkv, 600, 600, D, Dv)
        for name in VARIANTS
        for dt in (BF16, FP16)
        for D, Dv in head_dims
        for hkv in (8, 2)
    ]


def case_id(c: tuple) -> str:
    name, dt, B, Hq, Hkv, Sq, Skv, D, Dv = c
    return f"{name}-{'bf16' if dt is BF16 else 'fp16'}-B{B}-H{Hq}x{Hkv}-S{Sq}x{Skv}-D{D}x{Dv}"


def selected_params(request, param: str) -> set:
    """The values of parameter `param` among the session's selected tests of the requesting
    module: a precompile fixture compiles only what will run (under pytest -k, say)."""
    return {item.callspec.params[param] for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec")
            and param in item.callspec.params}


# The grid of the single-spec GPU tests (DSL math, tables, q/k/v mods): dtype x GQA 1/4 x D,
# at B 2, 8 query heads and a length that leaves a partial block.
SPEC_CASES = [(dt, hkv, d) for dt in (FP16, BF16) for hkv in (8, 2) for d in (64, 128)]
SPEC_B, SPEC_HQ, SPEC_S = 2, 8, 1000


def spec_case_id(case: tuple) -> str:
    dt, hkv, d = case
    return f"{'fp16' if dt == FP16 else 'bf16'}-gqa{SPEC_HQ // hkv}-d{d}"


def precompile_selected(request, sources) -> None:
    """nvcc-compile, in parallel workers, the kernels (`sources(case)`) of the selected cases
    of the requesting module first (nvcc is the slow part); a failure fails its own tests."""
    from engine.runtime.precompile import precompile

    chosen = selected_params(request, "case")
    srcs = [src for case in SPEC_CASES if case in chosen for src in sources(case)]
    for err in precompile(list(dict.fromkeys(srcs))).values():
        print("precompile failed:", err[:300])


def random_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def check_forward(out: torch.Tensor, ref: torch.Tensor) -> None:
    from engine.reference.executor import rel_err

    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2, f"rel err {rel_err(out, ref):.3e}"


def check_gradients(monkeypatch, mod, ref_mod, leaves: list, n_wrt: int,
                    names: tuple[str, ...]) -> None:
    """The kernel backward's gradients of the first `n_wrt` of `leaves` (the generated kernels,
    whatever ATTNBENCH_KERNEL_BACKWARD says) against the reference backend's (no NaN,
    relative error < 2e-2)."""
    from engine.reference.executor import rel_err
    from engine.runtime import tilelang_backend

    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", True)
    ref_leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    o = mod(*leaves)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, leaves[:n_wrt], do)
    want = torch.autograd.grad(ref_mod(*ref_leaves), ref_leaves[:n_wrt], do)
    for what, a, w in zip(names, got, want, strict=True):
        assert not torch.isnan(a).any(), f"{what} has NaN"
        assert rel_err(a, w) < 2e-2, f"{what}: relative error {rel_err(a, w):.3e}"
