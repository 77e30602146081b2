"""The persistent walk's order (engine/kernels/attention_fwd/walk.py): every tile dealt once,
the blocks' work balanced, sections of heads that share L2, and the kernel reading the
host's table where a mask makes rows differ in length."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention_fwd import walk
from engine.plan.config import KernelConfig
from engine.variants import VARIANTS

WALK = KernelConfig(128, 128, 2, 256, schedule="overlap", persistent=True)


def _module(name: str, dynamic: bool = False, **shape):
    sizes = dict(batch=1, heads_q=16, heads_kv=16, seqlen_q=16384, seqlen_kv=16384,
                 head_dim=128, head_dim_v=128)
    mod = VARIANTS[name].build(**{**sizes, **shape}, dtype=torch.bfloat16,
                               backend="reference", config=WALK)
    mod.dynamic_shapes = dynamic
    return mod


def _dealt(mod, deal: str = "on_host") -> tuple[list[list[int]], torch.Tensor]:
    """Each block's tiles (grid numbers) from the forward's Walk table, dealt by WalkTable's
    `deal`, and the key blocks of every tile (batch, head, query block)."""
    fk = mod.forward_kernel()
    tables = fk.tables.named({}, torch.device("cpu"))
    table, s = getattr(fk.tables.extra, deal)(tables).tolist(), fk.shape
    blocks = min(132, -(-s.seqlen_q // 128) * s.heads_q * s.batch)
    assert table[blocks] == len(table) - blocks - 1, "the offsets end at the tile count"
    own = [table[blocks + 1 + table[p]:blocks + 1 + table[p + 1]] for p in range(blocks)]
    keys = (tables["Hi"] - tables["Lo"]).expand(s.batch, s.heads_q, -1)
    return own, keys


@pytest.mark.parametrize("deal", ["on_host", "on_device"])
@pytest.mark.parametrize("name,shape", [
    ("softmax_causal", {}),
    ("softmax_causal", dict(batch=3, heads_q=8, heads_kv=2, seqlen_q=3000, seqlen_kv=3000)),
    ("sliding_window", dict(batch=2, seqlen_q=4096, seqlen_kv=4096)),
    ("softmax_causal", dict(batch=1, heads_q=2, heads_kv=2, seqlen_q=1024, seqlen_kv=1024)),
])
def test_every_tile_dealt_once_and_blocks_balanced(name, shape, deal):
    own, keys = _dealt(_module(name, **shape), deal)
    tiles = [t for mine in own for t in mine]
    assert sorted(tiles) == list(range(keys.numel())), "each tile exactly once"
    cost = keys.reshape(-1) + walk.TILE_OVERHEAD_BLOCKS
    work = [sum(int(cost[t]) for t in mine) for mine in own]
    # host: each block's last tile went to it while it was the least loaded; device: a
    # round's tiles are no longer than the last round's, and the turn evens each pair out
    mean = sum(work) / len(work)
    assert max(work) <= mean + int(cost.max()), work
    if len(tiles) > 12 * len(own):  # many tiles a block: evened out
        assert max(work) <= 1.02 * mean, work


def test_the_device_deal_walks_each_block_section_by_section_longest_first():
    """16k, D 128, 16 heads: four sections of four heads (as the host's deal); each block's
    tiles in section order, longest first within one."""
    mod = _module("softmax_causal")
    own, keys = _dealt(mod, "on_device")
    cost = keys.reshape(-1)
    per_section = 4 * 128
    for mine in own:
        order = [(t // per_section, -int(cost[t])) for t in mine]
        assert order == sorted(order)
    assert {t // per_section for t in own[0]} == {0, 1, 2, 3}


def test_causal_tiles_go_longest_first_within_l2_sections():
    """16k, D 128: one head's K and V are 8 MB, four heads to a 32 MB section; the first
    wave of 132 blocks takes section 0's 33 longest query blocks of each head."""
    mod = _module("softmax_causal")
    assert walk.l2_section(16, 1, 16384 * 256 * 2) == 4
    own, _ = _dealt(mod)
    grid_q = 128
    first = [mine[0] for mine in own]
    assert sorted(first) == sorted(h * grid_q + x for h in range(4) for x in range(95, 128))
    assert walk.l2_section(16, 1, 16384 * 256 * 2, budget=2 << 20) == 1
    assert walk.l2_section(32, 4, 4096 * 256 * 2) == 32  # GQA: heads share a KV head's bytes
    assert walk.l2_section(6, 1, 1 << 30) == 1


def test_kernel_reads_the_table_only_for_masked_static_walks():
    causal = _module("softmax_causal").kernel_source
    assert "for it in T.serial(Walk[pid + 1] - Walk[pid]):" in causal
    assert "tile: T.int32 = Walk[133 + Walk[pid] + it]" in causal
    assert "Walk: T.Tensor((2181), \"int32\")" in causal  # 132 + 1 offsets, 2048 tiles
    plain = _module("softmax").kernel_source
    assert "Walk" not in plain and "T.ceildiv(2048 - pid, 132)" in plain
    dynamic = _module("softmax_causal", dynamic=True)
    assert "Walk" not in dynamic.kernel_source


def test_data_mask_deals_each_batch_by_its_documents():
    """A mask that reads data (document ids per batch): the table follows the ids, rebuilt
    when they change in place, and still deals every tile once."""
    mod = _module("document", batch=2, heads_q=4, heads_kv=4, seqlen_q=2048, seqlen_kv=2048)
    fk = mod.forward_kernel()
    ids = torch.zeros(2, 2048)
    ids[0, 1024:] = 1  # batch 0: two documents; batch 1: one
    first = fk.tables.named({"doc_ids": ids}, torch.device("cpu"))
    keys = (first["Hi"] - first["Lo"]).expand(2, 4, -1)
    assert keys[0, 0, -1] == 8 and keys[1, 0, -1] == 16  # the last row's keys per batch
    blocks = 2 * 4 * 16
    table = first["Walk"].tolist()
    assert sorted(table[blocks + 1:]) == list(range(blocks))
    ids[1, 512:] = 1  # in place: the tables (and the deal) are rebuilt
    again = fk.tables.named({"doc_ids": ids}, torch.device("cpu"))
    assert not torch.equal(again["Walk"], first["Walk"])


@pytest.mark.parametrize("n,most", [(1, 0), (7, 3), (2048, 65), (4096, 129)])
def test_longest_first_is_a_stable_descending_sort(n, most):
    """The device deal's counting sort places each cost as a stable sort, longest first,
    would (random costs with many ties, every level from 0 to `most`)."""
    cost = torch.randint(0, most + 1, (n,), generator=torch.Generator().manual_seed(n))
    expected = torch.empty_like(cost)
    expected[cost.argsort(descending=True, stable=True)] = torch.arange(n)
    assert torch.equal(walk.longest_first(cost, most), expected)
    # past its cells (long rows), a sort: the same places
    assert torch.equal(walk.longest_first(cost, most, cells=n * most), expected)
