"""LinearAttentionEngine: the user-facing module of linear attention (Mamba2, simple GLA,
RetNet's linear retention, feature-map linear attentions), compatible with AttentionEngine's
linear scripts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.dsl.io import CustomIO
from engine.ir.tensor_mods import (
    TENSOR_LEAF,
    TensorMod,
    constant_scale,
    position_factor,
    trace_tensor_mod,
)
from engine.kernels.linear_fwd.plan import NO_FOLDS, Folds
from engine.logs import log_once
from engine.reference.evaluate import Env, custom_view
from engine.reference.linear import chunked
from engine.reference.tensor_mods import apply_tensor_mod
from engine.runtime import linear_backend, linear_tuning
from engine.runtime.arg_checks import bind_customs
from engine.runtime.device import choose_backend
from engine.runtime.linear_inputs import (
    LinearProblem,
    check_linear_args,
    check_linear_meta,
    check_offset_values,
)

BACKENDS = ("auto", "reference", "tilelang")
# (the scripts' name, seed 001's name) of each q/k/v mod
_MOD_NAMES = (("q_mod", "query_mod"), ("k_mod", "key_mod"), ("v_mod", "value_mod"))
_MOD_FORMS = (1, 2, 5)  # mod(x), mod(x, custom_io), mod(x, custom_io, b, h, pos)


def _pick(name: str, alias: str, value: Any, alias_value: Any) -> tuple[str, Any]:
    """The one of `name` / `alias` the caller gave (with the name it was given by)."""
    if value is not None and alias_value is not None:
        raise ValueError(f"give {name}= or {alias}= (the same argument), not both")
    return (alias, alias_value) if alias_value is not None else (name, value)


def _check_custom_io(custom_io: Any) -> CustomIO:
    if custom_io is None:
        return CustomIO({})
    if not isinstance(custom_io, CustomIO):
        raise ValueError(f"custom_io: expected a CustomIO, got {type(custom_io).__name__}")
    for name, dims in custom_io.decls.items():
        if "seq_len_kv" in dims:
            raise ValueError(f"custom_io[{name!r}]: dim 'seq_len_kv' has no meaning in a linear "
                             "attention (one time axis): use 'seq_len'")
    return custom_io


def _head_major(mod: TensorMod, x: torch.Tensor, customs: dict[str, torch.Tensor]
                ) -> torch.Tensor:
    """`mod` of x [B, H, T, D] (apply_tensor_mod works on [B, T, H, D]: a transposed view),
    evaluated on x's own dtype: the pre-pass is memory-bound, and the kernels read the result
    in that dtype anyway."""
    return apply_tensor_mod(mod, x.transpose(1, 2), customs, upcast=False).transpose(1, 2)


def _decay_of(mod: TensorMod, decay: torch.Tensor, customs: dict[str, torch.Tensor]
              ) -> torch.Tensor:
    """`mod` of decay [B, H, T], as a [B, T, H, 1] view with a unit feature axis (also a
    per-position factor, which reads no tensor: [B, H, T] float32). A mod that only reads a
    [B, H, T] custom input (Mamba2's dt as the value weights) is that tensor, in float32."""
    e = mod.expr
    if (e.op == "custom" and e.attr[2] == ("b", "h", mod.pos)
            and customs[e.attr[0]].shape == decay.shape):
        return customs[e.attr[0]].to(torch.float32)
    scaled = _scaled_by_custom(mod, decay, customs)
    if scaled is not None:
        return scaled
    y = apply_tensor_mod(mod, decay.transpose(1, 2).unsqueeze(-1), customs)
    return y.squeeze(-1).transpose(1, 2)


def _scaled_by_custom(mod: TensorMod, decay: torch.Tensor, customs: dict[str, torch.Tensor]
                      ) -> torch.Tensor | None:
    """decay [B, H, T] times a custom read that is a view of its tensor (Mamba2's decay * A,
    A (1, heads); the evaluator's custom_view over the [B, H, T] layout) as one broadcast
    multiply, the evaluator's float32 product without its per-call host work (about 40% of a
    Mamba2 generation step's, NOTES 136); None for any other mod."""
    e = mod.expr
    if e.op != "mul" or sorted(a.op for a in e.args) != sorted(("custom", TENSOR_LEAF)):
        return None
    name, _, index = next(a for a in e.args if a.op == "custom").attr
    B, H, T = decay.shape
    layout = Env(dtype=torch.float32, device=decay.device,
                 ranges={"b": (0, B), "h": (1, H), mod.pos: (2, T)}, rank=3)
    view = custom_view(customs[name], index, layout)
    return None if view is None else decay * view.to(torch.float32)


class LinearAttentionEngine(torch.nn.Module):
    """A linear attention: o_t = sum_{s <= t} (q_t . k_s) exp(G_t - G_s) v_s, G the running
    sum (per sequence) of the log decays g, plus q_t exp(G_t) h0 with an initial state h0.

    qkv_meta: (q, k, v) meta tensors (B, HQ, T, D), (B, HK, T, D), (B, H, T, Dv) from
    `meta_tensor`, HQ and HK dividing H (output head h reads q head h // (H // HQ); Mamba2
    shares one q and k head: HQ = HK = 1). A call may bring another B and T; heads, head dims
    and dtype are fixed.

    Called as mod(q, k, v, decay, *custom_inputs, initial_state=None,
    output_final_state=False, cu_seqlens=None, **named_custom_inputs) with q, k, v in the
    layout [B, H, T, D] and decay [B, H, T] float32. Returns o [B, H, T, Dv] in q's dtype, or
    (o, final_state) with output_final_state: the float32 state [N, H, D, Dv]
    exp(G_T) h0 + sum_s exp(G_T - G_s) k_s v_s^T. initial_state: float32 [N, H, D, Dv].
    cu_seqlens: int32 [N + 1] offsets of N sequences packed along T with B == 1 (fla's
    convention); each runs from its own state and the state never crosses a boundary.

    q_mod, k_mod, v_mod, decay_mod (None: the identity; seed 001's query_mod, key_mod,
    value_mod are the same arguments): elementwise functions of one element, as mod(x),
    mod(x, custom_io) or mod(x, custom_io, b, h, pos), that may read
    custom_io.input_tensors["name"] (or custom_io["name"]) at the element's (b, h, t). After
    decay_mod the decay is the log decay g. There is no implicit scale: put it in q_mod.
    CustomIO dims: "batch", "heads" (H; in q_mod and k_mod h is that tensor's own head),
    "seq_len" (T) or integer sizes. The mods run as a pre-pass of torch ops, so autograd gives
    q, k, v, decay, initial_state and the custom inputs their gradients on every backend. On
    the kernels two common forms cost no pass: a q_mod that is a constant scale (q * c) scales
    the output, and a v_mod that is v times a per-position factor (Mamba2's v * dt) weights
    each key position's decay factors (in the backward's kernels too); gradients are unchanged.

    backend: "auto" (the TileLang kernels on a Hopper GPU, else the reference), "reference"
    (engine.reference.linear.chunked) or "tilelang". config, backward_config: the kernels'
    LinearConfigs; None: the tune file's entry for the call's exact shape, else the plan's
    choice (engine.runtime.linear_tuning). A call of at most 8 positions per row (no
    cu_seqlens) that needs no gradient runs the recurrent step kernel instead
    (engine.kernels.linear_step: generation with initial_state and output_final_state=True);
    step_config (a StepConfig) fixes its tiles. tune_file (alias tune_filename): the tune file
    (default results/tune/<gpu>/linear_fwd.json and linear_bwd.json). tune, tune_bwd: the
    linear kernels are tuned by `attnbench tune --mode linear`, not on the first call; with
    either set the module says so once and loads what that command wrote. deterministic: the
    backward adds no gradients with atomics (where q or k heads are shared, as Mamba2's, it
    otherwise adds their gradients over the output heads with float32 atomics, whose order
    varies between runs), so that a call's gradients are bitwise the same every run.
    save_states: a training call's forward keeps the state entering every chunk for the
    backward, which then skips rerunning the state pass: [T / chunk, H, D, Dv] per row in the
    input dtype held from the forward to the backward (at Mamba2-2.7B, D 128 and Dv 64 at
    chunk 64, twice the bytes of v), for a faster forward+backward (README's speed table).
    """

    def __init__(
        self,
        qkv_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q_mod: Callable | None = None,
        k_mod: Callable | None = None,
        v_mod: Callable | None = None,
        decay_mod: Callable | None = None,
        custom_io: CustomIO | None = None,
        tune: bool = False,
        tune_file: str | None = None,
        *,
        backend: str = "auto",
        config: Any = None,
        backward_config: Any = None,
        query_mod: Callable | None = None,
        key_mod: Callable | None = None,
        value_mod: Callable | None = None,
        tune_filename: str | None = None,
        tune_bwd: bool = False,
        step_config: Any = None,
        deterministic: bool = False,
        save_states: bool = False,
    ):
        super().__init__()
        self.problem: LinearProblem
        self.problem, self.dtype = check_linear_meta(qkv_meta)
        self._meta = tuple(qkv_meta)  # shapes and dtype only (meta tensors hold no memory)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        for name, flag in (("tune", tune), ("tune_bwd", tune_bwd),
                           ("deterministic", deterministic), ("save_states", save_states)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected a bool, got {flag!r}")
        _, tune_file = _pick("tune_file", "tune_filename", tune_file, tune_filename)
        self.custom_io = _check_custom_io(custom_io)
        given = [_pick(n, a, f, fa) for (n, a), f, fa in
                 zip(_MOD_NAMES, (q_mod, k_mod, v_mod), (query_mod, key_mod, value_mod),
                     strict=True)]
        # every mod indexes T as the query position: a linear attention has one time axis
        self.q_mod, self.k_mod, self.v_mod = (
            trace_tensor_mod(hook, fn, "q", self.custom_io, arities=_MOD_FORMS)
            for hook, fn in given)
        self.decay_mod = trace_tensor_mod("decay_mod", decay_mod, "q", self.custom_io,
                                          arities=_MOD_FORMS, features=False)
        # Folded into the forward's kernels instead of a pass over the tensor: a q mod that is
        # a constant scale (o is linear in q: the output is scaled) and a v mod that is v times
        # a per-position factor (Mamba2's dt: it multiplies each key position's decays).
        self.q_scale = constant_scale(self.q_mod)
        factor = position_factor(self.v_mod)
        self.v_weight = None if factor is None else TensorMod("v_weight", factor, "q")
        self._kernel_folds = Folds(q_scale=self.q_scale or 1.0, v_weight=factor is not None)
        self.backend_name = backend
        self.config = config
        self.backward_config = backward_config
        self.step_config = step_config
        self.tune = tune
        self.tune_file = tune_file
        self.tune_bwd = tune_bwd
        self.check_offset_values = True  # cu_seqlens' values (a host synchronisation)
        self.save_states = save_states
        self._kernels = linear_backend.LinearKernelCache(deterministic)
        self._tuned = linear_tuning.TuneLookup()

    @property
    def deterministic(self) -> bool:
        """The backward without atomics (the class docstring); set it to switch a module:
        its kernel cache keys the backward kernels by it."""
        return self._kernels.deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"deterministic: expected a bool, got {value!r}")
        self._kernels.deterministic = value

    # ------------------------------------------------------------------ introspection
    def mods(self) -> list[TensorMod]:
        """The traced mods present (q, k, v, decay order)."""
        return [m for m in (self.q_mod, self.k_mod, self.v_mod, self.decay_mod) if m is not None]

    @property
    def ir_text(self) -> str:
        """The traced mods, one per line ("" when there are none: the plain core)."""
        return "\n".join(m.describe() for m in self.mods())

    @property
    def tl_code(self) -> str:
        """The TileLang sources of the forward kernels at qkv_meta's shapes, joined."""
        return "\n\n".join(self.kernel_sources())

    def kernel_sources(self, modes: tuple[str, ...] = ("fwd",), *, initial_state: bool = False,
                       final_state: bool = False, decay_grad: bool = True) -> list[str]:
        """The TileLang sources a call at qkv_meta's shapes runs, at the configs it runs: the
        forward's, and with "bwd" in `modes` a training call's forward and backward (with the
        module's save_states); of a call with an initial state or not, returning the final
        state or not, whose decay (after decay_mod) needs a gradient or not (`decay_grad`:
        RetNet's fixed one needs none)."""
        q, k, v = self._meta
        fwd, bwd = self._configs(q, k, v, None, "bwd" in modes)
        return linear_backend.kernel_sources(self._kernels, q, k, v, config=fwd,
                                             backward_config=bwd, modes=modes,
                                             initial_state=initial_state,
                                             final_state=final_state,
                                             folds=self._kernel_folds, decay_grad=decay_grad,
                                             save_states=self.save_states)

    def extra_repr(self) -> str:
        p = self.problem
        return (f"B={p.batch}, HQ={p.heads_q}, HK={p.heads_k}, H={p.heads}, T={p.seqlen}, "
                f"D={p.head_dim}, Dv={p.head_dim_v}, dtype={self.dtype}, "
                f"backend={self.backend_name}")

    def resolved_backend(self, device: torch.device) -> str:
        backend, fallback = choose_backend(self.backend_name, device, self.dtype)
        if fallback is not None:
            log_once(f"engine: linear attention runs the reference executor ({fallback})")
        return backend

    # ------------------------------------------------------------------ call
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                *custom: torch.Tensor, initial_state: torch.Tensor | None = None,
                output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                **named: torch.Tensor):
        B, T = check_linear_args(self.problem, self.dtype, q, k, v, decay, initial_state,
                                 cu_seqlens)
        if cu_seqlens is not None and self.check_offset_values:
            check_offset_values(cu_seqlens, T)
        customs = bind_customs(self.custom_io, custom, named, self.problem.named_sizes(B, T),
                               q.device)
        kernels = self.resolved_backend(q.device) == "tilelang"
        by_name = dict(zip(self.custom_io.names(), customs, strict=True))
        folds = self._kernel_folds if kernels else NO_FOLDS
        w = _decay_of(self.v_weight, decay, by_name) if folds.v_weight else None
        q, k, v, g = self._apply_mods(q, k, v, decay, by_name, folded=kernels)
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
        if kernels:
            fwd, bwd = self._call_configs(q, k, v, g, initial_state, w, cu_seqlens)
            o, final = linear_backend.run(self._kernels, q, k, v, g, initial_state, cu_seqlens,
                                          output_final_state, config=fwd, backward_config=bwd,
                                          step_config=self.step_config,
                                          q_scale=folds.q_scale, v_weight=w,
                                          save_states=self.save_states)
        else:
            o, final = chunked(q, k, v, g, initial_state, cu_seqlens)
        return (o, final) if output_final_state else o

    def _call_configs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      h0: torch.Tensor | None, w: torch.Tensor | None,
                      cu_seqlens: torch.Tensor | None) -> tuple[Any, Any]:
        """_configs' for this call; none for a recurrent step, which runs step_config (a
        generation loop's every call: no config pick, no tune-file lookup)."""
        training = linear_backend.needs_grad(q, k, v, g, h0, w)
        if self.config is None and not training and linear_backend.is_step(
                linear_backend.linear_shape(q, k, v, cu_seqlens), q, k, v, g, h0, w):
            return None, None
        return self._configs(q, k, v, cu_seqlens, training)

    def _configs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_seqlens: torch.Tensor | None, training: bool) -> tuple[Any, Any]:
        """(forward, backward or None) configs of a call (linear_tuning.pick); the module's
        own where they are all the call needs."""
        if self.config is not None and (self.backward_config is not None or not training):
            return self.config, self.backward_config
        if self.tune or self.tune_bwd:
            log_once("engine: LinearAttentionEngine(tune=True): the linear kernels are tuned by "
                      "`attnbench tune --mode linear` (per shape, into results/tune/<gpu>/"
                      "linear_fwd.json and linear_bwd.json), not on the first call; this "
                      "module runs those entries where its shape has one")
        shape = linear_backend.linear_shape(q, k, v, cu_seqlens)
        tuned = self._tuned(shape, self.tune_file)
        return linear_tuning.pick(shape, self.config, self.backward_config, tuned, training)

    def _apply_mods(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    decay: torch.Tensor, customs: dict[str, torch.Tensor],
                    folded: bool = False) -> tuple[torch.Tensor, ...]:
        """q, k, v and the log decay g through their mods (a tensor without one, or with
        `folded` one the kernels apply themselves (_kernel_folds), as it is)."""
        q_mod = None if folded and self.q_scale is not None else self.q_mod
        v_mod = None if folded and self.v_weight is not None else self.v_mod
        q, k, v = (x if m is None else _head_major(m, x, customs)
                   for m, x in ((q_mod, q), (self.k_mod, k), (v_mod, v)))
        g = decay if self.decay_mod is None else _decay_of(self.decay_mod, decay, customs)
        return q, k, v, g

