"""CustomIO (extra input tensors of a variant) and meta_tensor (shape declarations)."""

from __future__ import annotations

from typing import Any

import torch

from engine.dsl.expr import DSLError, Expr, custom_leaf

NAMED_DIMS = ("batch", "heads", "seq_len", "seq_len_kv")


class CustomIO:
    """Extra input tensors, declared by name with their dims.

    Each dim is one of "batch", "heads" (query heads), "seq_len" (query positions),
    "seq_len_kv" (key positions) or a positive integer size (1: broadcast; more: a table
    indexed explicitly). Inside `score_mod` and the online functions,
    `custom_fwd_inputs["name"]` (or `.input_tensors["name"]`) reads the tensor at the current
    (b, h, q_idx, kv_idx); `custom_fwd_inputs["name"][b, kv_idx]` indexes it explicitly (e.g.
    document ids read at a key position). In `score_mod` and `mask_mod` an index may be any
    integer expression of b, h, q_idx and kv_idx, e.g. a relative-position table declared
    `("heads", 2 * S - 1)` read as `["rel"][h, q_idx - kv_idx + S - 1]`: an index outside the
    tensor is an IndexError on the reference executor; the kernels clamp it to the nearest
    entry (they never read out of bounds).
    """

    def __init__(self, decls: dict[str, tuple] | None = None):
        decls = {} if decls is None else decls
        if not isinstance(decls, dict):
            raise DSLError(f"CustomIO: expected a dict name -> dims, got {type(decls).__name__}")
        self.decls: dict[str, tuple] = {}
        for name, dims in decls.items():
            if not isinstance(name, str) or not name.isidentifier() or name in ("q", "k", "v"):
                raise DSLError(f"CustomIO: name {name!r} must be an identifier other than q, k, v")
            dims = (dims,) if isinstance(dims, (str, int)) else tuple(dims)
            if not dims:
                raise DSLError(
                    f"CustomIO[{name!r}]: declare at least one dim (use (1,) for a scalar)"
                )
            seen = set()
            for d in dims:
                if isinstance(d, str):
                    if d not in NAMED_DIMS:
                        raise DSLError(
                            f"CustomIO[{name!r}]: dim {d!r} not one of {NAMED_DIMS} or 1"
                        )
                    if d in seen:
                        raise DSLError(f"CustomIO[{name!r}]: dim {d!r} appears twice")
                    seen.add(d)
                elif isinstance(d, bool) or not (isinstance(d, int) and d >= 1):
                    raise DSLError(f"CustomIO[{name!r}]: dim {d!r}: expected a named dim or a "
                                   "positive integer size")
            self.decls[name] = dims

    @property
    def input_tensors(self) -> CustomIO:
        return self

    def names(self) -> list[str]:
        return list(self.decls)

    def __getitem__(self, name: str) -> Expr:
        if name not in self.decls:
            raise DSLError(
                f"CustomIO: no input named {name!r}; declared: {sorted(self.decls) or 'none'}"
            )
        return custom_leaf(name, self.decls[name])

    def __contains__(self, name: str) -> bool:
        return name in self.decls

    def __len__(self) -> int:
        return len(self.decls)

    def expected_shape(self, name: str, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.decls[name])

    def __repr__(self) -> str:
        return f"CustomIO({self.decls!r})"


def meta_tensor(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A shape-and-dtype declaration (a tensor on the meta device: no memory).

    As in the seeds, `qkv_meta` entries are given in (B, H, S, D) order even though the
    runtime tensors are laid out [B, S, H, D]."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if len(shape) != 4 or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ValueError(f"meta_tensor(B, H, S, D): expected 4 positive ints, got {shape}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"meta_tensor: dtype {dtype} not supported; expected float16, bfloat16 or float32"
        )
    return torch.empty(shape, dtype=dtype, device="meta")


def is_custom_decl(x: Any) -> bool:
    return isinstance(x, CustomIO)
