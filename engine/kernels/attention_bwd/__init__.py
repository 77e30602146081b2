"""The attention backward: one thread block per (key block, head, batch) walks the query
blocks the mask leaves, plus its pre/post passes and the deterministic mode's dQ kernel
(plan: config model and defaults; codegen; launch)."""
