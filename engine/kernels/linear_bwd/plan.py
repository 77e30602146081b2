"""The chunked backward's choices beyond its LinearConfig (the forward's plan holds that)."""

from __future__ import annotations

from engine.kernels.linear_fwd.plan import LinearShape


def shared_heads_by_atomics(shape: LinearShape, deterministic: bool) -> bool:
    """Whether the dQ/dK kernel adds the gradients of a q or k head shared by several output
    heads (Mamba2's one B and C for 80 heads) with float32 atomics into that head, instead of
    writing one float32 gradient per output head for a torch sum after it: that write and
    sum moved 2 x 335 MB per tensor at Mamba2-2.7B B 1 x T 8k (238 of the backward's 2010 us,
    results/NOTES.md 142), while the atomics' target is the shared head's (4 MB, in L2). Not
    in the deterministic mode: the atomics' order, and so the sum's rounding, varies."""
    shared = shape.heads_q != shape.heads or shape.heads_k != shape.heads
    return shared and not deterministic
