"""`flex_attention`: FlexAttention's call, run by the engine, so that code written for
`torch.nn.attention.flex_attention` runs by changing one import.

The score and mask functions take `(score, b, h, q_idx, kv_idx)` and `(b, h, q_idx, kv_idx)` and
use torch as people write them (engine.dsl.torch_funcs); tensors they capture from their scope
become custom inputs (with gradients when they require grad). Each call traces the functions
(cheap, symbolic) to learn which tensors they read now, then runs a module cached per (traced
functions, captured tensors' shapes, q/k/v shapes, dtype, device, scale): the kernels are built
once per such key.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch._dynamo

from engine.api import AttentionEngine
from engine.dsl.expr import index_leaf, leaf, to_text
from engine.dsl.io import CustomIO, meta_tensor
from engine.dsl.online import OnlineSoftmax
from engine.dsl.torch_funcs import TensorCapture, derive
from engine.ir.trace import TraceError, call_hook
from engine.runtime.ops import attention_forward

_MODULES: OrderedDict[tuple, AttentionEngine] = OrderedDict()
CACHE_SIZE = 64  # modules kept (each holds its compiled kernels)


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` [B, Hq, Sq, D] over `key` [B, Hkv, Skv, D] and `value`
    [B, Hkv, Skv, Dv] with FlexAttention's arguments; returns [B, Hq, Sq, Dv] (and the
    log-sum-exp [B, Hq, Sq], float32, with `return_lse`)."""
    _check_tensors(query, key, value, enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    mask_mod = _mask_mod(block_mask, query.shape[2], key.shape[2])
    shapes = _Shapes(tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype,
                     query.device.type)
    if torch.compiler.is_compiling():
        return _compiled_call(query, key, value, score_mod, mask_mod, scale, shapes, return_lse)
    capture, traced = _trace(score_mod, mask_mod, scale)
    customs = {n: t for n, (t, _) in capture.inputs.items()}
    mod = _module(traced, capture, score_mod, mask_mod, scale, shapes)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if not return_lse:
        return mod(q, k, v, **customs).transpose(1, 2)
    out, finals = mod(q, k, v, return_lse=True, **customs)
    return out.transpose(1, 2), finals["lse"].float()


class _Shapes(NamedTuple):
    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: torch.dtype
    device: str


def _compiled_call(query, key, value, score_mod, mask_mod, scale: float, shapes: _Shapes,
                   return_lse: bool):
    """Under torch.compile: the functions are traced once, while compiling (`_plan`, which
    dynamo runs as a constant), and each captured tensor is read again where the functions
    read it (a closure cell or a module global), so that it is an input of the graph and the
    module is one custom op (engine.runtime.ops)."""
    handle, sources, lse_at = _plan(score_mod, mask_mod, scale, *shapes)  # plain constants
    fns = (score_mod, mask_mod)
    customs = [derive(_read(fns[f], kind, where), picks, whole)
               for f, kind, where, picks, whole in sources]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    outs = attention_forward(handle, q, k, v, customs)
    out = outs[0].transpose(1, 2)
    return (out, outs[1 + lse_at].float()) if return_lse else out


@torch._dynamo.assume_constant_result
def _plan(score_mod, mask_mod, scale: float, *shapes: Any) -> tuple:
    """(module handle, where each captured tensor is read, the position of "lse" among the
    final row scales): constants for the compiler."""
    shapes = _Shapes(*shapes)
    capture, traced = _trace(score_mod, mask_mod, scale)
    mod = _module(traced, capture, score_mod, mask_mod, scale, shapes)
    sources = tuple((*_source(score_mod, mask_mod, t), picks, whole)
                    for t, picks, whole in capture.sources.values())
    return mod._op_handle, sources, list(mod.spec.final_names).index("lse")


def _source(score_mod, mask_mod, t: torch.Tensor) -> tuple[int, str, int | str]:
    """Which function reads `t`, and from where: ("closure", cell index) or ("global", name)."""
    for f, fn in enumerate((score_mod, mask_mod)):
        for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                if cell.cell_contents is t:
                    return f, "closure", i
        for name, val in getattr(fn, "__globals__", {}).items():
            if val is t:
                return f, "global", name
    raise TraceError(
        f"under torch.compile, engine.flex_attention reads captured tensors from the "
        f"functions' closures or module globals; a tensor of shape {tuple(t.shape)} was reached "
        "another way (an attribute, a helper function): bind it to a variable the function uses")


def _read(fn, kind: str, where: int | str) -> torch.Tensor:
    return fn.__closure__[where].cell_contents if kind == "closure" else fn.__globals__[where]


def _check_tensors(query, key, value, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"flex_attention: {name} must be a 4-D tensor [B, H, S, D], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    (B, Hq, _, D), (Bk, Hkv, Skv, Dk), (Bv, Hv, Sv, _) = query.shape, key.shape, value.shape
    if (Bk, Dk) != (B, D) or (Bv, Hv, Sv) != (Bk, Hkv, Skv):
        raise ValueError(f"flex_attention: shapes do not match: query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}")
    if Hq != Hkv and not (enable_gqa and Hq % Hkv == 0):
        want = "a multiple of" if enable_gqa else "equal to (or pass enable_gqa=True for GQA)"
        raise ValueError(f"flex_attention: query has {Hq} heads, key {Hkv}: expected query "
                         f"heads {want} key heads")


def _mask_mod(block_mask: Any, seqlen_q: int, seqlen_kv: int) -> Callable | None:
    """The mask function of an engine or torch BlockMask (None: no mask)."""
    if block_mask is None:
        return None
    fn = getattr(block_mask, "mask_mod", None)
    if not callable(fn):
        raise ValueError("flex_attention: block_mask must come from create_block_mask "
                         f"(engine's or torch's), got {type(block_mask).__name__}")
    lengths = getattr(block_mask, "seq_lengths", None) or (
        getattr(block_mask, "seqlen_q", seqlen_q), getattr(block_mask, "seqlen_kv", seqlen_kv))
    if tuple(lengths) != (seqlen_q, seqlen_kv):
        raise ValueError(f"flex_attention: block_mask was made for lengths {tuple(lengths)}, "
                         f"the inputs have ({seqlen_q}, {seqlen_kv})")
    return None if getattr(fn, "__name__", "") == "noop_mask" else fn


def _trace(score_mod, mask_mod, scale: float) -> tuple[TensorCapture, str]:
    """The functions' expressions as text (the cache key) and the tensors they capture."""
    capture = TensorCapture()
    b, h, q, kv = (index_leaf(n) for n in ("b", "h", "q", "kv"))
    with capture.active():
        score = leaf("score", ("m", "n")) * scale
        s = call_hook("score_mod", score_mod, (score, b, h, q, kv)) if score_mod else score
        m = call_hook("mask_mod", mask_mod, (b, h, q, kv)) if mask_mod else None
    return capture, f"{_text(s)} | {_text(m)}"


def _text(value: Any) -> str:
    return to_text(value) if hasattr(value, "key") else repr(value)


def _module(traced: str, capture: TensorCapture, score_mod, mask_mod, scale: float,
            shapes: _Shapes) -> AttentionEngine:
    inputs = tuple((n, dims, tuple(t.shape), t.dtype) for n, (t, dims) in capture.inputs.items())
    cache_key = (traced, inputs, *shapes, scale)
    mod = _MODULES.get(cache_key)
    if mod is None:
        mod = _build(capture, score_mod, mask_mod, scale, shapes)
        _MODULES[cache_key] = mod
        while len(_MODULES) > CACHE_SIZE:
            _MODULES.popitem(last=False)
    _MODULES.move_to_end(cache_key)
    return mod


def _build(capture: TensorCapture, score_mod, mask_mod, scale: float, shapes: _Shapes
           ) -> AttentionEngine:
    """An AttentionEngine of the functions; its tracing captures the same tensors under the
    same names (the capture is replayed in the same order), then lets them go."""
    replay = TensorCapture()

    def engine_score(score, b, h, q_idx, kv_idx):
        with replay.active():
            return score_mod(score * scale, b, h, q_idx, kv_idx) if score_mod else score * scale

    def engine_mask(b, h, q_idx, kv_idx):
        with replay.active():
            return mask_mod(b, h, q_idx, kv_idx)

    (B, Hq, Sq, D), (_, Hkv, Skv, Dv) = shapes.query, shapes.value
    meta = (meta_tensor(B, Hq, Sq, D, dtype=shapes.dtype),
            meta_tensor(B, Hkv, Skv, D, dtype=shapes.dtype),
            meta_tensor(B, Hkv, Skv, Dv, dtype=shapes.dtype))
    io = CustomIO({n: dims for n, (_, dims) in capture.inputs.items()})
    mod = AttentionEngine(meta, io, score_mod=engine_score,
                          mask_mod=engine_mask if mask_mod else None, online_func=OnlineSoftmax())
    replay.release()  # the module keeps no captured tensor alive
    return mod
