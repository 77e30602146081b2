"""How tune files key a linear problem (both linear kinds): the seven sizes of an attention
problem read as linear attention (heads_q: q's heads HQ, heads_kv: k's heads HK, seqlen_q =
seqlen_kv = T, the head dims D and Dv) and `heads`, the value and output heads H. Keeping the
seven keys lets tune files, study names and the nearest-shape rules serve every kind alike.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.kernels.linear_fwd.plan import LinearConfig, LinearShape, config_for_shape


def keyed(sizes: Mapping[str, int], heads: int) -> dict[str, int]:
    """The tune-file shape from the seven sizes (attention's names) and the value heads."""
    keys = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim", "head_dim_v")
    return {**{k: int(sizes[k]) for k in keys}, "heads": int(heads)}


def tune_shape(shape: LinearShape) -> dict[str, int]:
    """The tune-file shape of a LinearShape (packed sequences are not keyed: see
    engine.runtime.linear_backend.tuned_configs)."""
    return keyed({"batch": shape.batch, "heads_q": shape.heads_q, "heads_kv": shape.heads_k,
                  "seqlen_q": shape.seqlen, "seqlen_kv": shape.seqlen,
                  "head_dim": shape.head_dim, "head_dim_v": shape.head_dim_v}, shape.heads)


def shape_from(tuned: Mapping[str, int], dtype: str) -> LinearShape:
    """The LinearShape (equal-length batch rows) a tune-file shape names."""
    return LinearShape(batch=tuned["batch"], heads_q=tuned["heads_q"],
                       heads_k=tuned["heads_kv"], heads=tuned["heads"],
                       seqlen=tuned["seqlen_q"], head_dim=tuned["head_dim"],
                       head_dim_v=tuned["head_dim_v"], dtype=dtype)


def default_at(tuned: Mapping[str, int], dtype: str) -> LinearConfig:
    """The config the engine runs at a tune-file shape without a tune-file entry."""
    return config_for_shape(shape_from(tuned, dtype))
