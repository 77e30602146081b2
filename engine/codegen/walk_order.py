"""Texts of a persistent walk's order in a generated kernel: which tiles thread block pid
takes (a tile is a (batch, head, block) of the launch's grid), for the forward's query tiles
and the backward's kv blocks alike."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WalkOrder:
    """A walk's texts: `trips` (a block's tile count), `tile` (its it-th tile's number in
    grid order) and `indices` (the lines naming that tile's bz, by and bx)."""

    trips: str
    tile: str
    indices: tuple[str, ...]


def grid_indices(grid_x: str, heads: int, reverse: bool) -> tuple[str, ...]:
    """Tile `tile` in grid order: its block of `grid_x` (the forward's query blocks, the
    backward's key blocks) fastest (from the last where `reverse`), then head, then batch."""
    block = f"tile % {grid_x}"
    return (f"bz: T.int32 = tile // ({grid_x} * {heads})",
            f"by: T.int32 = tile // {grid_x} % {heads}",
            f"bx: T.int32 = {f'{grid_x} - 1 - {block}' if reverse else block}")


def grid_order(count: str, blocks: int, grid_x: str, heads: int, reverse: bool) -> WalkOrder:
    """Tiles pid, pid + blocks, ... of `count` in grid order."""
    return WalkOrder(f"T.ceildiv({count} - pid, {blocks})", f"pid + it * {blocks}",
                     grid_indices(grid_x, heads, reverse))
