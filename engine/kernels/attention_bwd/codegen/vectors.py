"""Per-position fp32 register vectors of the main kernel: the finals and Delta of a step's
queries, and the custom reads hoisted out of the tile loops (per key, per query).

TileLang replicates a vector over the threads that hold its position's row (or column), so
each thread loads its own few values once. Without a ring, each thread reads them from global
memory, ahead of the gemms whose results they meet. With a ring (the warp-specialised
schedule), the producer warp copies them into shared memory beside Q and dO, and the consumers
read them from there: on the H100 the consumers' own global reads (the finals and Delta, 16
values a thread each at block_M = 64) cost a fifth of the backward's time even when issued
early."""

from __future__ import annotations

from dataclasses import dataclass

from engine.codegen.source import SourceWriter
from engine.ir.spec import TracedSpec
from engine.kernels.attention_bwd.plan import HoistedRead
from engine.plan.shape import KernelShape


@dataclass(frozen=True)
class Vector:
    reg: str  # the register fragment
    ring: str  # its shared-memory ring in the warp-specialised schedule
    src: str  # the global read of its element t
    block: str = ""  # the read of the step's whole block, for one TMA copy ("": none)


@dataclass(frozen=True)
class VectorGroup:
    """Vectors of `n` positions; `ring`: (a step's stage index text, the ring's depth)."""

    vectors: tuple[Vector, ...]
    n: int
    ring: tuple[str, int] | None = None
    # False: read where used from the ring's stage (per-query mask data, which only partial
    # blocks read), no register copy
    in_registers: bool = True

    def allocs(self) -> list[str]:
        if not self.in_registers:
            return []
        return [f'{v.reg} = T.alloc_fragment(({self.n},), "float32")' for v in self.vectors]

    def ring_allocs(self) -> list[str]:
        if self.ring is None:
            return []
        return [f'{v.ring} = T.alloc_shared(({self.ring[1]}, {self.n}), "float32")'
                for v in self.vectors]

    def _loop(self, w: SourceWriter, assigns: list[str]) -> None:
        if assigns:
            with w.block(f"for t in T.Parallel({self.n}):"):
                w.lines(assigns)

    def emit_load(self, w: SourceWriter) -> None:
        """Into the registers: from the ring's stage, or from global memory."""
        if not self.in_registers:
            return
        if self.ring is None:
            self._loop(w, [f"{v.reg}[t] = {v.src}" for v in self.vectors])
        else:
            self._loop(w, [f"{v.reg}[t] = {v.ring}[{self.ring[0]}, t]" for v in self.vectors])

    def emit_fill(self, w: SourceWriter, barrier: str) -> None:
        """The producer's copy into the ring's stage (nothing without a ring): a TMA copy
        counted on `barrier` for a vector read as a whole block, else element by element
        (the producer warp waits for those loads before it arrives)."""
        if self.ring is None:
            return
        stage = self.ring[0]
        w.lines([f"T.tma_copy({v.block}, {v.ring}[{stage}, :], barrier={barrier})"
                 for v in self.vectors if v.block])
        self._loop(w, [f"{v.ring}[{stage}, t] = {v.src}" for v in self.vectors if not v.block])


def row_vectors(spec: TracedSpec, shape: KernelShape, q0: str, head: str, q_block: str = ""
                ) -> tuple[list[Vector], list[Vector]]:
    """The finals and Delta (when `bwd` reads it) of query head `head`'s queries from `q0`;
    with `q_block` (the step's query rows as a slice, where they are a whole block) the
    producer copies each by TMA."""
    def vector(reg: str, ring: str, tensor: str) -> Vector:
        block = f"{tensor}[bz, {head}, {q_block}]" if q_block else ""
        return Vector(reg, ring, f"{tensor}[bz, {head}, T.min({q0} + t, {shape.seqlen_q - 1})]",
                      block)

    finals = [vector(f"Fr_{name}", f"Fs_{name}", f"F_{name}") for name in spec.final_names]
    return finals, [vector("Dr", "Ds", "Delta")] if spec.uses_doosum else []


def hoisted_vectors(hoisted: tuple[HoistedRead, ...], shape: KernelShape, bN: int, q0: str,
                    head: str, stage: str | None = None, q_block: str = ""
                    ) -> tuple[dict[tuple, str], list[Vector], list[Vector]]:
    """(binding of each hoisted read to its vector element, per-key vectors, per-query
    vectors): per key, loaded once before the loop; per query, each step like the finals.
    With `stage` (the step's ring stage index; the plan's q_reads_in_ring), a per-query read
    binds to the ring's shared-memory element instead; with `q_block` (the step's query rows
    as a slice, where they are a whole block) the producer copies it by TMA."""
    pos = {"q": f"T.min({q0} + t, {shape.seqlen_q - 1})",
           "kv": f"T.min(bx * {bN} + t, {shape.seqlen_kv - 1})"}
    index_text = {"b": "bz", "h": head}
    bind: dict[tuple, str] = {}
    by_axis: dict[str, list[Vector]] = {"q": [], "kv": []}
    def read(h: HoistedRead, at: str) -> str:
        parts = [at if x == h.axis else index_text.get(x, "0") if isinstance(x, str)
                 else "0" for x in h.index]
        return f"C_{h.name}[{', '.join(parts)}]"

    for h in hoisted:
        reg = f"Cq{h.slot}" if h.axis == "q" else f"Ck{h.slot}"
        block = read(h, q_block) if q_block and h.axis == "q" and h.index[-1] == "q" else ""
        by_axis[h.axis].append(Vector(reg, f"Cqs{h.slot}", read(h, pos[h.axis]), block))
        if h.axis == "kv":
            bind[(h.name, h.index)] = f"{reg}[i]"
        else:
            bind[(h.name, h.index)] = f"Cqs{h.slot}[{stage}, j]" if stage else f"{reg}[j]"
    return bind, by_axis["kv"], by_axis["q"]
