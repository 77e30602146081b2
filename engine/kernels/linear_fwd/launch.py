"""Build and launch the chunked forward: the single pass, or the state pass then the output
kernel (LinearConfig.single_pass)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.dtypes import elem_bytes
from engine.kernels.linear_fwd.codegen import (
    generate_decays,
    generate_fused,
    generate_output,
    generate_states,
)
from engine.kernels.linear_fwd.plan import (
    NO_FOLDS,
    Folds,
    LinearConfig,
    LinearShape,
    check_config,
    runs_single_pass,
)
from engine.kernels.linear_fwd.tables import ChunkTables, chunk_tables
from engine.runtime.kernel import Kernel
from engine.runtime.persistent import kept


@dataclass
class ForwardKernels:
    shape: LinearShape
    config: LinearConfig
    output: Kernel
    decays: Kernel  # each chunk slot's running decay sum, run before the others
    folds: Folds = NO_FOLDS  # the mods the kernels apply themselves
    _states: dict[tuple[bool, bool], Kernel] = field(default_factory=dict)
    _single: dict[tuple[bool, bool, bool], Kernel] = field(default_factory=dict)
    _tables: dict[torch.device, ChunkTables] = field(default_factory=dict)

    def states(self, initial: bool, final: bool) -> Kernel:
        """The state pass reading an initial state or not, writing the final one or not."""
        key = (initial, final)
        if key not in self._states:
            # the states do not depend on q: one source with or without a q scale
            folds = Folds(v_weight=self.folds.v_weight)
            self._states[key] = Kernel(generate_states(self.shape, self.config, *key,
                                                       folds=folds))
        return self._states[key]

    def single(self, initial: bool, final: bool, save: bool = False) -> Kernel:
        """The single-pass forward reading an initial state or not, writing the final one or
        not, and the per-chunk states with `save`."""
        key = (initial, final, save)
        if key not in self._single:
            self._single[key] = Kernel(generate_fused(self.shape, self.config, initial, final,
                                                      folds=self.folds, save=save))
        return self._single[key]

    def forward_kernels(self, initial: bool, final: bool, save: bool = False) -> list[Kernel]:
        if single_pass(self):
            return [self.decays, self.single(initial, final, save)]
        return [self.decays, self.states(initial, final), self.output]

    def sources(self, initial: bool = False, final: bool = False, save: bool = False
                ) -> list[str]:
        return [k.source for k in self.forward_kernels(initial, final, save)]

    def compile(self, initial: bool = False, final: bool = False, save: bool = False) -> None:
        for k in self.forward_kernels(initial, final, save):
            k.compiled()

    def tables(self, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkTables:
        """The call's chunk tables (kept per device for equal-length rows: they never change)."""
        if cu_seqlens is not None:
            return chunk_tables(self.shape, self.config.chunk, cu_seqlens, device)
        if device not in self._tables:
            self._tables[device] = kept(
                lambda: chunk_tables(self.shape, self.config.chunk, None, device), device)
        return self._tables[device]


def build_forward(shape: LinearShape, cfg: LinearConfig, folds: Folds = NO_FOLDS
                  ) -> ForwardKernels:
    """The forward kernels at `shape` and `cfg` (checked), generated, not compiled, applying
    `folds` themselves (no pass over q or v before them)."""
    check_config(cfg, shape.head_dim, shape.head_dim_v, elem_bytes(shape.dtype))
    return ForwardKernels(shape, cfg, Kernel(generate_output(shape, cfg, folds)),
                          Kernel(generate_decays(shape, cfg, folds.v_weight)), folds)


@dataclass
class ForwardState:
    """What the backward needs from the forward besides its inputs."""

    tables: ChunkTables
    final: torch.Tensor | None
    slot_data: dict[str, torch.Tensor]  # run_decays': the backward's kernels read it too
    states: torch.Tensor | None = None  # the per-chunk states kept for the backward (Hs)


