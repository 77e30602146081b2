"""The launchers bind tensors to the generated kernels' parameters by name (CPU: the compiled
kernels are fakes that record their arguments). Every call's arguments must line up with the
parameter list the generator returned with the source, and tensors must flow between the
kernels as named (Delta from the preprocess into the main kernel, the fragment-order dQ into
the postprocess, the outputs back to the caller)."""

from __future__ import annotations

import pytest
import torch

from engine.codegen.params import KernelParam, param
from engine.kernels.attention_bwd.launch import build_backward, launch_backward
from engine.kernels.registry import ATTENTION_BWD
from engine.plan.config import KernelConfig
from engine.plan.shape import KernelShape
from engine.runtime import kernel as kernel_mod
from engine.runtime.kernel import TORCH_DTYPES, bind_arguments, check_arguments
from engine.runtime.tilelang_backend import backward_kernel_call, forward_kernel_call
from engine.variants import VARIANTS

SIZES = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_kv=200, head_dim=64,
             head_dim_v=64)


class FakeCompiled:
    def __init__(self, source: str, calls: list):
        self.source, self.calls = source, calls

    def __call__(self, *args):
        self.calls.append((self.source, args))


@pytest.fixture
def calls(monkeypatch):
    seen: list = []
    monkeypatch.setattr(kernel_mod, "compile_source", lambda src: FakeCompiled(src, seen))
    return seen


def _module(name: str, sizes=SIZES, **kw):
    mod = VARIANTS[name].build(**sizes, dtype=torch.bfloat16, backend="tilelang", **kw)
    inputs = VARIANTS[name].make_inputs(**sizes, dtype=torch.bfloat16)
    custom = [inputs[n] for n in mod.custom_io.names()]
    return mod, inputs, custom


def _lined_up(params: tuple[KernelParam, ...], args: tuple) -> dict[str, torch.Tensor]:
    """The call's arguments by parameter name, after checking each against its parameter."""
    assert len(args) == len(params)
    for p, t in zip(params, args, strict=True):
        assert t.dtype == TORCH_DTYPES[p.dtype], p.name
        assert [str(n) for n in t.shape] == [x if x.isdigit() else str(n)
                                              for x, n in zip(p.shape, t.shape, strict=True)], p.name
    return {p.name: t for p, t in zip(params, args, strict=True)}


def _by_kernel(kernels, calls) -> list[dict[str, torch.Tensor]]:
    """Each recorded call as {name: tensor}, matched to the kernel (by source) it launched."""
    out = []
    for source, args in calls:
        k = next(k for k in kernels if k.source == source)
        out.append(_lined_up(k.params, args))
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_forward_binds_by_name(calls, dynamic):
    mod, inputs, custom = _module("document")
    mod.dynamic_shapes = dynamic  # symbols B, Sq, Skv, NQB, NKB: bound consistently
    o, finals = forward_kernel_call(mod.kernel_cache, mod.kernel_request(), inputs["q"],
                                    inputs["k"], inputs["v"], custom)
    fk = mod.forward_kernel()
    (got,) = _by_kernel([fk.kernel], calls)
    assert got["Q"] is inputs["q"] and got["K"] is inputs["k"] and got["V"] is inputs["v"]
    assert got["O"] is o and all(got[f"F_{n}"] is f
                                 for n, f in zip(mod.spec.final_names, finals, strict=True))
    assert torch.equal(got["C_doc_ids"], inputs["doc_ids"].float())
    assert got["Cls"].dtype == torch.int8 and got["Lo"].dtype == torch.int32
    assert ("B" in fk.kernel.params[0].shape) == dynamic


