"""Texts of the mbarrier rings that warp-specialised kernels share between a producer and
its consumers."""

from __future__ import annotations

# TileLang pass config that leaves shared-memory synchronisation to the program: in these
# kernels every barrier is explicit (mbarriers between the roles, named ones among the
# consumers), and TileLang's own would add more that the rings make unnecessary.
DISABLE_STORAGE_SYNC = "tl.disable_thread_storage_sync"


def pass_configs_line() -> str:
    """The generated program's own pass configs (engine.runtime.compile reads them)."""
    return f"PASS_CONFIGS = {{{DISABLE_STORAGE_SYNC!r}: True}}"


def parity(depth: int, step: str = "k") -> str:
    """mbarrier phase parity of `step` in a ring `depth` deep (its round, mod 2)."""
    return f"(({step} // {depth}) % 2)"


def ring(count: int, depth: int) -> str:
    """An mbarrier per stage of a ring `depth` deep, each completed by `count` arrivals."""
    return f"T.alloc_barrier([{', '.join([str(count)] * depth)}])"