def run_decays(fk: ForwardKernels, g: torch.Tensor, tables: ChunkTables,
               w: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """{"Gc": each chunk slot's running sum of its log decays [slots, H, chunk], and with a
    folded value weight "Wc": the weights w [B, H, T] by slot}."""
    s, C = fk.shape, fk.config.chunk
    out = {name: torch.empty(s.slots(C), s.heads, C, dtype=torch.float32, device=g.device)
           for name in ("Gc", *(("Wc",) if fk.folds.v_weight else ()))}
    weights = {"W": w} if fk.folds.v_weight else {}
    fk.decays(G=g, **weights, Seqs=tables.seqs, Chunks=tables.chunks, **out)
    return out


def run_states(fk: ForwardKernels, k: torch.Tensor, v: torch.Tensor, tables: ChunkTables,
               slot_data: dict[str, torch.Tensor], initial_state: torch.Tensor | None,
               final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Hs: the state entering every chunk slot, the final state or None), from the chunk
    slots' decay sums (and value weights): run_decays' `slot_data`."""
    hs = state_buffer(fk, k)
    args = {"K": k, "V": v, **slot_data, "Seqs": tables.seqs, "Chunks": tables.chunks,
            "Hs": hs}
    if initial_state is not None:
        args["H0"] = initial_state
    ht = None
    if final:
        ht = args["Ht"] = seq_state_buffer(fk.shape, k.device)
    fk.states(initial_state is not None, final)(**args)
    return hs, ht


def seq_state_buffer(s: LinearShape, device: torch.device) -> torch.Tensor:
    """Room for a state per sequence (final, or an initial one's gradient) [N, H, D, Dv] fp32."""
    return torch.empty(s.num_seqs, s.heads, s.head_dim, s.head_dim_v, dtype=torch.float32,
                       device=device)


def state_buffer(fk: ForwardKernels, like: torch.Tensor) -> torch.Tensor:
    """Room for the state entering every chunk slot, Hs [slots, H, D, Dv] in `like`'s dtype."""
    s = fk.shape
    return torch.empty(s.slots(fk.config.chunk), s.heads, s.head_dim, s.head_dim_v,
                       dtype=like.dtype, device=like.device)


def single_pass(fk: ForwardKernels) -> bool:
    """Whether the forward runs the single pass (plan.runs_single_pass)."""
    return runs_single_pass(fk.shape, fk.config)


def launch_forward(fk: ForwardKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, initial_state: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, final: bool, w: torch.Tensor | None = None,
                   save_states: bool = False) -> tuple[torch.Tensor, ForwardState]:
    """o [B, H, T, Dv] and what the backward reuses (inputs checked and contiguous; w
    [B, H, T] float32: the value weights where fk folds them); with `save_states`, the
    per-chunk states too (the single pass then writes them; the state pass always does)."""
    s = fk.shape
    tables = fk.tables(cu_seqlens, q.device)
    o = torch.empty(s.batch, s.heads, s.seqlen, s.head_dim_v, dtype=q.dtype, device=q.device)
    slot_data = run_decays(fk, g, tables, w)
    io = {"Q": q, "K": k, "V": v, **slot_data, "Seqs": tables.seqs, "Chunks": tables.chunks,
          "O": o}
    if not single_pass(fk):
        hs, ht = run_states(fk, k, v, tables, slot_data, initial_state, final)
        fk.output(**io, Hs=hs)
        return o, ForwardState(tables, ht, slot_data, hs if save_states else None)
    ht = None
    if initial_state is not None:
        io["H0"] = initial_state
    if final:
        ht = io["Ht"] = seq_state_buffer(s, q.device)
    hs = None
    if save_states:
        hs = io["Hs"] = state_buffer(fk, k)
    fk.single(initial_state is not None, final, save_states)(**io)
    return o, ForwardState(tables, ht, slot_data, hs)
