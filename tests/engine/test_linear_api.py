"""LinearAttentionEngine on the reference backend (CPU): each linear variant against its
independent torch formulation (outputs and the gradients of every learnable input, Mamba2's
A and dt included), states in and out, generation steps, packed sequences, the mods' forms
and names, argument errors, and the call into the kernels' backend."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from engine import CustomIO, LinearAttentionEngine, TraceError, meta_tensor
from engine.kernels.linear_fwd.plan import Folds, LinearConfig
from engine.reference.linear import naive_recurrence
from engine.runtime import linear_backend
from engine.variants import LINEAR_VARIANTS, get_linear_variant

F32 = torch.float32


def _sizes(name, **kw):
    heads = dict(heads_q=1, heads_k=1) if name == "mamba2" else dict(heads_q=2, heads_k=4)
    return {**dict(batch=2, heads=4, seqlen=100, head_dim=16, head_dim_v=8), **heads, **kw}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _loss(o, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return (o.float() * torch.randn(o.shape, generator=gen)).sum()


def _assert_grads_match(o, ref, inp, names, limit):
    """The gradients of a random loss of `o` and of `ref` w.r.t. inp[n], n in `names`."""
    got = torch.autograd.grad(_loss(o), [inp[n] for n in names])
    want = torch.autograd.grad(_loss(ref), [inp[n] for n in names])
    for n, a, b in zip(names, got, want, strict=True):
        assert _rel(a, b) < limit, n


@pytest.mark.parametrize("name", sorted(LINEAR_VARIANTS))
def test_variant_matches_its_torch_formulation(name):
    var = get_linear_variant(name)
    sz = _sizes(name)
    mod = var.build(sz, F32, backend="reference")
    inp = var.make_inputs(sz, F32, seed=1, requires_grad=True)
    o = mod(*inp.values())
    assert o.shape == (2, 4, 100, 8) and o.dtype == F32
    ref = var.reference_fn(inp)
    assert _rel(o, ref) < 1e-5
    _assert_grads_match(o, ref, inp, ["q", "k", "v", *var.learnable], 1e-4)


def test_mamba2_custom_gradients_flow_through_both_mods():
    var = get_linear_variant("mamba2")
    sz = _sizes("mamba2", seqlen=70)
    inp = var.make_inputs(sz, F32, seed=2, requires_grad=True)
    assert inp["decay"] is inp["dt"]  # dt is the decay input and v's scale: one leaf
    o = var.build(sz, F32, backend="reference")(*inp.values())
    gA, gdt = torch.autograd.grad(_loss(o), [inp["A"], inp["dt"]])
    assert gA.shape == (1, 4) and gdt.shape == (2, 4, 70)
    assert gA.abs().min() > 0 and gdt.abs().mean() > 0


@pytest.mark.parametrize("name", sorted(LINEAR_VARIANTS))
def test_variant_inputs_are_realistic(name):
    var = get_linear_variant(name)
    inp = var.make_inputs(_sizes(name), torch.bfloat16, seed=0)
    assert list(inp)[:4] == ["q", "k", "v", "decay"]
    assert inp["decay"].dtype == F32 and inp["decay"].shape == (2, 4, 100)
    assert all(inp[n].dtype == torch.bfloat16 and inp[n].abs().min() >= 0 for n in "qkv")
    mod = var.build(_sizes(name), torch.bfloat16, backend="reference")
    g = mod._apply_mods(*(inp[n] for n in ("q", "k", "v", "decay")),
                        {n: t for n, t in inp.items() if n in mod.custom_io.decls})[3]
    assert (g <= 0).all() and torch.isfinite(g).all()  # log decays
    if name == "mamba2":
        assert 1e-4 < inp["dt"].median() < 0.2 and (inp["A"] < 0).all()


def _mamba2_module(T=64, **kw):
    return get_linear_variant("mamba2").build(_sizes("mamba2", seqlen=T, **kw), F32,
                                              backend="reference")


def _state(N, H=4, D=16, Dv=8, seed=5):
    return torch.randn(N, H, D, Dv, generator=torch.Generator().manual_seed(seed))


def test_states_in_and_out_match_the_recurrence():
    var = get_linear_variant("simple_gla")
    sz = _sizes("simple_gla", seqlen=90)
    inp = var.make_inputs(sz, F32, seed=4)
    h0 = _state(2)
    o, h = var.build(sz, F32, backend="reference")(*inp.values(), initial_state=h0,
                                                  output_final_state=True)
    q = inp["q"] * 16 ** -0.5
    want_o, want_h = naive_recurrence(q, inp["k"], inp["v"], inp["decay"], h0)
    assert h.dtype == F32 and h.shape == (2, 4, 16, 8)
    assert _rel(o, want_o) < 1e-5 and _rel(h, want_h) < 1e-5


def test_generation_steps_continue_the_prefill():
    var = get_linear_variant("mamba2")
    mod = _mamba2_module(T=64)
    inp = var.make_inputs(_sizes("mamba2", seqlen=64), F32, seed=6)
    full = mod(*inp.values())
    cut = 60
    prefix = {n: (t[..., :cut, :] if n in "qkv" else t if n == "A" else t[..., :cut])
              for n, t in inp.items()}
    o, h = mod(*prefix.values(), output_final_state=True)
    steps = [o]
    for t in range(cut, 64):  # T = 1 calls with the state (B, T differ from qkv_meta's)
        step = {n: (x[..., t:t + 1, :] if n in "qkv" else x if n == "A" else x[..., t:t + 1])
                for n, x in inp.items()}
        o_t, h = mod(*step.values(), initial_state=h, output_final_state=True)
        steps.append(o_t)
    assert _rel(torch.cat(steps, dim=2), full) < 1e-5


def test_packed_sequences_match_separate_calls():
    var = get_linear_variant("mamba2")
    mod = _mamba2_module(T=100, batch=1)
    inp = var.make_inputs(_sizes("mamba2", seqlen=100, batch=1), F32, seed=7)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    h0 = _state(2)
    o, h = mod(*inp.values(), initial_state=h0, cu_seqlens=cu, output_final_state=True)
    assert h.shape == (2, 4, 16, 8)
    for n, (lo, hi) in enumerate(((0, 40), (40, 100))):
        part = {k: (t[..., lo:hi, :] if k in "qkv" else t if k == "A" else t[..., lo:hi])
                for k, t in inp.items()}
        o_n, h_n = mod(*part.values(), initial_state=h0[n:n + 1], output_final_state=True)
        assert _rel(o[:, :, lo:hi], o_n) < 1e-6 and _rel(h[n:n + 1], h_n) < 1e-6


def test_initial_state_and_named_custom_gradients():
    var = get_linear_variant("mamba2")
    mod = _mamba2_module(T=50)
    inp = var.make_inputs(_sizes("mamba2", seqlen=50), F32, seed=8, requires_grad=True)
    h0 = _state(2).requires_grad_(True)
    q, k, v, decay, A, dt = inp.values()
    o = mod(q, k, v, decay, initial_state=h0, A=A, dt=dt)  # customs by name
    (g_h0,) = torch.autograd.grad(_loss(o), [h0])
    assert g_h0.shape == h0.shape and g_h0.abs().sum() > 0


# ---------------------------------------------------------------- names and forms of the mods
META = (meta_tensor(2, 2, 20, 8, dtype=F32), meta_tensor(2, 1, 20, 8, dtype=F32),
        meta_tensor(2, 4, 20, 4, dtype=F32))
CIO = CustomIO({"s": ("heads",), "w": ("batch", "heads", "seq_len")})


def _call(mod, seed=0, T=20, **kw):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, T, d, generator=gen) for h, d in ((2, 8), (1, 8), (4, 4)))
    decay = F.logsigmoid(torch.randn(2, 4, T, generator=gen))
    customs = (torch.rand(4, generator=gen) + 0.5, torch.rand(2, 4, T, generator=gen) + 0.5)
    return mod(q, k, v, decay, *customs[:len(mod.custom_io)], **kw)


def test_mod_forms_and_seed_names_agree():
    two = LinearAttentionEngine(META, q_mod=lambda x, c: x * c["s"],
                                v_mod=lambda x, c: x * c.input_tensors["w"],
                                decay_mod=lambda d, c: d * 0.5, custom_io=CIO,
                                backend="reference")
    five = LinearAttentionEngine(META, query_mod=lambda x, c, b, h, t: x * c["s"][h],
                                 value_mod=lambda x, c, b, h, t: x * c["w"][b, h, t],
                                 decay_mod=lambda d: d * 0.5, custom_io=CIO,
                                 backend="reference")
    torch.testing.assert_close(_call(two), _call(five))
    assert two.ir_text.splitlines()[0].startswith("q_mod = ")
    assert five.ir_text.splitlines()[0].startswith("query_mod = ")
    assert "decay_mod = mul(tensor, 0.5)" in two.ir_text


def test_options_are_kept():
    mod = LinearAttentionEngine(META, tune_filename="t.json", tune_bwd=True)
    assert (mod.tune_file, mod.tune_bwd, mod.backend_name) == ("t.json", True, "auto")
    assert mod.resolved_backend(torch.device("cpu")) == "reference"  # no Hopper GPU here
    o, h = _call(mod, output_final_state=True)
    assert o.shape == (2, 4, 20, 4) and h.shape == (2, 4, 8, 4)
    with pytest.raises(RuntimeError, match=r"backend='tilelang' cannot run here"):
        _call(LinearAttentionEngine(META, backend="tilelang"))


def test_tilelang_path_calls_the_backend_contract(monkeypatch):
    seen = {}

    def fake_run(cache, q, k, v, g, initial_state, cu_seqlens, output_final_state,
                 config=None, backward_config=None, step_config=None, q_scale=1.0,
                 v_weight=None, save_states=False):
        seen.update(cache=cache, contiguous=all(x.is_contiguous() for x in (q, k, v, g)),
                    g=g, final=output_final_state, config=config, bwd=backward_config)
        return v.new_zeros(v.shape), None

    mod = LinearAttentionEngine(META, decay_mod=lambda d, c: d * 2.0, backend="tilelang",
                                config="cfg", backward_config="bcfg")
    monkeypatch.setattr(mod, "resolved_backend", lambda device: "tilelang")
    monkeypatch.setattr(linear_backend, "run", fake_run)
    _call(mod, seed=9)
    assert seen["cache"] is mod._kernels and seen["contiguous"] and seen["final"] is False
    assert (seen["config"], seen["bwd"]) == ("cfg", "bcfg")
    assert seen["g"].dtype == F32 and (seen["g"] <= 0).all()


def test_tl_code_joins_the_kernel_sources(monkeypatch):
    seen = {}

    def fake_sources(cache, q, k, v, config=None, backward_config=None, modes=("fwd",),
                     initial_state=False, final_state=False, folds=None, decay_grad=True,
                     save_states=False):
        seen.update(cache=cache, shapes=[tuple(t.shape) for t in (q, k, v)], config=config)
        return ["fwd one", "fwd two"]

    monkeypatch.setattr(linear_backend, "kernel_sources", fake_sources, raising=False)
    mod = LinearAttentionEngine(META, config="cfg")
    assert mod.tl_code == "fwd one\n\nfwd two"
    assert seen == dict(cache=mod._kernels, shapes=[(2, 2, 20, 8), (2, 1, 20, 8), (2, 4, 20, 4)],
                        config="cfg")


def test_tl_code_is_the_generated_forward():
    mod = LinearAttentionEngine(tuple(meta_tensor(*m.shape[:3], 64, dtype=torch.bfloat16)
                                      for m in META))
    assert mod.tl_code.count("@T.prim_func") == len(mod.kernel_sources()) >= 1
    assert len(mod.kernel_sources(("fwd", "bwd"))) > len(mod.kernel_sources())


def test_shared_heads_gradients_by_atomics_unless_deterministic():
    # Mamba2's one q/k head for every output head: the dQ/dK kernel adds into it with atomics
    # (no per-head float32 gradients and torch sum after it), except in the deterministic mode;
    # unshared heads never use atomics
    shared = tuple(meta_tensor(2, n, 64, d, dtype=torch.bfloat16)
                   for n, d in ((1, 64), (1, 64), (4, 64)))
    def dqk(mod):
        return [s for s in mod.kernel_sources(("fwd", "bwd")) if "dq dk" in s]

    (fast,) = dqk(LinearAttentionEngine(shared))
    (det,) = dqk(LinearAttentionEngine(shared, deterministic=True))
    assert "T.atomic_add(dQa[" in fast and "T.atomic_add(dKa[" in fast
    assert "atomic" not in det and "dQh[" in det and "dKh[" in det
    mha = tuple(meta_tensor(2, 4, 64, 64, dtype=torch.bfloat16) for _ in range(3))
    assert not any("atomic" in s for s in LinearAttentionEngine(mha).kernel_sources(
        ("fwd", "bwd")))


def test_shared_heads_run_the_gradient_kernels_heads_first():
    # where q or k heads are shared, the dV and dQ/dK kernels' blocks in flight are one chunk's
    # heads (the shared tiles and the atomics' target stay in L2); else chunks first
    def grids(q_heads):
        metas = tuple(meta_tensor(2, n, 64, 64, dtype=torch.bfloat16) for n in (q_heads,
                                                                                 q_heads, 4))
        srcs = LinearAttentionEngine(metas).kernel_sources(("fwd", "bwd"))
        return [re.sub(r", threads=\d+", "", line.strip()) for src in srcs
                if "dq dk" in src or ": dv " in src
                for line in src.splitlines() if "T.Kernel(" in line]

    assert grids(1) == ["with T.Kernel(4, 2) as (h, j):", "with T.Kernel(4, 1, 2) as (h, ik, j):"]
    assert grids(4) == ["with T.Kernel(2, 4) as (j, h):", "with T.Kernel(1, 2, 4) as (ik, j, h):"]


def _fake_kernels(monkeypatch, seen):
    """launch_forward / launch_backward as the reference core (float32, CPU), so that the
    kernel path's wiring (the folded q scale, the autograd function) runs without a GPU."""
    from engine.kernels.linear_fwd.launch import ForwardState
    from engine.reference.linear import chunked

    def core(q, k, v, g, h0):
        hq, hk = v.shape[1] // q.shape[1], v.shape[1] // k.shape[1]
        return chunked(q.float().repeat_interleave(hq, 1), k.float().repeat_interleave(hk, 1),
                       v.float(), g, h0)

    def fake_forward(fk, q, k, v, g, h0, cu_seqlens, final, w=None, save_states=False):
        seen.setdefault("folds", []).append(fk.folds)
        assert (w is not None) == fk.folds.v_weight
        o, ht = core(q, k, v if w is None else v.float() * w.unsqueeze(-1), g, h0)
        o = (o * fk.folds.q_scale).to(q.dtype)
        # the decays and weights ride in the state, as the kernels' slot sums do (the backward
        # is not given g or w)
        carried = {"g": g, **({"w": w} if w is not None else {})}
        return o, ForwardState(None, ht if final else None, carried)

    def fake_backward(fk, bk, q, k, v, state, h0, do, dht, initial_grad, decay_grad=True):
        g, w = state.slot_data["g"], state.slot_data.get("w")
        assert bk.v_weight == (w is not None) == fk.folds.v_weight and bk.folds == fk.folds
        seen.setdefault("decay_grad", []).append(decay_grad)
        names = ["q", "k", "v", "g", *(["w"] if w is not None else [])]
        leaves = [t.detach().requires_grad_() for t in (q, k, v, g, w)[:len(names)]]
        with torch.enable_grad():
            vw = leaves[2] if w is None else leaves[2].float() * leaves[4].unsqueeze(-1)
            o, _ = core(*leaves[:2], vw, leaves[3], h0)  # the kernels fold the q scale
            grads = torch.autograd.grad(o * bk.folds.q_scale, leaves, do.float())
        out = [gr.to(t.dtype) for gr, t in zip(grads, leaves, strict=True)]
        return (*out[:3], out[3] if decay_grad else None, None,
                out[4] if w is not None else None)

    def fake_step(sk, q, k, v, g, h0, w=None):
        seen.setdefault("step_folds", []).append(sk.folds)
        assert (w is not None) == sk.folds.v_weight
        o, ht = core(q, k, v if w is None else v.float() * w.unsqueeze(-1), g, h0)
        return (o * sk.folds.q_scale).to(q.dtype), ht

    monkeypatch.setattr(linear_backend, "launch_forward", fake_forward)
    monkeypatch.setattr(linear_backend, "launch_backward", fake_backward)
    monkeypatch.setattr(linear_backend, "launch_step", fake_step)


