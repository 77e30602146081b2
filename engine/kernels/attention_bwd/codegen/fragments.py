"""The warp-specialised backward's dQ tile in fragment order: where each element of a query
block's dQ goes (dq_fragment_index) and where each position comes from (its inverse)."""

from __future__ import annotations


def dq_fragment_index(i: str, j: str, head_dim: int) -> str:
    """Position of dQ element [i, j] of a query block in the warp-specialised kernel's flat
    dQ tile: the order in which a wgmma accumulator holds it (per 8 columns, thread-major, 4
    values a thread), so that each thread stores 16 contiguous bytes and a warp's stores hit
    every bank once. (i: row, j: column; 64-row, 64-column wgmma tiles; head_dim % 64 == 0.)
    dq_fragment_position inverts it (the postprocess kernel reads the tile back in rows)."""
    g = head_dim // 64
    return (f"((((({i}) // 64 * {g} + ({j}) // 64) * 8 + ({j}) % 64 // 8) * 128"
            f" + ({i}) % 64 // 16 * 32 + ({i}) % 8 * 4 + ({j}) % 8 // 2) * 4"
            f" + ({i}) % 16 // 8 * 2 + ({j}) % 2)")


def dq_fragment_position(p: str, q: str, head_dim: int) -> tuple[str, str]:
    """(row, column) texts of the element at flat position 4 p + q of dq_fragment_index's
    order (p: a thread's 16-byte chunk, q: the value in it); its inverse."""
    g = head_dim // 64
    # p = ((m-tile * g + n-tile) * 8 + column group) * 128 + thread; q = row half * 2 + column.
    return (f"(({p}) // {1024 * g} * 64 + ({p}) % 128 // 32 * 16 + ({q}) // 2 * 8 + ({p}) % 32 // 4)",
            f"(({p}) // 1024 % {g} * 64 + ({p}) // 128 % 8 * 8 + ({p}) % 4 * 2 + ({q}) % 2)")
