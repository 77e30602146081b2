"""A module's kernels: which config each kind runs (the module's own, its tune file's, or the
kind's default), built once per request (engine.plan.request) and kept by the AttentionEngine
that owns the cache. Changing an option (a config, dynamic shapes) makes a new request, and so
new kernels; `KernelCache.clear` drops them (after tuning wrote a new tune-file entry)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from engine.dtypes import KERNEL_DTYPES, elem_bytes
from engine.ir.merge import TracedMerge
from engine.kernels.attention_bwd.launch import BackwardKernels
from engine.kernels.attention_bwd.plan import (
    check_backward_config,
    step_rows_cap,
)
from engine.kernels.attention_decode.launch import DecodeKernels
from engine.kernels.attention_decode.plan import DecodeConfig, DecodeShape
from engine.kernels.attention_fwd.launch import ForwardKernel
from engine.kernels.attention_fwd.plan import check_config
from engine.kernels.registry import ATTENTION_BWD, ATTENTION_DECODE, ATTENTION_FWD
from engine.plan.config import KernelConfig
from engine.plan.fold import row_fold
from engine.plan.request import KernelRequest
from engine.tuning.select import decode_shape, tuned_config

log = logging.getLogger("engine")


def forward_config(req: KernelRequest) -> KernelConfig:
    """The module's config (checked), else its tune file's entry (the nearest tuned shape)
    unless the entry is stale (tuning.select.is_current), else the default; a missing or
    unreadable tune file means the default."""
    p = req.problem
    if req.options.config is not None:
        return check_config(req.options.config, p.head_dim, p.head_dim_v)
    return tuned_config(req, ATTENTION_FWD, default_at=recorded_forward_default(req)) \
        or forward_default(req)


def recorded_forward_default(req: KernelRequest) -> Callable[[Mapping[str, int]], KernelConfig]:
    """The forward's default at a tune entry's shape as the tuner records it (unfolded spec,
    static rows), whatever this request then runs: what an entry is judged by."""
    p = req.problem
    return lambda shape: ATTENTION_FWD.default(p.head_dim, p.head_dim_v, spec=req.spec,
                                               seqlen_q=shape["seqlen_q"],
                                               seqlen_kv=shape["seqlen_kv"])


def forward_default(req: KernelRequest) -> KernelConfig:
    """The forward's default config for the request."""
    p = req.problem
    # dynamic shapes: one kernel for every length, so the length cannot pick the tile
    dynamic = bool(req.options.dynamic_shapes)
    fold = row_fold(req.spec, req.shape)  # a dilated mask's kernel tiles shorter rows
    spec, tiled = (fold.spec, fold.tiled) if fold else (req.spec, p)
    return ATTENTION_FWD.default(p.head_dim, p.head_dim_v, spec=spec,
                                 seqlen_q=None if dynamic else tiled.seqlen_q, dynamic=dynamic,
                                 seqlen_kv=None if dynamic else tiled.seqlen_kv)


def backward_config(req: KernelRequest, config: KernelConfig | None = None,
                    custom_grads: tuple[str, ...] = (), deterministic: bool = False
                    ) -> KernelConfig:
    """`config`, else the module's backward config, else the tune file's, else the default
    (for the gradients of `custom_grads` too). The tuner times the backward without custom
    gradients, so its entry is passed over where they need narrower steps than it has, and
    where it is stale (tuning.select.is_current: confirmed against another default)."""
    p, spec = req.problem, req.spec
    cfg = config or req.options.backward_config
    if cfg is None:
        cfg = tuned_config(req, ATTENTION_BWD, default_at=lambda shape: ATTENTION_BWD.default(
            p.head_dim, p.head_dim_v, spec=spec, seqlen_q=shape["seqlen_q"]))
        cap = None if cfg is None else step_rows_cap(spec, tuple(custom_grads))
        if cap is not None and cfg.block_M > cap:
            log.info("engine: tuned backward config %s has %d-row steps; the gradients of %s "
                     "take the default's narrower ones", cfg.key(), cfg.block_M,
                     ", ".join(custom_grads))
            cfg = None
    if cfg is None:
        # dynamic shapes: one kernel for every length, so the length cannot pick the step
        seqlen_q = None if req.options.dynamic_shapes else p.seqlen_q
        return ATTENTION_BWD.default(p.head_dim, p.head_dim_v, spec=spec,
                                     custom_grads=tuple(custom_grads),
                                     deterministic=deterministic, seqlen_q=seqlen_q)
    n_rows = len(spec.final_names) + int(spec.uses_doosum)
    return check_backward_config(cfg, p.head_dim, p.head_dim_v, n_rows=n_rows)


