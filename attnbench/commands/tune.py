"""`attnbench tune`: search kernel configs with Optuna and write the best to tune files."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path

MODES = ("fwd", "bwd", "both", "decode", "linear")
KERNEL_DTYPES = ("bf16", "fp16")  # what the engine's kernels (and so the tuner) take


def studies_of(mode: str) -> list[tuple[str, str]]:
    """(problem family, kernel mode) of each kind `--mode` tunes: fwd and bwd the attention
    kinds, both the two, decode the decode kind, linear the two linear kinds (an inference
    call's forward, a training step's forward and backward); a kind's name (linear_bwd) that
    kind."""
    from engine.kernels.registry import KINDS

    if mode in KINDS:
        return [(KINDS[mode].family, KINDS[mode].mode)]
    if mode in ("both", "linear"):
        family = "attention" if mode == "both" else "linear"
        return [(family, "fwd"), (family, "bwd")]
    return [("decode", "fwd")] if mode == "decode" else [("attention", mode)]


def _mode(text: str) -> str:
    from engine.kernels.registry import KINDS

    if text not in MODES and text not in KINDS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected one of {', '.join(MODES)} or a kernel kind "
            f"({', '.join(sorted(KINDS))})")
    return text


def parse_seqlens(text: str) -> list[int]:
    """'2k,4k,8192' -> [2048, 4096, 8192]."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", part)
        if not m or int(m.group(1)) <= 0:
            raise argparse.ArgumentTypeError(f"{part!r} is not a positive length like 4096 or 4k")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return out


def parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        gpus = []
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct indices like 0,1,2")
    return gpus