def _kernel_and_reference_modules(monkeypatch, seen: dict, name: str, seqlen: int):
    """(variant, sizes, its module on the faked kernels, its module on the reference backend)
    at head dims 32."""
    _fake_kernels(monkeypatch, seen)
    var = get_linear_variant(name)
    sz = _sizes(name, seqlen=seqlen, head_dim=32, head_dim_v=32)
    ref_mod = var.build(sz, torch.bfloat16, backend="reference")
    mod = var.build(sz, torch.bfloat16, backend="tilelang")
    monkeypatch.setattr(mod, "resolved_backend", lambda device: "tilelang")
    return var, sz, mod, ref_mod


@pytest.mark.parametrize("name", ["simple_gla", "mamba2", "retnet_linear"])
def test_backward_gives_the_decays_gradient_where_it_is_needed(monkeypatch, name):
    """The backward asks its kernels for the decays' gradient exactly where autograd needs it:
    simple GLA's decay and Mamba2's A and dt are learnable, RetNet's fixed decay is not."""
    seen = {}
    var, sz, mod, _ = _kernel_and_reference_modules(monkeypatch, seen, name, seqlen=40)
    inp = var.make_inputs(sz, torch.bfloat16, seed=4, requires_grad=True)
    leaves = list({id(t): t for t in inp.values() if t.requires_grad}.values())
    grads = torch.autograd.grad(mod(*inp.values()).float().sum(), leaves)
    assert seen["decay_grad"] == [name != "retnet_linear"]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", ["simple_gla", "mamba2"])
