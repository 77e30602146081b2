"""The chunk tables of a call, built on the device with no host synchronisation (a packed
batch's chunk count is only known there: slots are sized for the most chunks its total length
allows, and unused slots have length 0).

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
    return ChunkTables(seqs, chunks.to(torch.int32))