def parse_dtype(text: str) -> str:
    """'bf16' or 'bfloat16' -> 'bf16'; 'fp16' or 'float16' -> 'fp16' (the kernels' dtypes)."""
    from attnbench.dtypes import short_dtype_name

    try:
        name = short_dtype_name(text)
    except ValueError:
        name = None
    if name not in KERNEL_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected bf16 or fp16 (also spelled bfloat16, float16): the engine's "
            "kernels are half precision")
    return name


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive {kind.__name__}")
        return v

    return parse


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an int >= 0")
    return v


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune",
        help="tune kernel configs per shape (Optuna) and write tune files",
        description="Search the kernel configs of a template for each shape with Optuna (one "
        "study per template, spec hash, shape, dtype, mode, GPU and TileLang version) and write "
        "the best to results/tune/<gpu>/<template>.json, which the engine loads.",
    )
    p.add_argument("--shape", help="shape preset (attnbench/data/shapes.toml), e.g. llama3-8b")
    p.add_argument("--suite", help="tune the engine's cases of a suite (name or path): each "
                   "half-precision case's variant, shape, length and dtype, one study each")
    p.add_argument("--filter", action="append", default=[], metavar="PATTERN",
                   help="with --suite: only cases whose name matches (substring or glob)")
    p.add_argument("--heads-q", type=_positive(int), help="query heads (overrides the preset)")
    p.add_argument("--heads-kv", type=_positive(int), help="key/value heads")
    p.add_argument("--head-dim", type=_positive(int), help="head dim of q and k")
    p.add_argument("--head-dim-v", type=_positive(int), help="head dim of v (default: head dim)")
    p.add_argument("--variant", help="attention variant (default softmax)")
    p.add_argument("--seqlens", type=parse_seqlens,
                   help="sequence lengths, one study each (default 2k,4k,8k,16k; --mode decode: "
                   "the KV cache's capacity, default 4k,32k,128k; --mode linear: default "
                   "2k,4k,8k)")
    p.add_argument("--batch", type=_positive(int),
                   help="batch size (default: 16k tokens per batch, i.e. 16384 // seqlen)")
    p.add_argument("--dtype", type=parse_dtype,
                   help="bf16 (default) or fp16; bfloat16 and float16 are accepted too")
    p.add_argument("--mode", default="fwd", type=_mode, metavar="{" + ",".join(MODES) + "}",
                   help="fwd times the forward; bwd times forward+backward; both tunes the two; "
                   "decode the decode kernels on a KV cache (suite cases of kind decode); "
                   "linear the linear-attention forward and forward+backward (suite cases of "
                   "kind linear, or --shape's linear reading); a kernel kind's name "
                   "(attention_decode, linear_fwd, linear_bwd) tunes that kind")
    p.add_argument("--new-tokens", type=_positive(int),
                   help="--mode decode: new query tokens per sequence (default 1)")
    p.add_argument("--page-size", type=_non_negative_int,
                   help="--mode decode: the paged cache's page size (default 0: contiguous)")
    p.add_argument("--ragged", action="store_const", const=True,
                   help="--mode decode: seeded valid lengths between the new tokens and the "
                   "capacity (default: every sequence full)")
    p.add_argument("--trials", type=_positive(int), default=64,
                   help="evaluated trials each study should reach (resumes count; default 64)")
    p.add_argument("--timeout", type=_positive(float), help="wall-clock limit in seconds")
    p.add_argument("--storage", help="Optuna storage URL (default sqlite:///results/tune/"
                   "studies.db; postgresql+psycopg://... to share a study between hosts)")
    p.add_argument("--gpus", type=parse_gpus, default=[0], help="GPU indices, one worker each")
    p.add_argument("--tune-file", type=Path,
                   help="tune file to update (default results/tune/<gpu>/<template>.json)")
    p.add_argument("--no-tune-file", action="store_true", help="do not write the tune file")
    search = p.add_mutually_exclusive_group()
    search.add_argument("--grid", action="store_true",
                        help="evaluate every valid config of the search space once")
    search.add_argument("--tpe", action="store_true",
                        help="sample --trials configs with Optuna even where the space is small "
                        "enough to be evaluated whole (its [search] exhaustive_max_valid)")
    search.add_argument("--compare-grid", action="store_true",
                        help="run the grid and a fresh Optuna study with 30%% of its trials; "
                        "write and print the comparison (results/tune/<gpu>/compare-*.json). "
                        "Under --timeout the grid gets 70%% of the time and Optuna the rest; "
                        "an interrupted comparison is still written, marked incomplete")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    p.add_argument("--compile-jobs", type=_non_negative_int, default=0,
                   help="parallel compiles (0: all cores)")
    p.add_argument("--compile-timeout", type=_positive(float), default=900.0,
                   help="seconds per compile before the trial fails (default 900)")
    p.add_argument("--bench-timeout", type=_positive(float), default=180.0,
                   help="seconds per benchmark before the trial fails and its worker is "
                   "replaced (default 180)")
    p.add_argument("--confirm-rounds", type=_positive(int), default=4,
                   help="A/B rounds that time the winner against the engine's current config "
                   "before a tune-file entry is written (default 4)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.add_argument("--json-out", type=Path, help="also write the study summaries as JSON here")
    p.add_argument("--objective", default="engine", choices=("engine", "fake"),
                   help="engine: build and time the real kernel (GPU); fake: a deterministic "
                   "synthetic latency that exercises the tuner without a GPU")
    p.add_argument("--fake-options", type=json.loads, default={},
                   help=argparse.SUPPRESS)  # JSON of FakeObjective fields, for tests
    p.set_defaults(func=run)
    return p


def _geometry(args) -> dict[str, int]:
    geo: dict[str, int | None] = {"heads_q": None, "heads_kv": None, "head_dim": None,
                                  "head_dim_v": None}
    if args.shape:
        from attnbench.shapes import get_shape

        try:
            preset = get_shape(args.shape)
        except ValueError as exc:
            raise ValueError(f"--shape: {exc}") from None
        geo = {k: getattr(preset, k) for k in geo}
    for k in geo:
        if getattr(args, k) is not None:
            geo[k] = getattr(args, k)
    if geo["head_dim_v"] is None:
        geo["head_dim_v"] = geo["head_dim"]
    if geo["heads_kv"] is None:
        geo["heads_kv"] = geo["heads_q"]
    missing = [k for k in ("heads_q", "head_dim") if geo[k] is None]
    if missing:
        raise ValueError(
            f"--shape or --{'/--'.join(m.replace('_', '-') for m in missing)}: the head geometry "
            "is needed (e.g. --shape llama3-8b)"
        )
    if geo["heads_q"] % geo["heads_kv"]:
        raise ValueError(f"--heads-q {geo['heads_q']} / --heads-kv {geo['heads_kv']}: the query "
                         "heads must be a multiple of the key/value heads")
    return geo  # type: ignore[return-value]


# Arguments that choose problems by hand, which --suite replaces; those only decode takes.
_BY_HAND = ("shape", "heads_q", "heads_kv", "head_dim", "head_dim_v", "variant", "seqlens",
            "batch", "dtype", "new_tokens", "page_size", "ragged")
_DECODE_ONLY = ("new_tokens", "page_size", "ragged")


def _problems(args, family: str, mode: str) -> list:
    """The problems of `family` to tune in `mode`: from --suite, or from the shape arguments."""
    from attnbench.tune.problem import Problem

    if args.suite:
        given = [f"--{a.replace('_', '-')}" for a in _BY_HAND if getattr(args, a) is not None]
        if given:
            raise ValueError(f"--suite takes variants, shapes, lengths and dtypes from the suite; "
                             f"drop {', '.join(given)}")
        from attnbench.dtypes import short_dtype_name
        from attnbench.suites import load_suite

        try:
            cases = load_suite(args.suite).filtered(args.filter).cases
        except ValueError as exc:
            raise ValueError(f"--suite: {exc}") from None
        out = []
        for c in cases:
            dtype = short_dtype_name(c.dtype)
            engine = any(i in c.impls for i in ("engine", "engine-dynamic"))
            if not engine or c.kind != family or dtype not in KERNEL_DTYPES:
                continue
            prob = Problem(variant=c.variant, **c.sizes(), dtype=dtype, mode=mode, family=family,
                           **_family_fields(c, family))
            if prob not in out:
                out.append(prob)
        if not out:
            raise ValueError(f"--suite {args.suite}: no half-precision engine case of kind "
                             f"{family!r} to tune (--mode {args.mode})")
        return out
    if args.filter:
        raise ValueError("--filter selects cases of --suite")
    if family == "linear":
        return _linear_problems(args, mode)
    geo = _geometry(args)
    if family != "decode":
        given = [f"--{a.replace('_', '-')}" for a in _DECODE_ONLY if getattr(args, a) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: KV-cache options of --mode decode")
        return [
            Problem(variant=args.variant or "softmax", batch=args.batch or max(1, 16384 // seqlen),
                    seqlen_q=seqlen, seqlen_kv=seqlen, dtype=args.dtype or "bf16", mode=mode,
                    **geo)
            for seqlen in (args.seqlens or parse_seqlens("2k,4k,8k,16k"))
        ]
    caps = args.seqlens or parse_seqlens("4k,32k,128k")
    page = args.page_size or 0
    if page and any(cap % page for cap in caps):
        raise ValueError(f"--page-size {page}: expected a divisor of every capacity (--seqlens "
                         f"{','.join(map(str, caps))})")
    return [
        Problem(variant=args.variant or "softmax", batch=args.batch or max(1, 16384 // cap),
                seqlen_q=args.new_tokens or 1, seqlen_kv=cap, dtype=args.dtype or "bf16",
                mode=mode, family=family, ragged=bool(args.ragged), page_size=page, **geo)
        for cap in caps
    ]


def _family_fields(case, family: str) -> dict:
    """The Problem fields a suite case of `family` adds to its sizes."""
    if family == "decode":
        return {"ragged": case.ragged, "page_size": case.page_size}
    return {"heads": case.heads} if family == "linear" else {}


def _linear_problems(args, mode: str) -> list:
    """Linear problems by hand: --shape read as linear attention (its q, k and value heads and
    head dims; --heads-q, --heads-kv (k's heads), --head-dim, --head-dim-v override them), one
    per --seqlens length."""
    from attnbench.shapes import get_shape
    from attnbench.tune.problem import Problem

    given = [f"--{a.replace('_', '-')}" for a in _DECODE_ONLY if getattr(args, a) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: KV-cache options of --mode decode")
    if not args.shape:
        raise ValueError("--shape: a linear study reads its heads and head dims from a shape "
                         "preset (e.g. --shape mamba2-2.7b), or give --suite linear")
    try:
        lin = get_shape(args.shape).linear_sizes()
    except ValueError as exc:
        raise ValueError(f"--shape: {exc}") from None
    for flag, key in (("heads_q", "heads_q"), ("heads_kv", "heads_k"), ("head_dim", "head_dim"),
                      ("head_dim_v", "head_dim_v")):
        if getattr(args, flag) is not None:
            lin[key] = getattr(args, flag)
    return [
        Problem(variant=args.variant or "simple_gla", batch=args.batch or max(1, 16384 // t),
                heads_q=lin["heads_q"], heads_kv=lin["heads_k"], heads=lin["heads"],
                seqlen_q=t, seqlen_kv=t, head_dim=lin["head_dim"], head_dim_v=lin["head_dim_v"],
                dtype=args.dtype or "bf16", mode=mode, family="linear")
        for t in (args.seqlens or parse_seqlens("2k,4k,8k"))
    ]


def run(args) -> int:
    try:
        work = _checked_work(args)
    except ValueError as exc:  # a bad argument: one line, before any study or file is written
        print(f"attnbench tune: {exc}", file=sys.stderr)
        return 2
    from attnbench.tune.compare import compare_grid, format_record
    from attnbench.tune.runner import StudyInterrupted, TuneOptions, run_study

    deadline = time.monotonic() + args.timeout if args.timeout else None
    summaries: list[dict] = []
    status = 0
    for objective, space in work:
        left = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                print("attnbench tune: --timeout reached", file=sys.stderr)
                break
        opts = TuneOptions(
            trials=args.trials, timeout_s=left, storage=args.storage,
            devices=tuple(args.gpus), compile_jobs=args.compile_jobs,
            compile_timeout_s=args.compile_timeout, bench_timeout_s=args.bench_timeout,
            seed=args.seed, search="grid" if args.grid else "tpe" if args.tpe else "auto",
            tune_file=args.tune_file, write_tune_file=not args.no_tune_file,
            progress=not args.no_progress, confirm_rounds=args.confirm_rounds,
        )
        if args.compare_grid:
            rec = compare_grid(objective, space, opts)
            print(format_record(rec))
            print(f"comparison written to {rec['path']}")
            summaries.append(rec)
            continue
        try:
            res = run_study(objective, space, opts)
        except StudyInterrupted as exc:  # Ctrl-C: the best so far was written; stop here
            res, status = exc.result, 130
        summaries.append(dataclasses.asdict(res))
        _print_result(res)
        if status:
            print("attnbench tune: interrupted", file=sys.stderr)
            break
    if args.json_out:
        from engine.tuning.tune_file import atomic_write_json

        atomic_write_json(args.json_out, summaries)
    return status


def _print_result(res) -> None:
    rate = (f"{res.best_tbps:.2f} TB/s" if res.best_tbps is not None
            else f"{res.best_tflops:.0f} TFLOP/s" if res.best_tflops is not None else "")
    best = (f"{res.best_latency_ms:.4g} ms, {rate}, {res.best_config}"
            if res.best_latency_ms is not None else "none")
    print(f"{res.study_name}: {res.evaluated}/{res.target} trials "
          f"({res.failed} failed{', exhaustive' if res.exhaustive else ''}); best {best}"
          + (f"; default {res.baseline_latency_ms:.4g} ms"
             if res.baseline_latency_ms is not None else ""))
    if res.tune_file_note:
        print(f"  {res.tune_file_note}")


def _checked_work(args) -> list[tuple]:
    """(objective, search space) per study, after every argument check (ValueError: one line
    naming the argument). Nothing is measured or written before this returns."""
    from attnbench.tune.space import load_space
    from attnbench.tune.storage import check_storage_url, default_storage_url, file_problem

    try:  # the cheap checks first
        check_storage_url(args.storage or default_storage_url())
    except ValueError as exc:
        raise ValueError(f"--storage: {exc}") from None
    for flag, path in (("--tune-file", args.tune_file), ("--json-out", args.json_out)):
        problem = file_problem(path) if path is not None else None
        if problem:
            raise ValueError(f"{flag}: cannot write {path}: {problem}")
    studies = studies_of(args.mode)
    if ("attention", "bwd") in studies and args.objective == "engine":
        from engine import kernel_backward_enabled

        if not kernel_backward_enabled():
            raise ValueError("--mode bwd tunes the backward kernels, which are off; unset "
                             "ATTNBENCH_KERNEL_BACKWARD=0")
    problems = [p for family, mode in studies for p in _problems(args, family, mode)]
    _check_variants(args, problems)
    work = []
    for p in problems:
        space = load_space(p.template)
        if not space.valid_configs(p.head_dim, p.head_dim_v, p.elem_bytes, **p.validity_args()):
            raise ValueError(f"--head-dim/--head-dim-v: no config of {space.source} is valid for "
                             f"D={p.head_dim}, Dv={p.head_dim_v}, dtype {p.dtype} ({p.mode})")
        work.append((_objective(args, p), space))
    if args.objective == "engine":
        _check_gpus(args.gpus)
    return work


def _check_variants(args, problems) -> None:
    from engine.variants import get_variant
    from engine.variants.linear import get_linear_variant

    for name, linear in dict.fromkeys((p.variant, p.linear) for p in problems):
        try:
            (get_linear_variant if linear else get_variant)(name)
        except ValueError as exc:
            flag = "--suite" if args.suite else "--variant"
            raise ValueError(f"{flag}: {exc}") from None


def _check_gpus(gpus: list[int]) -> None:
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise ValueError("no CUDA GPU found: --objective engine (the default) builds and times "
                         "kernels on a GPU; --objective fake runs the tuner without one")
    missing = [g for g in gpus if g >= n]
    if missing:
        raise ValueError(f"--gpus: no GPU {missing} on this machine (it has {n}: 0..{n - 1})")


def _objective(args, problem):
    if args.objective == "fake":
        import inspect

        from attnbench.tune.objective import FakeObjective

        opts = {k: tuple(v) if isinstance(v, list) else v for k, v in args.fake_options.items()}
        try:
            inspect.signature(FakeObjective).bind(problem, **opts)
        except TypeError as exc:
            raise ValueError(f"--fake-options: {exc}") from None
        return FakeObjective(problem=problem, **opts)
    if problem.linear:
        from attnbench.tune.linear_objective import LinearObjective

        return LinearObjective(problem=problem, seed=args.seed)
    if problem.decode:
        from attnbench.tune.decode_objective import DecodeObjective

        return DecodeObjective(problem=problem, seed=args.seed)
    from attnbench.tune.engine_objective import EngineObjective

    return EngineObjective(problem=problem, seed=args.seed)