def test_scale_mods_are_folded_into_the_step(monkeypatch, name):
    """A generation step (T = 2 from a state) hands the step kernel q and v unmodded with the
    q scale and value weights as its folds; its output and final state match the reference
    backend's."""
    seen = {}
    var, sz, mod, ref_mod = _kernel_and_reference_modules(monkeypatch, seen, name, seqlen=2)
    inp = var.make_inputs(sz, torch.bfloat16, seed=5)
    h0 = torch.randn(sz["batch"], sz["heads"], 32, 32)
    o, h = mod(*inp.values(), initial_state=h0, output_final_state=True)
    ref_o, ref_h = ref_mod(*inp.values(), initial_state=h0, output_final_state=True)
    assert seen["step_folds"] == [Folds(32 ** -0.5 if name == "simple_gla" else 1.0,
                                        name == "mamba2")]
    assert "folds" not in seen  # the chunked kernels did not run
    assert _rel(o, ref_o) < 1e-2 and _rel(h, ref_h) < 1e-4


@pytest.mark.parametrize("name", ["simple_gla", "mamba2", "linear_elu"])
def test_scale_mods_are_folded_into_the_kernels(monkeypatch, name):
    """simple GLA's q_mod (q * D^-0.5) reaches the kernels as q_scale with q unmodded, and
    Mamba2's v_mod (v * dt) as per-position value weights with v unmodded; outputs and the
    gradients of q, k, v and the learnable inputs (Mamba2's dt and A) match the reference
    backend's pre-pass. Mods that are not such scales (linear_elu's feature maps) still run as
    a pre-pass."""
    seen = {}
    var, sz, mod, ref_mod = _kernel_and_reference_modules(monkeypatch, seen, name, seqlen=40)
    want_scale = 32 ** -0.5 if name == "simple_gla" else None
    assert mod.q_scale == want_scale and (mod.v_weight is not None) == (name == "mamba2")
    inp = var.make_inputs(sz, torch.bfloat16, seed=4, requires_grad=True)
    o, ref = mod(*inp.values()), ref_mod(*inp.values())
    assert seen["folds"] == [Folds(want_scale or 1.0, name == "mamba2")]
    with torch.no_grad():  # inference: the same kernels without the autograd Function
        assert torch.equal(mod(*inp.values()), o.detach())
    assert _rel(o, ref) < 1e-2
    _assert_grads_match(o, ref, inp, ["q", "k", "v", *var.learnable], 2e-2)
    if want_scale:
        assert any(f"q_scale={want_scale!r}" in src for src in
                   var.build(sz, torch.bfloat16).kernel_sources())


