"""Block tables under CUDA-graph capture (engine.runtime.mask_tables): a mask that reads
tensors is classified inside the graph from the data it is given, never from a cached entry,
and that classification (the persistent walk's deal included) stays on the device (checked on
the meta device: a host tensor mixed in, or a read back, would fail there); index-only masks
keep their cached tables. CPU: capture is simulated by patching `capturing`;
tests/gpu/test_cuda_graphs_kernels.py replays on new data on the GPU."""

from __future__ import annotations

import pytest
import torch

from engine.runtime import mask_tables
from engine.runtime.fused import fuse
from engine.variants import get_variant
from tests import table_spec

SIZES = dict(batch=2, heads_q=4, heads_kv=4, seqlen_q=1000, seqlen_kv=1000, head_dim=64,
             head_dim_v=64)
CPU, META = torch.device("cpu"), torch.device("meta")


def _module(name: str):
    if name == "segments":  # tests/table_spec.py: a segment id per pair of positions
        mod = table_spec.module(torch.bfloat16, 2, 4, 2, SIZES["seqlen_q"], 64)
        data = table_spec.inputs(2, 4, SIZES["seqlen_q"], "cpu", torch.Generator().manual_seed(0))
        return mod, {n: data[n] for n in mod.custom_io.names()}
    v = get_variant(name)
    mod = v.build(**SIZES, dtype=torch.bfloat16, backend="tilelang")
    data = v.make_inputs(**SIZES, dtype=torch.bfloat16, seed=0)
    return mod, {n: data[n] for n in mod.custom_io.names()}


def _all_tables(mod) -> list:
    bk = mod.backward_kernels()
    return [t for t in (mod.forward_kernel().tables, bk.tables, bk.dq_tables) if t is not None]


def _other_documents(customs: dict) -> dict:
    """The documents cut elsewhere: ids shifted by a third of the sequence."""
    return {n: t.roll(SIZES["seqlen_q"] // 3, dims=-1) for n, t in customs.items()}


@pytest.mark.parametrize("name", ["document", "document_prefix"])
def test_a_captured_data_mask_is_classified_from_the_data_it_is_given(name, monkeypatch):
    mod, customs = _module(name)
    other = _other_documents(customs)
    for tables in _all_tables(mod):
        want = [tables.named(d, CPU) for d in (customs, other)]
        assert any(not torch.equal(want[0][n], want[1][n]) for n in want[0])
        cached = len(tables._cache)
        monkeypatch.setattr(mask_tables, "capturing", lambda device: True)
        for d, w in zip((customs, other), want, strict=True):
            got = tables.named(d, CPU)
            assert all(torch.equal(got[n], w[n]) for n in w)  # the walk's deal too
        assert len(tables._cache) == cached, "a capture's tables are not kept"
        monkeypatch.setattr(mask_tables, "capturing", lambda device: False)


@pytest.mark.parametrize("name", ["document", "document_prefix", "segments"])
def test_a_captured_classification_stays_on_the_device(name, monkeypatch):
    mod, customs = _module(name)
    on_meta = {n: t.to(META) for n, t in customs.items()}
    for tables in _all_tables(mod):
        monkeypatch.setattr(mask_tables, "capturing", lambda device: False)
        want = tables.named(customs, CPU)
        monkeypatch.setattr(mask_tables, "capturing", lambda device: True)
        got = tables.named(on_meta, META)
        assert all(t.device == META for t in got.values())
        assert [(n, t.shape, t.dtype) for n, t in got.items()] == \
            [(n, t.shape, t.dtype) for n, t in want.items()]


def test_an_index_only_mask_keeps_its_tables_when_captured(monkeypatch):
    mod, customs = _module("softmax_causal")
    tables = mod.forward_kernel().tables
    eager = tables.get(customs, CPU)
    monkeypatch.setattr(mask_tables, "capturing", lambda device: True)
    assert tables.get(customs, CPU) is eager


def test_a_classification_the_compiler_refuses_runs_op_by_op(monkeypatch):
    mod, customs = _module("document_prefix")
    tables = mod.forward_kernel().tables

    def refuse(fn, example):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(mask_tables, "fuse", refuse)
    op_by_op = tables._fuse(customs, CPU)
    want = tables.named(customs, CPU)
    assert all(torch.equal(got, want[n]) for n, got in zip(tables.names, op_by_op(customs),
                                                           strict=True))


def test_the_compiled_classification_follows_the_data_it_is_given():
    """engine.runtime.fused on the CPU (the GPU compiles the same graph to Triton): traced on
    one set of documents, it gives the op-by-op tables, the walk's deal included, on those and
    on documents cut elsewhere (nothing of the example's data is baked in)."""
    mod, customs = _module("document_prefix")
    tables = mod.forward_kernel().tables
    compiled = fuse(lambda cs: tables._classified(cs, CPU), customs)
    for d in (customs, _other_documents(customs)):
        want = tables._classified(d, CPU)
        assert all(torch.equal(g, w) for g, w in zip(compiled(d), want, strict=True))
