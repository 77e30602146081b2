"""Every generated kernel source of the variant library, hashed: the invariant that a refactor
of the code generators leaves each kernel byte-identical.

The corpus: every variant (plus two specs with custom reads indexed by the query or the key
alone) at a handful of shapes (tails, GQA, a GQA shape large enough for the backward's heads
walk, head dims 64 and 256, Dv != D) and dtypes; the forward at its default config and at
tuner-space configs, with static and dynamic shapes; the backward at its default and
tuner-space configs, fast and deterministic, with and without custom gradients, and with the
automatic pipeline forced where the warp-specialised schedule would be chosen. A case the
engine refuses is recorded as the exception's type, so that refusals stay the same too. Decode
kernels at two cache shapes, contiguous and paged; the linear-attention kernels (chunked
forward and backward, the recurrent step) over shapes, configs, states and folds.

    python tests/engine/kernel_corpus.py            # compare with kernel_hashes.json
    python tests/engine/kernel_corpus.py --write    # record new hashes (only on purpose)

Generating TileLang source needs no nvcc and no GPU: the whole corpus takes seconds.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

HASHES = Path(__file__).with_name("kernel_hashes.json")

SHAPES = {
    "mha-1000": dict(batch=2, heads_q=8, heads_kv=8, seqlen_q=1000, seqlen_kv=1000,
                     head_dim=128, head_dim_v=128),
    "gqa-1000": dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_kv=1000,
                     head_dim=128, head_dim_v=128),
    # 32 key blocks x 8 kv heads x 2 batches: enough thread blocks for the heads walk.
    "gqa-4096": dict(batch=2, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_kv=4096,
                     head_dim=128, head_dim_v=128),
    "d64-cross": dict(batch=1, heads_q=4, heads_kv=4, seqlen_q=512, seqlen_kv=2048,
                      head_dim=64, head_dim_v=64),
    # D 64 at a length where the backward's default steps are 128 query rows (the finals and
    # Delta read from the ring; attention_bwd/plan.py: WIDE_STEP_MIN_SQ), keys and queries
    # equal (d64-cross: more keys).
    "d64-1024": dict(batch=1, heads_q=4, heads_kv=4, seqlen_q=1024, seqlen_kv=1024,
                     head_dim=64, head_dim_v=64),
    # D 64 at a length where the forward's default tile is 192 rows on three consumer
    # warpgroups (attention_fwd/plan.py: wide_tile); forward sources only (FORWARD_ONLY).
    "d64-4096": dict(batch=1, heads_q=2, heads_kv=2, seqlen_q=4096, seqlen_kv=4096,
                     head_dim=64, head_dim_v=64),
    "d256": dict(batch=1, heads_q=4, heads_kv=1, seqlen_q=1024, seqlen_kv=1024,
                 head_dim=256, head_dim_v=256),
    "dv64": dict(batch=1, heads_q=4, heads_kv=4, seqlen_q=777, seqlen_kv=777,
                 head_dim=128, head_dim_v=64),
    # ViT's rows: keys in one fitted block (208) without the loop over later blocks; 768
    # kv blocks, so the unmasked default backward walks them persistently (attention_bwd/
    # plan.py: persistent_default).
    "vit": dict(batch=64, heads_q=6, heads_kv=6, seqlen_q=197, seqlen_kv=197,
                head_dim=64, head_dim_v=64),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (shape, dtype, every config or the first three): the tuner-space configs on the GQA shapes,
# the others at the default config and two more.
PROBLEMS = [("mha-1000", "bf16", False), ("gqa-1000", "bf16", True), ("gqa-4096", "bf16", True),
            ("d64-cross", "bf16", False), ("d64-1024", "bf16", False), ("d64-4096", "bf16", False),
            ("d256", "bf16", False), ("dv64", "bf16", False), ("gqa-1000", "fp16", False),
            ("vit", "bf16", False)]
FORWARD_ONLY = {"d64-4096"}

# KernelConfig fields: block_M, block_N, num_stages, threads, gemm_policy, swizzle_panel,
# schedule.
FWD_CONFIGS = [
    None,  # the engine's default
    (128, 128, 2, 256, "FullRow", 0),
    (128, 64, 2, 256, "FullRow", 0),
    (64, 64, 2, 128, "FullRow", 0),
    (192, 128, 2, 384, "FullRow", 0),
    (128, 128, 3, 256, "Square", 8),
    (64, 32, 1, 128, "FullRow", 0),
    (128, 128, 2, 256, "FullRow", 0, "pingpong"),
    (128, 176, 3, 256, "FullRow", 0, "overlap"),
]
BWD_CONFIGS = [
    None,
    (32, 128, 2, 256, "FullRow", 0),
    (64, 128, 2, 256, "FullRow", 0),
    (32, 64, 2, 128, "FullRow", 0),
    (64, 64, 3, 128, "Square", 8),
    (16, 64, 1, 128, "FullRow", 0),
    (128, 128, 1, 256, "FullRow", 0),
]
REFUSALS = (NotImplementedError, ValueError)
# Decode (kind attention_decode): shapes with Sq new tokens against a cache of seqlen_kv, each
# contiguous and paged (pages of 64 keys: one TMA copy per block; of 16: gathered), at the
# default config (splits chosen for an H100's 132 SMs) and two fixed ones (block_N,
# num_stages, num_splits; 1 split: no merge kernel).
DECODE_SHAPES = {
    "dec-gqa4": dict(batch=3, heads_q=8, heads_kv=2, seqlen_q=2, seqlen_kv=1024, head_dim=128,
                     head_dim_v=128),
    "dec-gqa8-d256": dict(batch=1, heads_q=16, heads_kv=2, seqlen_q=1, seqlen_kv=4096,
                          head_dim=256, head_dim_v=256),
}
DECODE_CONFIGS = [None, (64, 2, 8), (128, 1, 1)]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]  # 64 bits: plenty to see a change


def _cfg(fields):
    from engine.plan.config import KernelConfig

    return None if fields is None else KernelConfig(*fields)


def _cfg_tag(fields) -> str:
    return "default" if fields is None else _cfg(fields).key()


def _extra_specs() -> dict:
    """Specs outside the library: a custom read indexed by the query alone (held in per-query
    vectors, rings in the warp-specialised schedule) and one indexed by the key alone."""
    from engine import CustomIO

    return {
        "qbias": (CustomIO({"qbias": ("batch", "heads", "seq_len")}),
                  lambda s, io, b, h, qi, ki: s * 0.125 + io["qbias"]),
        "kvbias": (CustomIO({"kvbias": ("batch", "seq_len_kv")}),
                   lambda s, io, b, h, qi, ki: s * 0.125 + io["kvbias"]),
    }


def _module(name: str, shape: dict, dtype: torch.dtype):
    from engine import AttentionEngine, meta_tensor
    from engine.variants import VARIANTS

    if name in VARIANTS:
        return VARIANTS[name].build(**shape, dtype=dtype, backend="tilelang")
    io, score_mod = _extra_specs()[name]
    meta = (meta_tensor(shape["batch"], shape["heads_q"], shape["seqlen_q"], shape["head_dim"],
                        dtype=dtype),
            meta_tensor(shape["batch"], shape["heads_kv"], shape["seqlen_kv"],
                        shape["head_dim"], dtype=dtype),
            meta_tensor(shape["batch"], shape["heads_kv"], shape["seqlen_kv"],
                        shape["head_dim_v"], dtype=dtype))
    return AttentionEngine(meta, io, score_mod=score_mod, backend="tilelang")


def _learnable(name: str) -> tuple[str, ...]:
    from engine.variants import VARIANTS

    if name in VARIANTS:
        return tuple(VARIANTS[name].learnable)
    return (name,) if name == "kvbias" else ()


def _forward_sources(mod, cfg_fields, dynamic: bool) -> dict[str, str]:
    mod.config = _cfg(cfg_fields)
    mod.dynamic_shapes = dynamic
    return {"main": mod.kernel_source}


def _backward_sources(mod, cfg_fields, deterministic: bool, grads: tuple[str, ...],
                      automatic: bool) -> dict[str, str]:
    """The backward's kernels by role; `automatic` forces TileLang's automatic pipeline."""
    cfg = _cfg(cfg_fields)
    bk = mod.backward_kernels(config=cfg, custom_grads=grads, deterministic=deterministic)
    if automatic:
        from engine.kernels.attention_bwd.launch import build_backward
        from engine.plan.shape import KernelShape

        auto = build_backward(mod.spec, KernelShape.of(mod), bk.config, grads,
                              warp_specialized=False)
        return {"main": auto.main.source}
    roles = {"main": bk.main, "preprocess": bk.preprocess, "dq": bk.dq, "post": bk.post}
    return {r: k.source for r, k in roles.items() if k is not None}


def _cases() -> Iterator[tuple[str, object]]:
    """(case key, thunk giving {role: source}) over the whole corpus."""
    from engine.variants import VARIANTS

    names = [*VARIANTS, *_extra_specs()]
    for name in names:
        for shape_name, dt, every in PROBLEMS:
            shape = SHAPES[shape_name]
            if name in VARIANTS and VARIANTS[name].supports(
                    head_dim=shape["head_dim"], head_dim_v=shape["head_dim_v"],
                    heads_q=shape["heads_q"], heads_kv=shape["heads_kv"],
                    seqlen_q=shape["seqlen_q"], seqlen_kv=shape["seqlen_kv"]):
                continue
            base = f"{name}|{shape_name}|{dt}"
            make = lambda shape=shape, dt=dt, name=name: _module(name, shape, DTYPES[dt])  # noqa: E731
            for cfg in FWD_CONFIGS if every else FWD_CONFIGS[:3]:
                for dynamic in (False, True):
                    key = f"{base}|fwd|{_cfg_tag(cfg)}|{'dynamic' if dynamic else 'static'}"
                    yield key, (lambda m=make, c=cfg, d=dynamic: _forward_sources(m(), c, d))
            if shape_name in FORWARD_ONLY:
                continue
            grads_options = [()] + ([_learnable(name)] if _learnable(name) else [])
            for cfg in BWD_CONFIGS if every else BWD_CONFIGS[:3]:
                for det in (False, True):
                    for grads in grads_options:
                        key = (f"{base}|bwd|{_cfg_tag(cfg)}|{'det' if det else 'fast'}"
                               f"|grads={','.join(grads)}")
                        yield key, (lambda m=make, c=cfg, d=det, g=grads:
                                    _backward_sources(m(), c, d, g, False))
            yield f"{base}|bwd|default|fast|automatic", (
                lambda m=make: _backward_sources(m(), None, False, (), True))


def _decode_sources(name: str, shape: dict, page: int, cfg_fields) -> dict[str, str]:
    from engine.kernels.attention_decode.plan import DecodeConfig

    mod = _module(name, shape, torch.bfloat16)
    mod.decode_config = None if cfg_fields is None else DecodeConfig(*cfg_fields)
    dk = mod.decode_kernels(page, 3 * shape["seqlen_kv"] // page if page else 0)
    return {"split": dk.split.source, **({"merge": dk.merge.source} if dk.merge else {})}


def _decode_cases() -> Iterator[tuple[str, object]]:
    from engine.variants import VARIANTS

    for name in [*VARIANTS, *_extra_specs()]:
        for shape_name, shape in DECODE_SHAPES.items():
            if name in VARIANTS and VARIANTS[name].needs_equal_seqlens:
                continue
            for page in (0, 64, 16):
                for cfg in DECODE_CONFIGS:
                    tag = "default" if cfg is None else "_".join(map(str, cfg))
                    yield (f"{name}|{shape_name}|bf16|decode|p{page}|{tag}",
                           lambda n=name, s=shape, p=page, c=cfg: _decode_sources(n, s, p, c))


# Linear attention (kinds linear_fwd, linear_bwd, linear_step): the kernels take the core
# problem, so shapes, configs, states and folds make the cases, not variants. (HQ, HK, H, T, D,
# Dv, packed sequences: cu_seqlens ends, else None) at the default config (config_for_shape)
# and three fixed ones (chunk, block_K, block_V, num_stages, threads, single_pass).
LINEAR_SHAPES = {
    "lin-mha": (4, 4, 4, 200, 128, 128, None),
    "lin-shared": (1, 1, 4, 200, 128, 64, None),  # Mamba2's one q/k head
    "lin-d256": (4, 4, 4, 300, 256, 512, None),
    "lin-packed": (4, 4, 4, 300, 64, 64, (0, 37, 150, 300)),
}
LINEAR_CONFIGS = [None, (128, 64, 64, 2, 256, False), (64, 64, 64, 2, 256, True),
                  (64, 64, 32, 3, 128, False)]


def _linear_meta(shape: tuple, seqlen: int | None = None) -> tuple:
    hq, hk, h, t, d, dv, ends = shape
    b = 1 if ends else 2
    t = seqlen or t
    return tuple(torch.empty(b, n, t, dim, dtype=torch.bfloat16, device="meta")
                 for n, dim in ((hq, d), (hk, d), (h, dv)))


def _linear_sources(shape: tuple, cfg_fields, folds, states: bool) -> dict[str, str]:
    from engine.kernels.linear_fwd.plan import NO_FOLDS, LinearConfig
    from engine.runtime import linear_backend

    ends = shape[-1]
    cu = None if ends is None else torch.tensor(ends, dtype=torch.int32)
    cfg = None if cfg_fields is None else LinearConfig(*cfg_fields)
    cache = linear_backend.LinearKernelCache()  # shared: the second call builds only its dQ/dK
    srcs = linear_backend.kernel_sources(
        cache, *_linear_meta(shape), config=cfg, modes=("fwd", "bwd"), initial_state=states,
        final_state=states, cu_seqlens=cu, folds=folds)
    out = {str(i): src for i, src in enumerate(srcs)}
    saved = linear_backend.kernel_sources(  # the single pass keeping its states, where run
        cache, *_linear_meta(shape), config=cfg, modes=("fwd", "bwd"), initial_state=states,
        final_state=states, cu_seqlens=cu, folds=folds, save_states=True)
    out |= {f"saved-{i}": src for i, src in enumerate(saved) if src not in srcs}
    if not states and folds == NO_FOLDS:  # the dQ/dK kernel of a decay with no gradient
        out["dqk-no-dg"] = linear_backend.kernel_sources(
            cache, *_linear_meta(shape), config=cfg, modes=("fwd", "bwd"), cu_seqlens=cu,
            decay_grad=False)[-1]
    return out


def _step_sources(shape: tuple, folds, initial: bool) -> dict[str, str]:
    from engine.runtime import linear_backend

    step_shape = linear_backend.linear_shape(*_linear_meta(shape, seqlen=2), None)
    step = linear_backend.LinearKernelCache().step(step_shape, folds=folds)
    return {"step": step.sources(initial)[0]}


def _linear_cases() -> Iterator[tuple[str, object]]:
    from engine.kernels.linear_fwd.plan import NO_FOLDS, Folds

    folds_options = {"plain": NO_FOLDS, "folded": Folds(q_scale=0.37, v_weight=True)}
    for name, shape in LINEAR_SHAPES.items():
        for (ftag, folds), states in itertools.product(folds_options.items(), (False, True)):
            for cfg in LINEAR_CONFIGS:
                tag = "default" if cfg is None else "_".join(map(str, cfg))
                yield (f"{name}|bf16|linear|{tag}|{ftag}|states={int(states)}",
                       lambda s=shape, c=cfg, f=folds, st=states: _linear_sources(s, c, f, st))
            if shape[-1] is None:
                yield (f"{name}|bf16|linear_step|{ftag}|h0={int(states)}",
                       lambda s=shape, f=folds, st=states: _step_sources(s, f, st))


def cases() -> Iterator[tuple[str, object]]:
    """(case key, thunk returning {role: source}) for every case: prefill, decode, linear."""
    return itertools.chain(_cases(), _decode_cases(), _linear_cases())


def corpus_hashes() -> dict[str, str]:
    """{case key | role: sha256 of the source (its first 16 hex digits), or "refused:<exception type>"}."""
    out: dict[str, str] = {}
    for key, thunk in cases():
        try:
            sources = thunk()
        except REFUSALS as exc:
            out[f"{key}|refused"] = f"refused:{type(exc).__name__}"
            continue
        for role, src in sources.items():
            out[f"{key}|{role}"] = _digest(src)
    return out


def differences(want: dict[str, str], got: dict[str, str]) -> list[str]:
    keys = sorted(set(want) | set(got))
    return [f"{k}: {want.get(k, 'absent')} -> {got.get(k, 'absent')}"
            for k in keys if want.get(k) != got.get(k)]


def main(argv: list[str]) -> int:
    got = corpus_hashes()
    if "--write" in argv:
        HASHES.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
        print(f"wrote {len(got)} hashes to {HASHES}")
        return 0
    diff = differences(json.loads(HASHES.read_text()), got)
    for line in diff[:50]:
        print(line)
    print(f"{len(got)} sources, {len(diff)} differ")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main(sys.argv[1:]))