def test_constant_scale_reads_only_constant_scales():
    from engine.ir.tensor_mods import constant_scale

    def scale_of(fn):
        return constant_scale(LinearAttentionEngine(META, q_mod=fn).q_mod)

    assert scale_of(lambda x: x * 0.5) == 0.5 and scale_of(lambda x: 0.25 * x) == 0.25
    assert scale_of(lambda x: x / 4.0) == 0.25
    for fn in (lambda x: x * x, lambda x: x + 1.0, lambda x: (x * 2.0).exp(),
               lambda x, io, b, h, pos: x * h):
        assert scale_of(fn) is None
    assert constant_scale(None) is None


# ---------------------------------------------------------------- errors
MOD_ERRORS = [
    (dict(q_mod=3), r"q_mod: expected a callable \(x\), \(x, custom_io\) or"),
    (dict(k_mod=lambda x, a, b: x), r"k_mod takes 3 positional parameters"),
    (dict(q_mod=lambda x: x.sum(-1)), r"q_mod: the DSL has no operation 'sum'"),
    (dict(v_mod=lambda x, c: x * c["nope"]), r"v_mod: CustomIO: no input named 'nope'"),
    (dict(decay_mod=lambda d: d.get_reduce("sum")), r"decay_mod: get_reduce needs a score tile"),
    (dict(decay_mod=lambda d: d > 0), r"decay_mod: the result is boolean"),
    (dict(key_mod=lambda x, c, b, h, t: x * c["w"][b, h, t + 1]),
     r"key_mod: reads CustomIO input 'w' at computed indices"),
]