@pytest.mark.parametrize("name, cfg, det", [
    ("softmax", None, False),  # warp-specialised: preprocess, main, postprocess
    ("softmax", KernelConfig(32, 128, 2, 256), False),  # automatic pipeline, dQ in rows
    ("alibi", None, True),  # deterministic: the dQ kernel, custom gradients per key row
    ("alibi", KernelConfig(32, 128, 2, 256), False),  # atomic custom gradient
])
def test_backward_binds_by_name(calls, name, cfg, det):
    mod, inputs, custom = _module(name, backward_config=cfg)
    mod.deterministic = det
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    o = torch.randn(2, 200, 4, 64, dtype=torch.bfloat16)
    finals = [torch.randn(2, 4, 200) for _ in mod.spec.final_names]
    do = torch.randn_like(o)
    grads = tuple(VARIANTS[name].learnable)
    dq, dk, dv, dc = backward_kernel_call(mod.kernel_cache, mod.kernel_request(), q, k, v, o,
                                          finals, do, custom, custom_grads=grads)
    bk = mod.backward_kernels(custom_grads=grads)
    assert len(calls) == len(bk.kernels())
    runs = _by_kernel(bk.kernels(), calls)
    by_source = {src: run for (src, _), run in zip(calls, runs, strict=True)}
    main = by_source[bk.main.source]
    assert main["Q"] is q and main["dO"] is do and main["V"] is v
    assert [main[f"F_{n}"].data_ptr() for n in mod.spec.final_names] == [
        f.data_ptr() for f in finals]
    if bk.preprocess is not None:
        prep = by_source[bk.preprocess.source]
        assert prep["O"] is o and prep["dO"] is do and prep["Delta"] is main["Delta"]
    if bk.post is not None:
        post = by_source[bk.post.source]
        assert post["acc"] is main["dQ"] and post["dQ"] is dq
    if bk.dq is not None:
        assert by_source[bk.dq.source]["Q"] is q
    assert set(dc) == set(grads) and dq.shape == q.shape and dk.shape == k.shape


def test_heads_walk_stores_dk_dv_once_by_name(calls):
    sizes = {**SIZES, "heads_q": 8}
    mod, inputs, custom = _module("softmax_causal", sizes)
    shape = KernelShape.of(mod)
    bk = build_backward(mod.spec, shape, ATTENTION_BWD.default(64, 64), heads_loop=True)
    assert bk.plan.kv_store == "once"
    o = torch.randn(2, 200, 8, 64, dtype=torch.bfloat16)
    dq, dk, dv, _ = launch_backward(bk, inputs["q"], inputs["k"], inputs["v"], o,
                                    [torch.randn(2, 8, 200)], torch.randn_like(o), {})
    main = dict(zip(bk.main.generated.param_names, next(a for s, a in calls if s == bk.source),
                    strict=True))
    assert main["dK"] is dk and main["dV"] is dv and dk.dtype == torch.bfloat16


@pytest.mark.parametrize("det, heads_kv", [(False, 2), (True, 4)])
def test_dq_kernel_writes_dq_in_the_input_dtype(calls, det, heads_kv):
    """At D 256 (head split) and in the deterministic mode, dQ is the dQ kernel's output, in
    the input dtype (no fp32 buffer, no cast pass); without GQA the deterministic dK/dV are the
    main kernel's own (no sum over one head)."""
    sizes = {**SIZES, "heads_kv": heads_kv, "head_dim": 256, "head_dim_v": 256}
    mod, inputs, _ = _module("softmax_causal", sizes)
    mod.deterministic = det
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    o = torch.randn(2, 200, 4, 256, dtype=torch.bfloat16)
    dq, dk, dv, _ = backward_kernel_call(mod.kernel_cache, mod.kernel_request(), q, k, v, o,
                                         [torch.randn(2, 4, 200)], torch.randn_like(o), [])
    bk = mod.backward_kernels()
    assert bk.plan.dq_layout == "none" and bk.plan.head_split
    runs = dict(zip((s for s, _ in calls), _by_kernel(bk.kernels(), calls), strict=True))
    assert "dQ" not in runs[bk.main.source]
    assert runs[bk.dq.source]["dQ"] is dq and dq.dtype == torch.bfloat16
    if det:
        assert runs[bk.main.source]["dK"] is dk and runs[bk.main.source]["dV"] is dv