def decode_config(req: KernelRequest, shape: DecodeShape) -> DecodeConfig:
    """The module's decode_config, else its tune file's entry for the decode shape (Sq, the
    capacity, heads, dims and page size; the nearest tuned capacity and batch, its split count
    then left to the plan), else the default. An entry the validity model rejects at this
    shape's rows (another Sq) is skipped with a log line."""
    if req.options.decode_config is not None:
        return req.options.decode_config
    d, dv, rows = shape.head_dim, shape.head_dim_v, shape.rows
    cfg = tuned_config(req, ATTENTION_DECODE, decode_shape(shape.sizes(), shape.page_size))
    if cfg is not None:
        problems = ATTENTION_DECODE.problems(cfg, d, dv, elem_bytes(req.dtype), rows=rows)
        if not problems:
            return cfg
        log.info("engine: tuned decode config %s is invalid at %d rows (%s); using the default",
                 cfg.key(), rows, "; ".join(problems))
    return ATTENTION_DECODE.default(d, dv, elem_bytes(req.dtype), rows=rows)


class KernelCache:
    """Built kernels (generated, compiled on first launch) by request; `tune_checked`: whether
    tune=True already looked for (or made) a tuned entry."""

    def __init__(self) -> None:
        self._forward: dict[tuple, ForwardKernel] = {}
        self._backward: dict[tuple, BackwardKernels] = {}
        self._decode: dict[tuple, DecodeKernels] = {}
        self.tune_checked = False
        self.generation = 0

    def clear(self) -> None:
        self._forward.clear()
        self._backward.clear()
        self._decode.clear()
        self.generation += 1  # what callers kept from the cache is stale

    def decode(self, req: KernelRequest, shape: DecodeShape, merge: TracedMerge | None,
               sm_count: int) -> DecodeKernels:
        """The decode kernels at `shape` (the request's problem with the cache's paging) and
        the config decode_config(req, shape) picks."""
        key = (req.key(), shape, merge, sm_count)
        if key not in self._decode:
            self._decode[key] = ATTENTION_DECODE.build(req.spec, shape, decode_config(req, shape),
                                                       merge, sm_count)
        return self._decode[key]

    def forward(self, req: KernelRequest) -> ForwardKernel:
        key = req.key()
        if key not in self._forward:
            self._forward[key] = ATTENTION_FWD.build(req.spec, req.shape, forward_config(req))
        return self._forward[key]

    def backward(self, req: KernelRequest, config: KernelConfig | None = None,
                 custom_grads: tuple[str, ...] = (), deterministic: bool | None = None
                 ) -> BackwardKernels:
        """The backward kernels, producing the gradients of the CustomIO tensors named in
        `custom_grads` too; `deterministic` defaults to the request's option."""
        det = bool(req.options.deterministic if deterministic is None else deterministic)
        key = (req.key(), config, tuple(custom_grads), det)
        if key not in self._backward:
            if req.dtype not in KERNEL_DTYPES:
                raise ValueError(f"dtype {req.dtype}: backward kernels support "
                                 f"{sorted(map(str, KERNEL_DTYPES))}")
            self._backward[key] = ATTENTION_BWD.build(req.spec, req.shape,
                                                      backward_config(req, config,
                                                                      custom_grads, det),
                                                      tuple(custom_grads), det)
        return self._backward[key]