@pytest.mark.parametrize(("kwargs", "match"), MOD_ERRORS)
def test_malformed_mods_name_the_hook(kwargs, match):
    with pytest.raises(TraceError, match=match):
        LinearAttentionEngine(META, custom_io=CIO, **kwargs)


CTOR_ERRORS = [
    (lambda: LinearAttentionEngine(META, q_mod=abs, query_mod=abs),
     r"give q_mod= or query_mod= \(the same argument\), not both"),
    (lambda: LinearAttentionEngine(META, tune_file="a", tune_filename="b"),
     r"give tune_file= or tune_filename="),
    (lambda: LinearAttentionEngine(META, backend="cuda"), r"backend='cuda': expected one of"),
    (lambda: LinearAttentionEngine(META, tune="yes"), r"tune: expected a bool"),
    (lambda: LinearAttentionEngine(META, custom_io={"a": (1,)}), r"custom_io: expected a CustomIO"),
    (lambda: LinearAttentionEngine(META, custom_io=CustomIO({"a": ("seq_len_kv",)})),
     r"custom_io\['a'\]: dim 'seq_len_kv' has no meaning"),
    (lambda: LinearAttentionEngine(META[:2]), r"qkv_meta: expected a tuple of 3 meta tensors"),
    (lambda: LinearAttentionEngine(META, deterministic=1),
     r"deterministic: expected a bool, got 1"),
    (lambda: LinearAttentionEngine(META, save_states="yes"),
     r"save_states: expected a bool, got 'yes'"),
    (lambda: LinearAttentionEngine((META[0], meta_tensor(2, 3, 20, 8, dtype=F32), META[2])),
     r"qkv_meta: k heads 3 must divide v's heads 4"),
    (lambda: LinearAttentionEngine((META[0], META[1], meta_tensor(2, 4, 21, 4, dtype=F32))),
     r"qkv_meta: lengths differ \(q 20, k 20, v 21\)"),
    (lambda: LinearAttentionEngine((META[0], meta_tensor(2, 1, 20, 4, dtype=F32), META[2])),
     r"qkv_meta: k head dim 4 != q head dim 8"),
    (lambda: LinearAttentionEngine((META[0], META[1], meta_tensor(2, 4, 20, 4))),
     r"qkv_meta: q, k, v dtypes differ"),
]


