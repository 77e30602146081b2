"""The parallel attention forward: one thread block per (query block, head, batch) walks the
key blocks the mask leaves (plan: config model and defaults; codegen; launch)."""
