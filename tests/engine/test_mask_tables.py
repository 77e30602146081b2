"""Block tables under CUDA-graph capture (engine.runtime.mask_tables): a mask that reads tensors
binds tables that hold for any data (classified with its tensors unknown), since a replay does
not look the tables up again; index-only masks keep their tables. CPU: capture is simulated by patching
`capturing`; tests/gpu/test_cuda_graphs_kernels.py replays on new data on the GPU."""

from __future__ import annotations

import torch

from engine.mask.analysis import EMPTY, PARTIAL
from engine.runtime import mask_tables
from engine.variants import get_variant

SIZES = dict(batch=2, heads_q=4, heads_kv=4, seqlen_q=1024, seqlen_kv=1024, head_dim=64,
             head_dim_v=64)


def _tables(name: str):
    v = get_variant(name)
    mod = v.build(**SIZES, dtype=torch.bfloat16, backend="tilelang")
    data = v.make_inputs(**SIZES, dtype=torch.bfloat16, seed=0)
    customs = {n: data[n] for n in mod.custom_io.names()}
    return mod.forward_kernel().tables, customs


def test_a_captured_data_mask_binds_tables_for_any_data(monkeypatch):
    tables, customs = _tables("document")
    cpu = torch.device("cpu")
    eager = tables.named(customs, cpu)
    assert (eager["Cls"] == EMPTY).any(), "the documents leave empty blocks to skip"
    monkeypatch.setattr(mask_tables, "capturing", lambda device: True)
    captured = tables.named(customs, cpu)
    # causal documents, the ids unknown: the blocks past the diagonal empty, the rest partial
    cls = captured["Cls"]
    qb = torch.arange(cls.shape[-2]).view(-1, 1)
    kb = torch.arange(cls.shape[-1]).view(1, -1)
    past = kb * tables.block_N > (qb + 1) * tables.block_M - 1
    assert past.any() and torch.equal(cls, torch.where(past, EMPTY, PARTIAL).to(cls).expand_as(cls))
    other = {n: t.flip(-1) for n, t in customs.items()}  # other data: the same tables
    assert all(torch.equal(a, b) for a, b in zip(tables.get(other, cpu), tables.get(customs, cpu),
                                                 strict=True))
    monkeypatch.setattr(mask_tables, "capturing", lambda device: False)
    assert all(torch.equal(a, eager[n]) for n, a in tables.named(customs, cpu).items())


def test_a_captured_data_mask_without_index_bounds_is_partial_everywhere(monkeypatch):
    tables, customs = _tables("document_prefix")  # a prefix end per query: any key may be seen
    monkeypatch.setattr(mask_tables, "capturing", lambda device: True)
    assert (tables.named(customs, torch.device("cpu"))["Cls"] == PARTIAL).all()


def test_an_index_only_mask_keeps_its_tables_when_captured(monkeypatch):
    tables, customs = _tables("softmax_causal")
    cpu = torch.device("cpu")
    eager = tables.named(customs, cpu)
    monkeypatch.setattr(mask_tables, "capturing", lambda device: True)
    assert all(torch.equal(a, eager[n]) for n, a in tables.named(customs, cpu).items())
    assert (eager["Cls"] == EMPTY).any()