@pytest.mark.parametrize(("make", "match"), CTOR_ERRORS)
def test_constructor_errors_name_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _args(T=20, B=2):
    gen = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(B, 2, T, 8, generator=gen), k=torch.randn(B, 1, T, 8, generator=gen),
                v=torch.randn(B, 4, T, 4, generator=gen),
                decay=F.logsigmoid(torch.randn(B, 4, T, generator=gen)))


def _with(**changes):
    def call(mod):
        a = _args(B=changes.pop("B", 2))
        a.update(changes)
        return mod(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("decay"), **a)

    return call


CALL_ERRORS = [
    (_with(q=torch.randn(2, 2, 20)), ValueError, r"q: shape \(2, 2, 20\); expected 4 dims"),
    (_with(k=torch.randn(2, 2, 20, 8)), ValueError,
     r"k: shape \(2, 2, 20, 8\); expected \(2, 1, 20, 8\) \(runtime layout \[B, H, T, D\]"),
    (_with(v=torch.randn(2, 4, 19, 4)), ValueError, r"v: shape \(2, 4, 19, 4\); expected"),
    (_with(v=[1.0]), TypeError, r"v: expected a torch.Tensor, got list"),
    (_with(k=torch.randn(2, 1, 20, 8, dtype=torch.float64)), ValueError,
     r"k: dtype torch.float64; expected torch.float32 \(from qkv_meta\)"),
    (_with(q=torch.randn(2, 2, 8, 20).transpose(-1, -2)), ValueError,
     r"q: last-dim stride 20; expected 1"),
    (_with(k=torch.randn(2, 1, 20, 8, device="meta")), ValueError,
     r"k: on meta; expected cpu \(the device of q\)"),
    (_with(decay=torch.randn(2, 4, 20, dtype=torch.float16)), ValueError,
     r"decay: dtype torch.float16; expected torch.float32"),
    (_with(decay=torch.randn(2, 20, 4)), ValueError,
     r"decay: shape \(2, 20, 4\); expected \(2, 4, 20\)"),
    (_with(initial_state=torch.randn(2, 4, 4, 8)), ValueError,
     r"initial_state: shape \(2, 4, 4, 8\); expected \(2, 4, 8, 4\)"),
    (_with(initial_state=torch.randn(2, 4, 8, 4, dtype=torch.float64)), ValueError,
     r"initial_state: dtype torch.float64; expected torch.float32"),
    (_with(cu_seqlens=torch.tensor([0, 20])), ValueError,
     r"cu_seqlens: torch.int64 \(2,\) on cpu; expected torch.int32"),
    (_with(cu_seqlens=torch.tensor([0, 20], dtype=torch.int32)), ValueError,
     r"cu_seqlens: packed sequences need batch 1, got q with batch 2"),
    (_with(B=1, cu_seqlens=torch.tensor([1, 20], dtype=torch.int32)), ValueError,
     r"cu_seqlens: runs 1..20; expected 0..20"),
    (_with(B=1, cu_seqlens=torch.tensor([0, 10, 19], dtype=torch.int32)), ValueError,
     r"cu_seqlens: runs 0..19; expected 0..20"),
    (_with(B=1, cu_seqlens=torch.tensor([0, 12, 8, 20], dtype=torch.int32)), ValueError,
     r"cu_seqlens: decreases at entry 2 \(12 -> 8\)"),
    (_with(B=1, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32),
           initial_state=torch.randn(2, 4, 8, 4)), ValueError,
     r"initial_state: shape \(2, 4, 8, 4\); expected \(1, 4, 8, 4\)"),
    (_with(extra=torch.ones(1)), TypeError, r"unexpected input 'extra'; declared CustomIO"),
]


@pytest.mark.parametrize(("call", "exc", "match"), CALL_ERRORS)
def test_call_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call(LinearAttentionEngine(META, backend="reference"))


def test_custom_input_errors():
    mod = LinearAttentionEngine(META, v_mod=lambda x, c: x * c["w"], custom_io=CIO,
                                backend="reference")
    a = _args()
    s, w = torch.rand(4), torch.rand(2, 4, 20)
    with pytest.raises(TypeError, match=r"missing custom input 'w'"):
        mod(*a.values(), s)
    with pytest.raises(TypeError, match=r"custom input 's' given twice"):
        mod(*a.values(), s, w, s=s)
    with pytest.raises(ValueError, match=r"custom input 'w': shape \(2, 4, 21\); expected "
                       r"\(2, 4, 20\)"):
        mod(*a.values(), s, torch.rand(2, 4, 21))
    with pytest.raises(TypeError, match=r"got 3 positional custom inputs"):
        mod(*a.values(), s, w, w)


