"""The chunk tables of a call, built on the device with no host synchronisation (a packed
batch's chunk count is only known there: slots are sized for the most chunks its total length
allows, and unused slots have length 0), and the per-sequence sums the backward needs.

Seqs [N, 4]: per sequence its batch row, first position, length and first slot.
Chunks [slots, 4]: per slot its batch row, first position, length (0: unused), 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.linear_fwd.plan import LinearShape


@dataclass
class ChunkTables:
    seqs: torch.Tensor
    chunks: torch.Tensor
    # packed sequences only: per position, its sequence and that sequence's end (int64 [T]);
    # None for equal-length batch rows
    seq_of: torch.Tensor | None = None
    end_of: torch.Tensor | None = None


def chunk_tables(s: LinearShape, chunk: int, cu_seqlens: torch.Tensor | None,
                 device: torch.device) -> ChunkTables:
    if cu_seqlens is None:
        return _equal_tables(s, chunk, device)
    return _packed_tables(s, chunk, cu_seqlens.to(device=device, dtype=torch.int64))


def _equal_tables(s: LinearShape, chunk: int, device: torch.device) -> ChunkTables:
    B, T = s.batch, s.seqlen
    per = -(-T // chunk)
    seqs = torch.tensor([[b, 0, T, b * per] for b in range(B)], dtype=torch.int32)
    rows = [[b, i * chunk, min(chunk, T - i * chunk), 0] for b in range(B) for i in range(per)]
    chunks = torch.tensor(rows, dtype=torch.int32)
    return ChunkTables(seqs.to(device), chunks.to(device))


def _packed_tables(s: LinearShape, chunk: int, cu: torch.Tensor) -> ChunkTables:
    device, N, slots = cu.device, s.sequences, s.slots(chunk)
    bos, lens = cu[:-1], cu[1:] - cu[:-1]
    count = (lens + chunk - 1) // chunk
    ends = torch.cumsum(count, 0)
    first = ends - count
    zeros = torch.zeros_like(bos)
    seqs = torch.stack([zeros, bos, lens, first], 1).to(torch.int32)
    j = torch.arange(slots, device=device)
    n = torch.searchsorted(ends, j, right=True)
    used = n < N
    n = n.clamp(max=N - 1)
    i = j - first[n]
    length = ((lens[n] - i * chunk).clamp(0, chunk)) * used
    row0 = (bos[n] + i * chunk) * used
    chunks = torch.stack([torch.zeros_like(j), row0, length, torch.zeros_like(j)], 1)
    t = torch.arange(s.seqlen, device=device)
    seq_of = (torch.searchsorted(cu[1:], t, right=True)).clamp(max=N - 1)
    return ChunkTables(seqs, chunks.to(torch.int32), seq_of, cu[1:][seq_of])


def sequence_reverse_cumsum(x: torch.Tensor, tables: ChunkTables) -> torch.Tensor:
    """y_t = sum of x over positions t.. of t's sequence, for x [B, H, T]."""
    rc = x.flip(-1).cumsum(-1).flip(-1)
    if tables.seq_of is None:
        return rc
    padded = torch.nn.functional.pad(rc, (0, 1))  # rc at T is 0
    return rc - padded[..., tables.end_of]


def per_sequence(x: torch.Tensor, tables: ChunkTables, shape: LinearShape) -> torch.Tensor:
    """A per-(sequence, head) value x [N, H] broadcast to every position [B, H, T]."""
    if tables.seq_of is None:
        return x.unsqueeze(-1).expand(shape.batch, shape.heads, shape.seqlen)
    return x[tables.seq_of].t().unsqueeze(0)
