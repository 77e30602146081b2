"""Which configs LinearAttentionEngine's kernels run: the module's own, else its tune file's
entry for the exact shape (`attnbench tune --mode linear` writes them), else the plan's
config_for_shape.

Two kinds, two entries per shape: linear_fwd's config runs the forward of an inference call;
linear_bwd's was measured with forward and backward at that one config, so a call that will be
differentiated (a training step) runs it for both passes. Only exact shapes match (a chunk
chosen for another batch or length can be the wrong one: config_for_shape's rule turns on the
number of sequences), and packed calls (cu_seqlens) use config_for_shape: their sequences are
not the tuned batch rows.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from engine.dtypes import elem_bytes
from engine.kernels.linear_fwd.plan import (
    LinearConfig,
    LinearShape,
    config_for_shape,
    training_configs,
)
from engine.kernels.linear_fwd.tune_shape import tune_shape
from engine.kernels.registry import LINEAR_BWD, LINEAR_FWD, KernelKind
from engine.tuning import select, tune_file

log = logging.getLogger("engine")

# What tune files key the linear kinds' entries by in place of a traced spec's hash: the
# kernels run the core problem (the mods are a torch pre-pass, or folds: a constant q scale
# and per-position value weights, which multiply the decay factors and leave the tiles' work as
# it is), so one entry serves every variant at its shape.
TUNE_SPEC = "linear"


class Tuned(NamedTuple):
    """A shape's tune-file configs: the forward's (linear_fwd) and a training step's
    (linear_bwd), each None where the file has no exact entry."""

    forward: LinearConfig | None = None
    training: LinearConfig | None = None


def _exact(kind: KernelKind, shape: LinearShape, path: str | None, gpu: str
           ) -> LinearConfig | None:
    hit = tune_file.lookup(path, template=kind.name, spec_hash=TUNE_SPEC, dtype=shape.dtype,
                           mode=kind.mode, gpu=gpu, shape=tune_shape(shape),
                           config_type=kind.config_type)
    if hit is None or not hit[1].get("exact"):
        return None
    cfg = hit[0]
    problems = kind.problems(cfg, shape.head_dim, shape.head_dim_v, elem_bytes(shape.dtype))
    if problems:
        log.info("engine: tuned %s config %s is invalid at %s (%s); not used", kind.name,
                 cfg.key(), shape.key(), "; ".join(problems))
        return None
    return cfg


def tuned_configs(shape: LinearShape, path: str | None, gpu: str | None = None) -> Tuned:
    """The exact-shape entries of the tune file at `path` (None: results/tune/<gpu>/<kind>.json)
    for this GPU (default: this machine's)."""
    if shape.sequences:
        return Tuned()
    gpu = gpu or select.gpu_name()
    return Tuned(_exact(LINEAR_FWD, shape, path, gpu), _exact(LINEAR_BWD, shape, path, gpu))


def pick(shape: LinearShape, config: LinearConfig | None,
         backward_config: LinearConfig | None, tuned: Tuned, training: bool
         ) -> tuple[LinearConfig, LinearConfig | None]:
    """(forward config, backward config or None: the forward's) to run. The module's configs
    win; a training call with neither runs the linear_bwd entry for both passes; a backward
    entry is used beside another forward config only where its chunk is the forward's. An
    entry that is config_for_shape's config stands for the untuned pair (training_configs)."""
    if training and config is None and backward_config is None and tuned.training:
        return training_configs(shape, tuned.training)
    fwd = config or tuned.forward or config_for_shape(shape)
    bwd = backward_config
    if bwd is None and tuned.training is not None and tuned.training.chunk == fwd.chunk:
        bwd = training_configs(shape, tuned.training)[1]
    if bwd is None and config is None and tuned.forward is None:
        bwd = training_configs(shape, fwd)[1]  # fwd is config_for_shape's: the untuned pair
    return fwd, (None if bwd == fwd else bwd)


class TuneLookup:
    """A module's tune-file lookups, by shape, file and GPU (a file is read once per shape;
    `clear` after a new entry was written)."""

    def __init__(self) -> None:
        self._hits: dict[tuple, Tuned] = {}

    def clear(self) -> None:
        self._hits.clear()

    def __call__(self, shape: LinearShape, path: str | None) -> Tuned:
        gpu = select.gpu_name()
        key = (shape, path, gpu)
        if key not in self._hits:
            self._hits[key] = tuned_configs(shape, path, gpu)
        return self._hits[key]