@pytest.mark.parametrize("batch, heads, head_dim, head_dim_v, block_K, one_a_sm", [
    (2, 16, 128, 128, 64, 64),    # 64 state-pass blocks at 128 key rows: 128 at 64, one wave
    (1, 80, 128, 64, 64, 128),    # 80 blocks; 160 at 64 rows, two an SM (one: a second wave)
    (1, 16, 256, 256, 128, 128),  # 64 single-pass blocks; 128-position chunks do not fit D
                                  # 256: the default config, its whole key tile
    (1, 48, 128, 128, 64, 128),   # 96 blocks; 192 at 64 rows (two an SM), not 32: the floor
    (2, 80, 128, 64, 128, 128),   # the single pass's 160 blocks fill the SMs: no state pass
])
def test_two_kernel_default_keeps_the_state_pass_in_one_wave(batch, heads, head_dim, head_dim_v,
                                                             block_K, one_a_sm, monkeypatch):
    """The state pass's key tile halves while its blocks fit one wave, counting the blocks an
    SM holds (two at 64 key rows on 128-position chunks; NOTES 213), or one where
    CHUNK_LOOP_BLOCKS_PER_SM says so."""
    from engine.kernels.linear_fwd import plan
    from engine.kernels.linear_fwd.plan import LinearShape, config_for_shape

    shape = LinearShape(batch=batch, heads_q=heads, heads_k=heads, heads=heads, seqlen=16384,
                        head_dim=head_dim, head_dim_v=head_dim_v, dtype="bfloat16")
    for blocks, want in ((2, block_K), (1, one_a_sm)):
        monkeypatch.setattr(plan, "CHUNK_LOOP_BLOCKS_PER_SM", blocks)
        cfg = config_for_shape(shape, 132)
        assert cfg.single_pass == (batch * heads * head_dim_v // 64 >= 132)
        assert cfg.block_K == want, blocks


@pytest.mark.parametrize("batch, heads, head_dim, head_dim_v, stages", [
    (8, 16, 128, 128, 1),  # 256 single-pass blocks; at one stage two share an SM
    (8, 40, 256, 256, 2),  # YOCO-13B: 1280; one a block at one stage too
    (1, 32, 256, 512, 2),  # RetNet-6.7B: 256
])
def test_single_pass_default_with_a_block_per_sm(batch, heads, head_dim, head_dim_v, stages,
                                                 monkeypatch):
    """The single pass wherever its blocks fill the SMs, at D 256 too (NOTES 132), at one
    pipeline stage where that lets two blocks share an SM (NOTES 205) and two otherwise, or
    at one block per SM; the backward's default keeps two (its dQ/dK kernel's), its reverse
    single pass the forward's rule (NOTES 209)."""
    from engine.kernels.linear_bwd.plan import reverse_config
    from engine.kernels.linear_fwd import plan
    from engine.kernels.linear_fwd.plan import LinearShape, config_for_shape

    shape = LinearShape(batch=batch, heads_q=heads, heads_k=heads, heads=heads, seqlen=4096,
                        head_dim=head_dim, head_dim_v=head_dim_v, dtype="bfloat16")
    cfg = config_for_shape(shape, 132)
    assert cfg.single_pass and (cfg.chunk, cfg.block_V, cfg.threads, cfg.num_stages) == (
        64, 64, 256, stages)
    bwd = plan.backward_config_for_shape(shape, 132)
    assert bwd.num_stages == 2
    assert reverse_config(shape, bwd) == dataclasses.replace(bwd, num_stages=stages)
    monkeypatch.setattr(plan, "CHUNK_LOOP_BLOCKS_PER_SM", 1)
    assert config_for_shape(shape, 132).num_stages == 2
    assert reverse_config(shape, bwd) == bwd


def test_training_beside_the_single_pass_runs_the_reverse_pass_and_a_narrow_dqk_kernel():
    """Beside the single-pass forward a training call's backward is the reverse single pass
    with the dQ/dK kernel at 64-row key tiles on 128 threads (its blocks per SM; NOTES 149,
    158), at D 256 too, where the reverse pass's own 256 threads hold its state slice (NOTES
    197; the forward's rule would refuse a 128-thread single pass there), or at the forward's
    own config where q or k heads are shared (Mamba2: NOTES 158); beside the two kernels the
    forward's config with its whole key tile."""
    from engine.kernels.linear_fwd.plan import (
        LinearShape,
        backward_config_for_shape,
        backward_config_problems,
        config_for_shape,
        config_problems,
    )

    yoco = LinearShape(batch=8, heads_q=40, heads_k=40, heads=40, seqlen=2048, head_dim=256,
                       head_dim_v=256, dtype="bfloat16")
    fwd, bwd = config_for_shape(yoco), backward_config_for_shape(yoco)
    assert fwd.single_pass and bwd == dataclasses.replace(fwd, block_K=64, threads=128)
    assert any("registers" in p for p in config_problems(bwd, 256, 256))
    assert not backward_config_problems(bwd, 256, 256)
    assert any("registers" in p for p in backward_config_problems(bwd, 512, 256))
    fla = dataclasses.replace(yoco, heads_q=16, heads_k=16, heads=16, head_dim=128,
                              head_dim_v=128)
    fwd = config_for_shape(fla)
    assert fwd.single_pass and backward_config_for_shape(fla) == dataclasses.replace(
        fwd, block_K=64, threads=128, num_stages=2)  # the forward's at one stage: NOTES 205
    mamba2 = dataclasses.replace(fla, heads_q=1, heads_k=1, heads=80, head_dim_v=64)
    assert config_for_shape(mamba2).single_pass
    assert backward_config_for_shape(mamba2) == dataclasses.replace(config_for_shape(mamba2),
                                                                    num_stages=2)
    low = dataclasses.replace(fla, batch=2, seqlen=16384)  # two kernels at 64 key rows
    assert not config_for_shape(low).single_pass and config_for_shape(low).block_K == 64
    assert backward_config_for_shape(low) == dataclasses.replace(config_for_shape(low),
                                                                 block_K=128)


def test_a_decay_scaled_by_a_custom_read_is_one_multiply(monkeypatch):
    """Mamba2's decay mod (decay * A, A (1, heads)) runs as one broadcast multiply, equal to
    the generic evaluator's value and gradients bit for bit; other mods still go through the
    evaluator."""
    from engine import linear_api
    from engine.ir.tensor_mods import trace_tensor_mod
    from engine.reference.tensor_mods import apply_tensor_mod

    var = get_linear_variant("mamba2")
    sz = _sizes("mamba2", seqlen=5, head_dim=32, head_dim_v=32)
    mod = var.build(sz, torch.bfloat16, backend="reference")
    inp = var.make_inputs(sz, torch.bfloat16, seed=6)
    customs = {"A": inp["A"].clone().requires_grad_(), "dt": inp["dt"]}
    decay = inp["decay"].clone().requires_grad_()

    def generic(m, d, c):
        return apply_tensor_mod(m, d.transpose(1, 2).unsqueeze(-1), c).squeeze(-1).transpose(1, 2)

    fast = linear_api._scaled_by_custom(mod.decay_mod, decay, customs)
    want = generic(mod.decay_mod, decay, customs)
    assert fast is not None and torch.equal(fast, want)
    w = torch.randn_like(want)
    assert all(torch.equal(a, b) for a, b in zip(
        torch.autograd.grad(fast, [decay, customs["A"]], w),
        torch.autograd.grad(want, [decay, customs["A"]], w), strict=True))
    evaluated = []
    monkeypatch.setattr(linear_api, "apply_tensor_mod",
                        lambda *a, **k: evaluated.append(1) or apply_tensor_mod(*a, **k))
    assert torch.equal(linear_api._decay_of(mod.decay_mod, decay, customs), want)
    assert not evaluated
    shifted = trace_tensor_mod("decay_mod", lambda d, cio: d * cio.input_tensors["A"] + 1.0,
                               "q", mod.custom_io, arities=linear_api._MOD_FORMS,
                               features=False)
    assert linear_api._scaled_by_custom(shifted, decay, customs) is None
    assert torch.equal(linear_api._decay_of(shifted, decay, customs), want + 1.0)
    assert evaluated


def test_a_linear_config_is_read_back_from_its_key():
    from engine.plan.config import ConfigError

    for cfg in (LinearConfig(), LinearConfig(128, 64, 32, 3, 256, True)):
        assert LinearConfig.from_key(cfg.key()) == cfg
    for bad in ("C64", "C64_K64_V64_s2_t128_2p", " C64_K64_V64_s2_t128"):
        with pytest.raises(ConfigError, match="expected the form"):
            LinearConfig.from_key(bad)


def test_setting_deterministic_switches_the_backward_kernels():
    shared = tuple(meta_tensor(2, n, 64, 64, dtype=torch.bfloat16) for n in (1, 1, 4))
    mod = LinearAttentionEngine(shared)

    def dqk():
        return [s for s in mod.kernel_sources(("fwd", "bwd")) if "dq dk" in s]

    assert "atomic" in dqk()[0]
    mod.deterministic = True
    assert mod.deterministic and "atomic" not in dqk()[0]
    with pytest.raises(ValueError, match="deterministic: expected a bool"):
        mod.deterministic = 1


def test_save_states_keeps_the_forward_states_for_the_backward():
    # a training call's single pass writes the state entering every chunk (Hs) and the
    # backward runs no state pass of its own; an inference call's forward is unchanged
    metas = tuple(meta_tensor(2, 4, 200, 64, dtype=torch.bfloat16) for _ in range(3))
    one = LinearConfig(block_K=64, single_pass=True, threads=256)

    def sources(save, modes=("fwd", "bwd")):
        return LinearAttentionEngine(metas, config=one, save_states=save).kernel_sources(modes)

    kept, again = sources(True), sources(False)
    assert not any(": state pass " in s for s in kept)
    assert any(": state pass " in s for s in again)
    (single,) = [s for s in kept if ": single pass " in s]
    assert " hs=1" in single and "T.copy(S_s, Hs[slot0 + c, h, :," in single
    assert not any(" hs=1" in s for s in again)
    assert sources(True, ("fwd",)) == sources(False, ("fwd",))