def test_binding_names_what_is_wrong():
    params = (param("A", (4, "S"), "float32"), param("B", ("S",), "int32"))
    a, b = torch.zeros(4, 3), torch.zeros(3, dtype=torch.int32)
    assert bind_arguments(params, {"B": b, "A": a}) == [a, b]
    with pytest.raises(ValueError, match=r"missing \['B'\], unexpected \['C'\]"):
        bind_arguments(params, {"A": a, "C": b})
    check_arguments(params, [a, b])
    with pytest.raises(ValueError, match="kernel argument B"):
        check_arguments(params, [a, torch.zeros(5, dtype=torch.int32)])  # S is 3 in A
    with pytest.raises(ValueError, match="kernel argument A"):
        check_arguments(params, [torch.zeros(5, 3), b])
    with pytest.raises(ValueError, match="kernel argument A"):
        check_arguments(params, [a.double(), b])


def test_the_machine_check_runs_once_per_device_and_dtype(monkeypatch):
    """A module call asks whether its kernels can run here; the CUDA queries behind the answer
    (capability, name) cost ~20 us, so they run once per (device, dtype)."""
    import torch

    from engine.runtime import device as dev

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "A100")
    dev._cuda_problem.cache_clear()
    try:
        for _ in range(3):
            why = dev.hopper_problem(torch.device("cuda", 0), torch.bfloat16)
            assert why == "GPU A100 is sm_80; kernels target sm_90a (H100/H200)"
        assert len(calls) == 1
        assert dev.hopper_problem(torch.device("cpu"), torch.bfloat16).startswith("tensors are on cpu")
    finally:
        dev._cuda_problem.cache_clear()


def test_inference_calls_the_forward_kernel_without_the_autograd_function(calls, monkeypatch):
    """Under no_grad the module's forward launches the kernel directly (no graph to record);
    in grad mode it goes through the autograd Function, whose output joins the graph even when
    q, k, v do not require grad (the seeds call backward on such outputs)."""
    from engine.runtime import tilelang_backend

    applied = []
    real = tilelang_backend.TileLangAttention.apply
    monkeypatch.setattr(tilelang_backend.TileLangAttention, "apply",
                        lambda *a: applied.append(1) or real(*a))
    mod, inputs, custom = _module("softmax")
    monkeypatch.setattr(mod, "resolved_backend", lambda device: "tilelang")
    with torch.no_grad():
        o = mod(inputs["q"], inputs["k"], inputs["v"], *custom)
    assert not applied and o.grad_fn is None and len(calls) == 1
    o = mod(inputs["q"], inputs["k"], inputs["v"], *custom)
    assert applied == [1] and o.grad_fn is not None and len(calls) == 2


def test_launcher_calls_the_tvm_ffi_function_itself():
    """TileLang's kernel with TVM-FFI's adapter launches through the module's `main` (an
    Executable compiled here, or the module loaded from TileLang's disk cache); anything
    else, or a kernel whose outputs TileLang allocates, through the kernel itself."""
    from types import SimpleNamespace

    from engine.runtime.compile import launcher

    main = object()
    loaded = SimpleNamespace(main=main)  # a loaded TVM-FFI module: functions as attributes

    class Executable:
        def jit(self):
            return loaded

    def kernel_with(executable, result_idx=()):
        adapter = SimpleNamespace(_get_executable=lambda: executable, result_idx=list(result_idx))
        return SimpleNamespace(adapter=adapter)

    assert launcher(kernel_with(Executable())) is main
    assert launcher(kernel_with(loaded)) is main
    allocating = kernel_with(loaded, result_idx=[2])
    assert launcher(allocating) is allocating
    plain = FakeCompiled("src", [])
    assert launcher(plain) is plain
