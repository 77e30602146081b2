"""Benchmark suites: data files in `suites/` (TOML, or YAML with the same structure).

A suite file has top-level defaults and a list of case blocks; every key a case block may have
can also be given at the top level as its default::

    name = "smoke"                      # optional; defaults to the file name
    description = "..."
    repeats = 30                        # timed repetitions per measurement (>= 1)
    warmup = 3                          # untimed calls before timing
    noise_threshold = 0.05              # re-measure above this spread / median (optional)
    impls = ["reference", "sdpa-math"]  # implementations to run (registry names)
    baseline = "reference"              # the one implementation speedups are relative to
    modes = ["fwd", "bwd"]              # any of fwd, bwd, fwd+bwd
    dtypes = ["float16"]                # float16 | bfloat16 | float32 (fp16/bf16/fp32 accepted)
    kind = "attention"                  # attention | linear | decode

    [[cases]]
    variants = ["softmax", "softmax_causal"]   # engine variant names
    shapes = ["llama3-8b"]                     # presets from attnbench/data/shapes.toml
    seqlens = [1024, 4096]                     # seqlen_q = seqlen_kv; or give seqlen_q and
                                               # seqlen_kv lists (their product is taken)
    batch = [1, 4]                             # or tokens = 16384: batch = tokens // seqlen_q

Decode cases (kind = "decode", see attnbench.decode) read seqlen_q as the new tokens per
sequence and seqlen_kv as the cache capacity, time the forward only, and take two more keys::

    ragged = true        # valid lengths drawn per sequence in [seqlen_q, capacity] (both ends
                         # present when batch >= 2); false (default): every length = capacity
    page_size = 256      # paged cache of 256-token pages; 0 (default): contiguous. Must divide
                         # seqlen_kv. Both also take lists (their product is taken).

Linear cases (kind = "linear", see attnbench.linear) name variants of the linear-attention
library (engine.variants.linear) and read a shape as linear attention (the preset's
`linear_sizes()`: q heads, k heads, value heads, q/k and value head dims); `seqlens` gives the
sequence length T. A continuation (generation: a few new positions after a state; or a prefill
in pieces) gives `seqlen_q` (the call's positions) below `seqlen_kv` (the sequence's length
after the call, the positions before it making the state) and times the forward only.

A block expands to variants x shapes x seqlens x batch x dtypes (x ragged x page_size) cases;
modes and impls are per case (one result row per case x impl x mode). Validation collects every
problem and raises one `SuiteError` that names the bad key and lists the known names.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import itertools
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from attnbench.cases import Case
from attnbench.dtypes import ALIASES, dtype_name
from attnbench.resources import data_dir
from attnbench.results.schema import MODES
from attnbench.shapes import ShapePreset, load_shapes

SUITES_DIR = data_dir("suites")  # the checkout's suites/, or the wheel's copy
KINDS = ("attention", "linear", "decode")
DTYPE_ALIASES = ALIASES  # float16/fp16/half, bfloat16/bf16, float32/fp32/float (attnbench.dtypes)
CASE_KEYS = {
    "name", "variants", "shapes", "seqlens", "seqlen_q", "seqlen_kv", "batch", "tokens",
    "dtypes", "modes", "impls", "baseline", "kind", "ragged", "page_size",
}
DECODE_KEYS = ("ragged", "page_size")  # decode cases only
SUITE_KEYS = CASE_KEYS | {"description", "repeats", "warmup", "noise_threshold", "cases"}


class SuiteError(ValueError):
    """A suite file that cannot be run; the message lists every problem found."""


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    path: str
    repeats: int
    warmup: int
    cases: tuple[Case, ...]
    noise_threshold: float | None = None  # None: the runner's default

    def filtered(self, patterns: Sequence[str] = ()) -> Suite:
        """The cases whose name contains, or glob-matches, any of `patterns` (all if none)."""
        cases = [c for c in self.cases if not patterns or any(match(c.name, p) for p in patterns)]
        return replace(self, cases=tuple(cases))


def match(name: str, pattern: str) -> bool:
    """Substring match, or glob match when the pattern has glob characters."""
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


def resolve_suite_path(name_or_path: str, suites_dir: Path = SUITES_DIR) -> Path:
    """A path to an existing file, or the name of a suite in `suites/`."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    for ext in (".toml", ".yaml", ".yml"):
        cand = suites_dir / f"{name_or_path}{ext}"
        if cand.is_file():
            return cand
    known = sorted({f.stem for f in suites_dir.glob("*") if f.suffix in (".toml", ".yaml", ".yml")})
    raise SuiteError(
        f"suite {name_or_path!r} is neither a file nor a suite in {suites_dir}; "
        f"known suites: {', '.join(known) or '(none)'}"
    )


