"""The GPU tests' case grid: (variant, dtype, B, Hq, Hkv, Sq, Skv, D, Dv) tuples."""

from __future__ import annotations

import time

import torch

from engine.plan.config import KernelConfig
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


def selected_params(request, param: str, *more: str) -> set:
    """The values of parameter `param` (with `more`: tuples of those parameters' values) among
    the session's selected tests of the requesting module that have them: a precompile
    fixture compiles only what will run (under pytest -k, say)."""
    names = (param, *more)
    return {item.callspec.params[param] if not more
            else tuple(item.callspec.params[n] for n in names)
            for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec")
            and all(n in item.callspec.params for n in names)}


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
    chosen = selected_params(request, "case")
    precompile_reported(request, [src for case in SPEC_CASES if case in chosen
                                  for src in sources(case)])


def precompile_reported(request, sources: list[str]) -> None:
    """Compile a module's kernels (`sources`, duplicates dropped) in parallel workers before
    its tests, saying how many and, after, how long and which failed, past pytest's capture:
    a device call cut while the module precompiles still shows where it was (the log holds
    nothing else until the first test ends). A kernel that fails here fails its own tests
    (compiling again there, with the error); the rest of the module still runs."""
    from engine.runtime.precompile import precompile

    srcs = list(dict.fromkeys(sources))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    module = request.module.__name__.rsplit(".", 1)[-1]
    with capture.global_and_fixture_disabled():
        print(f"\n{module}: precompiling {len(srcs)} kernels", flush=True)
    start = time.monotonic()
    errors = precompile(srcs)
    with capture.global_and_fixture_disabled():
        print(f"{module}: precompiled {len(srcs)} kernels in {time.monotonic() - start:.0f} s, "
              f"{len(errors)} failed", flush=True)
        for err in errors.values():
            print("precompile failed:", err[:300], flush=True)


# Dilated masks fold into shorter rows (engine.plan.fold): a stride that leaves row tails, the
# congruence alone, beside a window, Sq != Skv, a score reading the positions, each forward
# schedule; (stride, mask beside it, Sq, Skv, D, Hkv, dtype, forward config), 8 query heads.
FOLD_CASES = [
    (3, "window", 999, 999, 128, 2, BF16, None),
    (3, "window", 999, 999, 128, 2, BF16, KernelConfig(128, 128, 2, 256)),
    (3, "window", 999, 999, 128, 2, FP16, KernelConfig(192, 128, 2, 384)),
    (2, None, 640, 640, 64, 8, FP16, None),
    (3, "causal-offset", 300, 900, 128, 2, BF16, None),
    (4, "causal", 1024, 1024, 256, 2, BF16, None),
    # folded rows of 4096 at D 64 on the forward's 192-row tile, forced (the positional score's
    # ops keep the default at 128 rows: attention_fwd/plan.default_forward_config)
    (2, None, 8192, 8192, 64, 8, BF16, KernelConfig(192, 128, 3, 384, schedule="overlap",
                                                    persistent=True)),
]
_FOLD_MASKS = {
    None: lambda q, kv: None,
    "window": lambda q, kv: ((q - kv).abs() <= 200),
    "causal-offset": lambda q, kv: (q + 600 >= kv),
    "causal": lambda q, kv: (q >= kv),
}


def fold_case_id(case: tuple) -> str:
    return "-".join(map(str, case[:6])) + ("-fp16" if case[6] == FP16 else "")


def fold_module(case: tuple, backend: str = "tilelang"):
    """An AttentionEngine over the dilated mask of a FOLD_CASES entry (B 2, 8 query heads)."""
    from engine import AttentionEngine, CustomIO, OnlineSoftmax, meta_tensor

    stride, rest, Sq, Skv, D, Hkv, dt, cfg = case

    def mask(b, h, q_idx, kv_idx):
        dilated = (q_idx - kv_idx) % stride == 0
        other = _FOLD_MASKS[rest](q_idx, kv_idx)
        return dilated if other is None else other & dilated

    meta = (meta_tensor(2, 8, Sq, D, dtype=dt), meta_tensor(2, Hkv, Skv, D, dtype=dt),
            meta_tensor(2, Hkv, Skv, D, dtype=dt))
    return AttentionEngine(meta, CustomIO({}), mask_mod=mask, online_func=OnlineSoftmax(),
                           score_mod=lambda s, c, b, h, q, k: s * D**-0.5 - (q - k).abs() * 0.01,
                           backend=backend, config=cfg if backend == "tilelang" else None)


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


def documents(seed: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Document ids (and prefix ends, where the variant has them) at random boundaries, in the
    layout and dtype of `like`'s: other blocks empty, partial and full than the library's."""
    g = torch.Generator().manual_seed(seed)
    B, S = like["doc_ids"].shape
    ids, ends = torch.zeros(B, S), torch.zeros(B, S)
    for b in range(B):
        cuts = sorted(torch.randperm(S - 2, generator=g)[:4].add(1).tolist())
        for a, z in zip([0, *cuts], [*cuts, S], strict=True):
            ids[b, a:] += 1
            ends[b, a:z] = a + max(1, (z - a) // 4)
    out = {"doc_ids": ids, "prefix_end": ends}
    return {n: out[n].to(like[n]) for n in like if n in out}
