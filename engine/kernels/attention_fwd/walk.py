"""The persistent walk's order: which tiles a thread block takes, and in what order.

Without a mask every tile walks the same keys, and block pid takes tiles pid, pid + blocks,
... in the grid's order (query block fastest), counted in the kernel. Where a mask makes
tiles differ in length, a fixed deal in grid order gave some SMs the long tiles of every head
(the H100: causal at 16k 0.60x FA3, NOTES 116). There the host lists each block's tiles in a
table (`walk_table`): sections of heads whose K and V fit in L2 one after another, each
section's tiles longest first, and every tile to the block that would be free first (as a
tile counter taken by whichever block finishes first would hand them out, with no counter to
reset between launches).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from engine.codegen.walk_order import WalkOrder, grid_indices
from engine.ir.spec import TracedSpec
from engine.plan.config import H100_SMS, L2_SECTION_BYTES, KernelConfig
from engine.plan.shape import KernelShape
from engine.runtime.fused import untraced
from engine.runtime.persistent import capturing

# A tile's cost beyond its key blocks (its Q load, epilogue and store), in key blocks.
TILE_OVERHEAD_BLOCKS = 1
# The most [level, tile] counts the device deal's counting sort makes (16 MB of int32)
COUNTING_CELLS = 1 << 22


def walks_table(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig) -> bool:
    """Whether the persistent walk takes its tiles from the host's table: rows of unequal
    length (a mask) at static lengths (the table is built for them)."""
    return cfg.persistent and spec.mask is not None and not shape.dynamic


def table_order(blocks: int, grid_q: str, heads: int) -> WalkOrder:
    """Block pid's tiles from `Walk` (walk_table's layout: offsets, then the tiles)."""
    return WalkOrder("Walk[pid + 1] - Walk[pid]", f"Walk[{blocks + 1} + Walk[pid] + it]",
                     grid_indices(grid_q, heads, False))


def static_blocks(shape: KernelShape, block_M: int) -> tuple[int, int]:
    """(blocks, tiles) of a persistent walk at `shape` (the tiled one, static lengths): no
    more blocks than tiles."""
    tiles = -(-shape.seqlen_q // block_M) * shape.heads_q * shape.batch
    return min(H100_SMS, tiles), tiles


def l2_section(heads: int, group: int, kv_head_bytes: int, budget: int | None = None) -> int:
    """The most query heads (a divisor of `heads`) whose K and V fit `budget` bytes of L2
    (L2_SECTION_BYTES by default): `group` query heads share one KV head's `kv_head_bytes`."""
    fit = max(1, (budget or L2_SECTION_BYTES) // max(1, kv_head_bytes)) * group
    return max(d for d in range(1, heads + 1) if heads % d == 0 and d <= fit)


@dataclass(frozen=True)
class WalkTable:
    """The `Walk` table at a tiled shape, from the forward's mask tables: an index-only mask's
    dealt once on the host, a data mask's where its tables are built (engine.runtime.
    mask_tables)."""

    shape: KernelShape
    blocks: int
    key_blocks: int  # a row's most key blocks (a tile's cost is at most key_blocks + 1)
    # per device: the snake deal's parts from the shape alone, made once and outside a trace
    # (so a compiled classification reads them as constants, not as index arithmetic)
    _orders: dict[torch.device, SnakeOrder] = field(default_factory=dict, compare=False)

    def on_host(self, tables: dict[str, torch.Tensor]) -> torch.Tensor:
        return walk_table(tables, self.shape, self.blocks)

    def on_device(self, tables: dict[str, torch.Tensor]) -> torch.Tensor:
        device = tables["Lo"].device
        order = self._orders.get(device)
        if order is None:
            with untraced():
                order = snake_order(self.shape, tables["Lo"].shape[-1], self.blocks, device)
            if not capturing(device):  # a capture's tensors belong to its graph
                self._orders[device] = order
        return snake_table(tables, self.shape, self.blocks, order, self.key_blocks)


def walk_table(tables: dict[str, torch.Tensor], shape: KernelShape, blocks: int
               ) -> torch.Tensor:
    """Each block's tiles (grid numbers), int32: blocks + 1 offsets, then the tiles, block by
    block. `tables`: the forward's mask tables of the tiled `shape` (its key ranges Lo, Hi).
    On the host: each tile in turn to the block that would be free first."""
    cost, number = _costs(tables, shape), walk_numbers(shape, tables["Lo"].shape[-1])
    order = cost[number].argsort(dim=-1, descending=True, stable=True)
    tiles = number.gather(-1, order).reshape(-1)
    return _deal(tiles.tolist(), cost[tiles].tolist(), blocks)


def snake_table(tables: dict[str, torch.Tensor], shape: KernelShape, blocks: int,
                order: SnakeOrder, key_blocks: int) -> torch.Tensor:
    """walk_table's layout, dealt where the tables are (a data mask's, on the GPU, inside a
    CUDA graph too) with no read back: the tiles of all sections longest first, round by
    round to blocks 0 .. n-1 and back n-1 .. 0 (in a round each block takes one tile, and the
    turn puts a round's longest after the last round's shortest: loads differ by at most one
    tile), then each block's own tiles section by section, longest first. `order`: the
    parts that follow from the shape alone (snake_order's); `key_blocks`: a row's most."""
    cost = _costs(tables, shape)[order.number]
    rank = longest_first(cost, key_blocks + TILE_OVERHEAD_BLOCKS)
    longest = torch.empty_like(order.number).scatter(0, rank, order.number)
    section = longest // order.per_section
    # where the j-th longest goes: its block's start, the block's tiles of earlier sections,
    # and its section's tiles the block took in earlier rounds (no second sort)
    one_hot = (section.unsqueeze(1) == torch.arange(order.sections, device=cost.device))
    # a zero row last, for the slots past the last tile
    grid = torch.nn.functional.pad(one_hot.to(torch.int32), (0, 0, 0, 1))[order.at_slot]
    grid = grid.view(-1, blocks, order.sections)  # [round, block, section]
    earlier = (grid.cumsum(0, dtype=torch.int32) - grid).view(-1, order.sections)
    taken = grid.sum(0, dtype=torch.int32)
    before = taken.cumsum(1, dtype=torch.int32) - taken  # [block, section]
    place = (order.offsets[order.owner] + before[order.owner, section]
             + earlier[order.slot, section])
    tiles = torch.empty_like(longest).scatter(0, place.to(torch.int64), longest)
    return torch.cat([order.offsets, tiles])


def longest_first(cost: torch.Tensor, most: int, cells: int = COUNTING_CELLS) -> torch.Tensor:
    """Each cost's place in a stable sort, longest first, of `cost` (int, 0..`most`): a
    counting sort, a few fused kernels, where a compiled sort of a few thousand took longer
    than the rest of the tables (NOTES 168, 170); a sort where its [level, tile] counts would
    pass `cells` (they grow with the tiles times a row's key blocks: 33 M at 128k)."""
    if (most + 1) * cost.numel() > cells:
        rank = torch.empty_like(cost)
        order = cost.argsort(descending=True, stable=True)
        return rank.scatter(0, order, torch.arange(cost.numel(), device=cost.device))
    levels = torch.arange(most, -1, -1, device=cost.device).unsqueeze(1)
    at = (cost.clamp(0, most).unsqueeze(0) == levels).to(torch.int32)  # [level, tile]
    count = at.sum(1, dtype=torch.int32)
    longer = count.cumsum(0, dtype=torch.int32) - count
    before = at.cumsum(1, dtype=torch.int32) - at  # equal costs earlier in `cost`
    return ((longer.unsqueeze(1) + before) * at).sum(0).to(torch.int64)


@dataclass(frozen=True)
class SnakeOrder:
    """What a snake deal at a shape takes from the shape alone: the grid numbers in the
    walk's order (per section of heads that share L2, from the last query block, heads
    fastest), the section count and size in tiles, the j-th longest tile's block (`owner`)
    and slot (round * blocks + block), each slot's j (n past the last), and the blocks'
    offsets."""

    number: torch.Tensor
    sections: int
    per_section: int
    owner: torch.Tensor
    slot: torch.Tensor
    at_slot: torch.Tensor
    offsets: torch.Tensor


def snake_order(shape: KernelShape, grid_q: int, blocks: int, device: torch.device
                ) -> SnakeOrder:
    """snake_table's parts that follow from the shape alone (`grid_q` query blocks)."""
    number = walk_numbers(shape, grid_q, device)
    sections, per_section = number.shape
    n = number.numel()
    j = torch.arange(n, device=device)
    turn, place = j // blocks, j % blocks
    owner = torch.where(turn % 2 == 0, place, blocks - 1 - place)
    slot = turn * blocks + owner
    at_slot = torch.full((-(-n // blocks) * blocks,), n, dtype=torch.int64, device=device)
    at_slot[slot] = j
    # int32 values: inductor scatters int64 through an eager kernel (its atomics' limits)
    return SnakeOrder(number.reshape(-1).to(torch.int32), sections, per_section, owner, slot,
                      at_slot, _snake_offsets(n, blocks, device).to(torch.int32))


def _snake_offsets(n: int, blocks: int, device: torch.device) -> torch.Tensor:
    """Where each block's tiles start in a snake deal of n tiles (and n at the end): every
    block takes one tile a full round; the last, partial round reaches the first blocks
    after an even number of full rounds, the last blocks after an odd one."""
    rounds, left = divmod(n, blocks)
    p = torch.arange(blocks + 1, device=device)
    extra = torch.clamp(p, max=left) if rounds % 2 == 0 else torch.clamp(p - (blocks - left), min=0)
    return p * rounds + extra


def _costs(tables: dict[str, torch.Tensor], shape: KernelShape) -> torch.Tensor:
    """Every tile's cost (its key blocks and its own) by grid number."""
    cost = (tables["Hi"] - tables["Lo"]).expand(shape.batch, shape.heads_q, -1)
    return cost.to(torch.int64).reshape(-1) + TILE_OVERHEAD_BLOCKS


def walk_numbers(shape: KernelShape, grid_q: int, device: torch.device | str = "cpu"
                 ) -> torch.Tensor:
    """The grid numbers [section, tile] in the walk's order (`grid_q` query blocks): per
    section of heads that share L2, from the last query block, heads fastest."""
    b, h = shape.batch, shape.heads_q
    section = l2_section(h, h // shape.heads_kv,
                         shape.seqlen_kv * (shape.head_dim + shape.head_dim_v) * 2)
    number = torch.arange(b * h * grid_q, device=device).view(b, h // section, section, grid_q)
    return number.flip(-1).transpose(-1, -2).reshape(-1, grid_q * section)


def _deal(tiles: list[int], costs: list[int], blocks: int) -> torch.Tensor:
    """`tiles` in turn, each to the block that would be free first (the lowest block among
    equals)."""
    free = [(0, pid) for pid in range(blocks)]
    taken: list[list[int]] = [[] for _ in range(blocks)]
    for tile, cost in zip(tiles, costs, strict=True):
        load, pid = heapq.heappop(free)
        taken[pid].append(tile)
        heapq.heappush(free, (load + cost, pid))
    offsets = [0]
    for own in taken:
        offsets.append(offsets[-1] + len(own))
    return torch.tensor(offsets + [t for own in taken for t in own], dtype=torch.int32)
