"""Mask analysis: which (q block, kv block) pairs are empty, partial or full."""
