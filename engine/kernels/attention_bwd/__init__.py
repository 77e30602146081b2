"""The attention backward: one thread block per (key block, head, batch) walks the query
blocks the mask leaves, plus its pre/post passes and the dQ kernel (the deterministic mode's,
and the head-split schedule's past D 128) (plan: config model and defaults; codegen; launch)."""