def read_suite_data(path: Path) -> dict:
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml  # lazy: YAML suites are optional

            with open(path) as f:
                try:
                    data = yaml.safe_load(f)
                except yaml.YAMLError as exc:
                    raise SuiteError(f"{path}: not valid YAML: {' '.join(str(exc).split())}"
                                     ) from exc
        else:
            with open(path, "rb") as f:
                try:
                    data = tomllib.load(f)
                except tomllib.TOMLDecodeError as exc:
                    raise SuiteError(f"{path}: not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SuiteError(f"{path}: cannot read the suite file: {exc}") from exc
    if not isinstance(data, dict):
        raise SuiteError(f"{path}: expected a table at the top level")
    return data


def known_variant_names(kind: str = "attention") -> list[str]:
    """Variant names from the engine for a case kind: the linear-attention library for linear
    cases, the attention library otherwise (imported lazily: the engine is heavy)."""
    module, table = (("engine.variants.linear", "LINEAR_VARIANTS") if kind == "linear"
                     else ("engine.variants", "VARIANTS"))
    try:
        variants = getattr(importlib.import_module(module), table)
    except (ImportError, AttributeError) as exc:
        raise SuiteError(
            f"cannot validate {kind} variant names: {module}.{table} not importable ({exc})"
        ) from exc
    if isinstance(variants, dict):
        return sorted(variants)
    return sorted(getattr(v, "name", v) for v in variants)


def variant_lookup(variant_names: Iterable[str] | None = None,
                   linear_variant_names: Iterable[str] | None = None) -> Callable[[str], list[str]]:
    """kind -> the variant names its cases may use: `linear_variant_names` for linear cases,
    `variant_names` for the others; the engine's libraries where None."""
    given = {"linear": linear_variant_names}
    engine = functools.cache(known_variant_names)

    def lookup(kind: str) -> list[str]:
        names = given.get(kind, variant_names)
        return engine(kind) if names is None else sorted(names)

    return lookup


def known_impl_names() -> list[str]:
    from attnbench.impls import IMPL_NAMES

    return list(IMPL_NAMES)


def load_suite(
    name_or_path: str,
    *,
    shape_override: str | None = None,
    variant_names: Iterable[str] | None = None,
    linear_variant_names: Iterable[str] | None = None,
    impl_names: Iterable[str] | None = None,
    shapes: dict[str, ShapePreset] | None = None,
    suites_dir: Path = SUITES_DIR,
) -> Suite:
    path = resolve_suite_path(name_or_path, suites_dir)
    return parse_suite(
        read_suite_data(path), name=path.stem, path=str(path), shape_override=shape_override,
        variant_names=variant_names, linear_variant_names=linear_variant_names,
        impl_names=impl_names, shapes=shapes,
    )


def _as_list(value: object) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def parse_suite(
    data: dict,
    *,
    name: str,
    path: str = "",
    shape_override: str | None = None,
    variant_names: Iterable[str] | None = None,
    linear_variant_names: Iterable[str] | None = None,
    impl_names: Iterable[str] | None = None,
    shapes: dict[str, ShapePreset] | None = None,
) -> Suite:
    """Validate a parsed suite file and expand it into cases.

    `variant_names`, `linear_variant_names`: the known variants of attention (and decode) and of
    linear cases (None: the engine's libraries)."""
    variants_known = variant_lookup(variant_names, linear_variant_names)
    impls_known = sorted(impl_names) if impl_names is not None else known_impl_names()
    shapes = shapes if shapes is not None else load_shapes()
    errors: list[str] = []
    where = path or name

    unknown = set(data) - SUITE_KEYS
    if unknown:
        errors.append(f"unknown top-level keys {sorted(unknown)}; expected {sorted(SUITE_KEYS)}")
    suite_name = data.get("name", name)
    description = str(data.get("description", ""))
    repeats, warmup = data.get("repeats", 30), data.get("warmup", 3)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        errors.append(f"repeats must be an integer >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        errors.append(f"warmup must be an integer >= 0, got {warmup!r}")
    noise = data.get("noise_threshold")
    if noise is not None and (isinstance(noise, bool) or not isinstance(noise, (int, float))
                              or not 0 < noise < float("inf")):
        errors.append(f"noise_threshold must be a number > 0 (a fraction of the median), "
                      f"got {noise!r}")
    if shape_override is not None and shape_override not in shapes:
        errors.append(f"unknown shape {shape_override!r} (--shape); known shapes: "
                      f"{', '.join(sorted(shapes))}")
    blocks = data.get("cases")
    if not isinstance(blocks, list) or not blocks:
        errors.append("'cases' must be a non-empty list of case tables ([[cases]])")
        blocks = []
    defaults = {k: v for k, v in data.items() if k in CASE_KEYS and k != "name"}

    cases: dict[str, Case] = {}
    for i, block in enumerate(blocks):
        label = f"cases[{i}]"
        if not isinstance(block, dict):
            errors.append(f"{label}: expected a table, got {block!r}")
            continue
        bad = set(block) - CASE_KEYS
        if bad:
            errors.append(f"{label}: unknown keys {sorted(bad)}; expected {sorted(CASE_KEYS)}")
        spec = {**defaults, **block}
        for c in _expand_block(label, block, spec, suite_name, shape_override, variants_known,
                               impls_known, shapes, errors):
            cases.setdefault(c.name, c)  # --shape can fold several blocks onto one case
    if errors:
        raise SuiteError(f"suite {where}: " + "; ".join(errors))
    return Suite(suite_name, description, path, repeats, warmup, tuple(cases.values()),
                 None if noise is None else float(noise))


def _expand_block(label, block, spec, suite_name, shape_override, variants_known, impls_known,
                  shapes, errors) -> list[Case]:
    n_err = len(errors)

    def need(key):
        if key not in spec:
            errors.append(f"{label}: missing {key!r}")
            return []
        return _as_list(spec[key])

    kind = spec.get("kind", "attention")
    if kind not in KINDS:
        errors.append(f"{label}: unknown kind {kind!r}; known kinds: {', '.join(KINDS)}")
    variants = need("variants")
    known = variants_known(kind) if kind in KINDS else []
    for v in variants:
        if v not in known:
            errors.append(f"{label}: unknown variant {v!r}; known {kind} variants: "
                          f"{', '.join(known)}")
    shape_list = [shape_override] if shape_override else need("shapes")
    for s in shape_list:
        if s not in shapes:
            errors.append(
                f"{label}: unknown shape {s!r}; known shapes: {', '.join(sorted(shapes))}"
            )
    impls = need("impls")
    for im in impls:
        if im not in impls_known:
            errors.append(f"{label}: unknown implementation {im!r}; known implementations: "
                          f"{', '.join(impls_known)}")
    baseline = spec.get("baseline", impls[0] if impls else None)
    if baseline is not None and baseline not in impls:
        errors.append(f"{label}: baseline {baseline!r} is not one of its impls {impls}")
    modes = need("modes")
    for m in modes:
        if m not in MODES:
            errors.append(f"{label}: unknown mode {m!r}; known modes: {', '.join(MODES)}")
    dtypes = []
    for d in need("dtypes"):
        try:
            dtypes.append(dtype_name(d))
        except ValueError as exc:
            errors.append(f"{label}: {exc}")

    seqs = _seq_pairs(label, spec, errors)
    if "tokens" in spec and "batch" in spec:
        # a block's own batch/tokens overrides the other one given as a suite default
        in_block = [k for k in ("batch", "tokens") if k in block]
        if len(in_block) != 1:
            errors.append(f"{label}: give either 'batch' or 'tokens', not both")
        else:
            other = "tokens" if in_block[0] == "batch" else "batch"
            spec = {k: v for k, v in spec.items() if k != other}
    has_tokens = "tokens" in spec
    tokens = spec.get("tokens") if has_tokens else None
    batches = _as_list(spec.get("batch", [1])) if tokens is None else []
    for b in batches:
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            errors.append(f"{label}: batch must be a positive integer, got {b!r}")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                               or tokens <= 0):
        errors.append(f"{label}: tokens must be a positive integer, got {tokens!r}")
    layouts = _decode_layouts(label, spec, kind, seqs, modes, errors)
    if kind == "linear":
        _check_continuations(label, seqs, modes, errors)
    if len(errors) > n_err:
        return []

    prefix = spec.get("name")
    out = []
    for v, s, (sq, skv), dt, (ragged, page) in itertools.product(variants, shape_list, seqs,
                                                                  dtypes, layouts):
        preset = shapes[s]
        if tokens is not None:
            if tokens < sq:
                errors.append(f"{label}: tokens ({tokens}) < seqlen_q ({sq})")
                continue
            bs = [tokens // sq]
        else:
            bs = batches
        for b in bs:
            seq = f"s{sq}" if sq == skv else f"s{sq}x{skv}"
            layout = ("ragged" if ragged else "", f"page{page}" if page else "")
            name = "/".join(x for x in (prefix, v, s, f"b{b}", seq, *layout, dt) if x)
            out.append(Case(
                suite=suite_name, name=name, variant=v, shape=s, batch=b, seqlen_q=sq,
                seqlen_kv=skv, dtype=dt, kind=kind, modes=tuple(modes), impls=tuple(impls),
                baseline=baseline, ragged=ragged, page_size=page, **_heads_and_dims(preset, kind),
            ))
    return out


def _seq_pairs(label: str, spec: dict, errors: list[str]) -> list[tuple]:
    """A block's (seqlen_q, seqlen_kv) pairs: `seqlens` (equal), or the product of `seqlen_q`
    and `seqlen_kv`; each checked positive."""
    if "seqlens" in spec:
        if "seqlen_q" in spec or "seqlen_kv" in spec:
            errors.append(f"{label}: give either 'seqlens' or 'seqlen_q'/'seqlen_kv', not both")
        seqs = [(s, s) for s in _as_list(spec["seqlens"])]
    elif "seqlen_q" in spec and "seqlen_kv" in spec:
        seqs = list(itertools.product(_as_list(spec["seqlen_q"]), _as_list(spec["seqlen_kv"])))
    else:
        errors.append(f"{label}: missing 'seqlens' (or both 'seqlen_q' and 'seqlen_kv')")
        seqs = []
    for sq, skv in seqs:
        for key, val in (("seqlen_q", sq), ("seqlen_kv", skv)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                errors.append(f"{label}: {key} must be a positive integer, got {val!r}")
    return seqs


def _heads_and_dims(preset: ShapePreset, kind: str) -> dict[str, int]:
    """A case's head counts and head dims from its shape preset (linear: the linear reading)."""
    if kind == "linear":
        lin = preset.linear_sizes()
        return dict(heads_q=lin["heads_q"], heads_kv=lin["heads_k"], heads=lin["heads"],
                    head_dim=lin["head_dim"], head_dim_v=lin["head_dim_v"])
    return dict(heads_q=preset.heads_q, heads_kv=preset.heads_kv, head_dim=preset.head_dim,
                head_dim_v=preset.head_dim_v)


def _check_continuations(label: str, seqs: list, modes: list, errors: list[str]) -> None:
    """A linear case's seqlen_q (the call's positions) must not pass seqlen_kv (the sequence's
    length after it); below it, a continuation, which times the forward only."""
    for sq, skv in seqs:
        if not (isinstance(sq, int) and isinstance(skv, int)):
            continue
        if sq > skv:
            errors.append(f"{label}: linear seqlen_q ({sq}, the call's positions) must be <= "
                          f"seqlen_kv ({skv}, the sequence's length after the call)")
        elif sq < skv and [m for m in modes if m != "fwd"]:
            errors.append(f"{label}: linear continuations (seqlen_q {sq} < seqlen_kv {skv}) "
                          f"time the forward only; modes must be ['fwd'], got {modes}")


def _decode_layouts(label: str, spec: dict, kind: str, seqs: list, modes: list,
                    errors: list[str]) -> list[tuple[bool, int]]:
    """The (ragged, page_size) pairs of a block, checked; [(False, 0)] for other kinds."""
    if kind != "decode":
        for key in DECODE_KEYS:
            if key in spec:
                errors.append(f"{label}: {key!r} applies to decode cases only (kind = "
                              f"\"decode\"), not {kind!r}")
        return [(False, 0)]
    if [m for m in modes if m != "fwd"]:
        errors.append(f"{label}: decode cases time the forward only; modes must be ['fwd'], "
                      f"got {modes}")
    ragged = _as_list(spec.get("ragged", False))
    for r in ragged:
        if not isinstance(r, bool):
            errors.append(f"{label}: ragged must be true or false, got {r!r}")
    pages = _as_list(spec.get("page_size", 0))
    for p in pages:
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            errors.append(f"{label}: page_size must be an integer >= 0 (0: a contiguous "
                          f"cache), got {p!r}")
    for sq, skv in seqs:
        if isinstance(sq, int) and isinstance(skv, int) and sq > skv:
            errors.append(f"{label}: seqlen_q ({sq}, the new tokens) must be <= seqlen_kv "
                          f"({skv}, the cache capacity)")
        for p in pages:
            if isinstance(p, int) and p > 0 and isinstance(skv, int) and skv % p:
                errors.append(f"{label}: page_size {p} does not divide seqlen_kv {skv} (the "
                              "capacity must be whole pages)")
    return list(itertools.product(ragged, pages))

