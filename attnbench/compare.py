"""The regression gate: match two runs' rows and decide what got faster, slower or less accurate.

Noise rule (performance). Rows are matched by (suite, case, impl, mode); only rows with
status == ok on both sides have numbers. With `base`, `new` the two medians of the metric and
`s_base`, `s_new` their spreads (the interquartile range of the repetitions, converted to the
metric's units), a change counts only when

    |new - base| > max(threshold * base, k * sqrt(s_base**2 + s_new**2))

i.e. it is both larger than the relative threshold (default 5%) AND larger than what the two runs'
own scatter explains. k defaults to 1: for normally distributed repetitions the IQR is 1.35
standard deviations, so the noise bound is about 1.35 sigma of the difference of two single
repetitions. That is deliberately conservative (a median of many repetitions is far more
precise than one repetition) because run-to-run drift (clocks, thermals, another process) is not
in either run's spread; its job is to keep a noisy run from being called a regression. A change
beyond the threshold but inside the noise is reported as "noise", never gated. A missing spread
counts as zero. For TFLOP/s, which is flops / latency, a latency IQR converts as
tflops * iqr / latency.

Same-run check (`GateRule.same_run`). A GPU's clock differs between runs by a few percent
(power and thermal state; the machines we measure on cannot lock clocks), and it moves every
implementation of a run alike: on the H100, 2026-11-25, the engine's and cuDNN's causal forward
at S 4k were both 5.6% slower than the day before, their ratio 1.060 both days. With the check,
a row that is slower by the rule above is a regression only if it is also slower, by the same
rule, in its ratio to its case's `baseline` implementation measured in the same run (same case
and mode; the ratio's spread combines both rows' relative IQRs). Slower in latency but not
against the same run's baseline is "clock" (the run was slower as a whole), never gated. A
ratio alone is not enough either: the baseline implementation moves between runs too (flex's
document mask forward 0.56 -> 0.33 ms), so a row is judged on its ratio only where its latency
also got worse. Rows without an ok baseline row in both runs are judged on the metric alone.

Accuracy. Each dtype has a tolerance on `rel_err` (bf16 1e-2, fp16 5e-3, fp32 1e-5, float64
1e-12). A row regresses in accuracy when its new error became NaN/inf, or when it was within
tolerance in the base and exceeds it now. A row already beyond tolerance (or NaN) in the base is
reported as out-of-tolerance, not gated: the gate is about what a change made worse.

Scope. Only rows whose implementation matches `GateRule.impls` (default: this project's
`engine*`) can fail the gate. The reference implementations (FlashAttention-3, cuDNN, flex...)
are measured for comparison; their changes are reported as drift, since no commit here can cause
or fix them (FA3's causal S = 1k row once doubled in latency between two runs of one day).

Status. ok -> failed|error is a regression (the case no longer runs correctly); ok -> skipped
and rows that appeared are reported; `strict` gates ok -> skipped and every vanished row.

Nothing measured is not a pass. A row of a gated implementation that is in the base and absent
from the new run is a regression ("missing"): a run cut short or a header-only file must not
pass. A run filtered on purpose names what it left out in `GateRule.allow_missing` (globs on the
case or the implementation name); those rows are listed as excused. A new run with no ok row, or
with a suite that has no ok row, fails. A day's result file keeps every run of the day, so a run
cut short leaves an earlier run's rows standing in for the cases it did not reach: where a suite
of the new run has rows measured after the base's newest row of that suite, its rows no newer
than their base row are counted as absent (with a note).

Noisy rows. The runner marks `noisy` a row whose spread stayed above its re-measure threshold
after every attempt. Its numbers are not trusted, so a row that is noisy on either side is
listed apart (perf "noisy") and never judged: neither a regression nor a speedup.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

import pandas as pd

from attnbench.results.read import KEY, dedupe_latest
from engine.dtypes import short_dtype_name

DTYPE_TOLERANCE: dict[str, float] = {"bf16": 1e-2, "fp16": 5e-3, "fp32": 1e-5, "fp64": 1e-12}
# Reference-path names the kernels never take (the rest come from engine.dtypes' one table).
_REFERENCE_DTYPES = {"tf32": "fp32", "float64": "fp64", "double": "fp64", "fp64": "fp64"}
METRICS = ("latency_ms", "tflops")
RAN = ("ok", "noisy")  # statuses of a row that ran and has numbers


def dtype_tolerance(dtype: str) -> float:
    """The rel_err tolerance of a dtype name such as "bf16" or "torch.bfloat16"."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name in _REFERENCE_DTYPES:
        name = _REFERENCE_DTYPES[name]
    else:
        with contextlib.suppress(ValueError):
            name = short_dtype_name(name)
    if name not in DTYPE_TOLERANCE:
        raise ValueError(
            f"dtype: no accuracy tolerance for {dtype!r}; expected one of "
            f"{', '.join(DTYPE_TOLERANCE)} (or an alias such as bfloat16)"
        )
    return DTYPE_TOLERANCE[name]


@dataclass(frozen=True)
class GateRule:
    threshold: float = 0.05  # relative change that matters
    noise_k: float = 1.0  # multiple of the combined IQR a change must also exceed
    metric: str = "latency_ms"  # latency_ms (lower is better) or tflops (higher is better)
    strict: bool = False  # also gate every vanished row and ok -> skipped
    impls: tuple[str, ...] = ("engine*",)  # implementations (glob patterns) the gate judges
    # rows left out of the new run on purpose: globs on the case or the implementation name
    allow_missing: tuple[str, ...] = ()
    same_run: bool = False  # a slower row must also be slower against its same-run baseline

    def __post_init__(self) -> None:
        if not (0 <= self.threshold < 10) or math.isnan(self.threshold):
            raise ValueError(f"threshold: expected a fraction in [0, 10), got {self.threshold!r}")
        if not self.noise_k >= 0:
            raise ValueError(f"noise_k: expected a number >= 0, got {self.noise_k!r}")
        if not self.impls or not all(isinstance(p, str) and p for p in self.impls):
            raise ValueError(f"impls: expected non-empty glob patterns, got {self.impls!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric: expected one of {', '.join(METRICS)}, got {self.metric!r}")
        if not all(isinstance(p, str) and p for p in self.allow_missing):
            raise ValueError(
                f"allow_missing: expected non-empty glob patterns, got {self.allow_missing!r}"
            )

    def gates(self, impl: str) -> bool:
        """True when the gate judges rows of this implementation."""
        return any(fnmatchcase(str(impl), p) for p in self.impls)

    def excuses(self, key: tuple[str, ...]) -> bool:
        """True when `allow_missing` names this row's case or implementation."""
        _suite, case, impl, _mode = key
        return any(fnmatchcase(str(case), p) or fnmatchcase(str(impl), p)
                   for p in self.allow_missing)


@dataclass(frozen=True)
class RowChange:
    """One matched (suite, case, impl, mode) row and what the gate made of it."""

    key: tuple[str, str, str, str]
    dtype: str
    base_status: str
    new_status: str
    base: float = math.nan  # metric, median
    new: float = math.nan
    base_spread: float = math.nan  # metric units
    new_spread: float = math.nan
    change: float = math.nan  # relative, signed: (new - base) / base
    speedup: float = math.nan  # base latency / new latency (> 1 is faster)
    noise: float = math.nan  # the noise bound, metric units
    perf: str = "n/a"  # faster | slower | clock | noise | same | noisy | n/a
    ratio_change: float = math.nan  # clock: the change against the same run's baseline
    base_err: float = math.nan
    new_err: float = math.nan
    tolerance: float = math.nan
    accuracy: str = "n/a"  # ok | regressed | out-of-tolerance | n/a
    status_change: str = ""  # e.g. "ok -> failed"
    regression: bool = False  # worse, in a gated implementation
    reasons: tuple[str, ...] = ()  # why it is worse (set for ungated implementations too)


Key = tuple[str, str, str, str]


@dataclass(frozen=True)
class Comparison:
    rule: GateRule
    rows: tuple[RowChange, ...]
    appeared: tuple[Key, ...] = ()
    vanished: tuple[Key, ...] = ()  # every base row absent from the new run
    notes: tuple[str, ...] = field(default=())
    # what the new run lacks entirely ("the new run has no rows", "suite x: no ok row", an empty
    # run file): each fails the gate
    empty: tuple[str, ...] = ()

    @property
    def regressions(self) -> list[RowChange]:
        return [r for r in self.rows if r.regression]

    @property
    def missing(self) -> list[Key]:
        """Vanished rows of gated implementations not excused by `allow_missing`: regressions."""
        return [k for k in self.vanished if self.rule.gates(k[2]) and not self.rule.excuses(k)]

    @property
    def excused(self) -> list[Key]:
        """Vanished rows that `allow_missing` names."""
        return [k for k in self.vanished if self.rule.excuses(k)]

    @property
    def noisy(self) -> list[RowChange]:
        """Matched rows noisy on either side: listed, never judged."""
        return [r for r in self.rows if r.perf == "noisy"]

    @property
    def drift(self) -> list[RowChange]:
        """Rows that got worse in implementations the gate does not judge."""
        return [r for r in self.rows if r.reasons and not r.regression]

    @property
    def faster(self) -> list[RowChange]:
        return [r for r in self.rows if r.perf == "faster"]

    @property
    def failed(self) -> bool:
        """True when the gate refuses the new run."""
        strict_vanished = self.rule.strict and any(not self.rule.excuses(k)
                                                   for k in self.vanished)
        return bool(self.regressions or self.missing or self.empty) or strict_vanished

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in ("faster", "slower", "clock", "noise", "same", "noisy", "n/a")}
        for r in self.rows:
            out[r.perf] = out.get(r.perf, 0) + 1
        out["accuracy regressions"] = sum(r.accuracy == "regressed" for r in self.rows)
        out["regressions"] = len(self.regressions)
        out["appeared"] = len(self.appeared)
        out["vanished"] = len(self.vanished)
        out["missing"] = len(self.missing)
        out["excused"] = len(self.excused)
        return out

    def failures(self) -> list[str]:
        """Why the gate refuses the new run, one phrase per cause; [] when it passes."""
        if not self.failed:
            return []
        c = self.counts()
        why = [f"{c['regressions']} regression(s)"] if c["regressions"] else []
        if c["missing"]:
            why.append(f"{c['missing']} gated row(s) missing from the new run")
        why += list(self.empty)
        if self.rule.strict and c["vanished"] > c["missing"] + c["excused"]:
            why.append("vanished rows (strict)")
        return why


def compare(base: pd.DataFrame, new: pd.DataFrame, rule: GateRule | None = None) -> Comparison:
    """Match rows by (suite, case, impl, mode) and classify every change (see module doc)."""
    rule = rule or GateRule()
    notes = []
    for name, frame in (("base", base), ("new", new)):
        dup = frame.duplicated(list(KEY)).sum()
        if dup:
            notes.append(f"{name}: {dup} repeated row(s); the latest measurement of each is used")
    base = _with_reference(dedupe_latest(base)).set_index(list(KEY))
    new = _with_reference(dedupe_latest(new)).set_index(list(KEY))
    stale = _not_remeasured(base, new)
    if stale:
        new = new.drop(index=stale)
        for suite in sorted({k[0] for k in stale}):
            n = sum(k[0] == suite for k in stale)
            notes.append(
                f"suite {suite}: {n} row(s) of the new run are not newer than the base's: "
                "an earlier run's rows filling in for cases the newest run did not reach "
                "(a day's file keeps every run of the day); counted as absent"
            )
    common = base.index.intersection(new.index, sort=False)
    rows = tuple(_classify(k, base.loc[k], new.loc[k], rule) for k in sorted(common))
    appeared = tuple(sorted(_keys(new.index.difference(base.index))))
    vanished = tuple(sorted(_keys(base.index.difference(new.index))))
    return Comparison(rule, rows, appeared, vanished, tuple(notes), _empty(new))


def _with_reference(frame: pd.DataFrame) -> pd.DataFrame:
    """Adds ref_latency_ms and ref_spread_ms: the latency and spread of the row's `baseline`
    implementation in the same frame (same suite, case and mode; an ok row of another
    implementation), NaN where there is none."""
    cols = ["suite", "case", "mode", "impl", "latency_ms", "latency_spread_ms"]
    if frame.empty or "baseline" not in frame.columns:
        return frame.assign(ref_latency_ms=math.nan, ref_spread_ms=math.nan)
    ref = frame.loc[frame["status"].astype(str) == "ok", cols].rename(columns={
        "impl": "baseline", "latency_ms": "ref_latency_ms", "latency_spread_ms": "ref_spread_ms"})
    out = frame.merge(ref, on=["suite", "case", "mode", "baseline"], how="left")
    out.index = frame.index
    own = out["baseline"] == out["impl"]  # the baseline row itself has no reference
    out.loc[own, ["ref_latency_ms", "ref_spread_ms"]] = math.nan
    return out


def _not_remeasured(base: pd.DataFrame, new: pd.DataFrame) -> list:
    """Keys of suites run again since the base whose new row is no newer than the base's row.

    A day's result file gathers every run of that day and the latest row of each key counts, so
    a run cut short leaves earlier rows (often the very rows the baseline was promoted from)
    standing in for the cases it did not reach. A suite counts as run again when the new run
    has a row measured after the base's newest row of that suite; its rows that are no newer
    than their base row were then not measured by that run. (Just after a promotion the new
    rows are the base's own rows, none newer: nothing is flagged.)
    """
    common = base.index.intersection(new.index, sort=False)
    if common.empty:
        return []
    base_when, new_when = _when(base), _when(new)
    base_last = base_when.groupby(level="suite").max()
    new_suites = new.index.get_level_values("suite")
    after = new_when.to_numpy() > base_last.reindex(new_suites).to_numpy()  # NaT: False
    rerun = set(new_suites[after])
    stale = new_when.loc[common].to_numpy() <= base_when.loc[common].to_numpy()
    return [k for k, old in zip(common, stale, strict=True) if old and k[0] in rerun]


def _when(frame: pd.DataFrame) -> pd.Series:
    return pd.to_datetime(frame["timestamp"], utc=True, errors="coerce", format="ISO8601")


def _keys(index: pd.Index) -> list[Key]:
    return [tuple(str(v) for v in k) for k in index]


def _empty(new: pd.DataFrame) -> tuple[str, ...]:
    """What the new run did not measure at all: no row, no ok row, or a suite without one."""
    if new.empty:
        return ("the new run has no rows",)
    status = new["status"].astype(str)
    ok_suites = set(new.loc[status == "ok"].index.get_level_values("suite"))
    if not ok_suites:
        return (f"the new run has no ok rows (of {len(new)})",)
    suites = new.index.get_level_values("suite")
    return tuple(f"suite {s}: no ok rows in the new run (of {int((suites == s).sum())})"
                 for s in sorted(set(suites) - ok_suites))


def _f(value) -> float:
    try:
        return float(value) if not pd.isna(value) else math.nan
    except (TypeError, ValueError):
        return math.nan


def _metric(row: pd.Series, metric: str) -> tuple[float, float]:
    """(value, spread) of a row in the metric's units; spread 0 when unknown. Metric
    "ratio": the latency over the same run's latency of the case's baseline implementation."""
    latency, iqr = _f(row["latency_ms"]), _spread(row["latency_spread_ms"])
    if metric == "latency_ms":
        return latency, iqr
    if metric == "ratio":
        ref, ref_iqr = _f(row["ref_latency_ms"]), _spread(row["ref_spread_ms"])
        ratio = latency / ref
        return ratio, ratio * math.hypot(iqr / latency, ref_iqr / ref)
    tflops = _f(row["tflops"])
    spread = tflops * iqr / latency if latency > 0 else 0.0
    return tflops, spread


def _spread(value) -> float:
    v = _f(value)
    return 0.0 if math.isnan(v) else abs(v)


def _same_run_check(b: pd.Series, n: pd.Series, rule: GateRule, verdict: dict,
                    why: list[str]) -> tuple[dict, list[str]]:
    """(verdict, why) after the same-run check: a slower verdict stands only if the row is
    also slower against its same-run baseline (module doc), else it becomes "clock" with no
    reason."""
    if not (rule.same_run and verdict.get("perf") == "slower"):
        return verdict, why
    if not all(_f(r["ref_latency_ms"]) > 0 and _f(r["latency_ms"]) > 0 for r in (b, n)):
        return verdict, why
    bv, bs = _metric(b, "ratio")
    nv, ns = _metric(n, "ratio")
    if _judge(bv, bs, nv, ns, replace(rule, metric="latency_ms"), [])["perf"] == "slower":
        return verdict, [*why, f"x the same run's baseline {bv:.3f} -> {nv:.3f} "
                               f"({(nv - bv) / bv:+.1%})"]
    return {**verdict, "perf": "clock", "ratio_change": (nv - bv) / bv}, []


def _classify(key, b: pd.Series, n: pd.Series, rule: GateRule) -> RowChange:
    b_status, n_status = str(b["status"]), str(n["status"])
    reasons: list[str] = []
    fields: dict = {}
    status_change = f"{b_status} -> {n_status}" if b_status != n_status else ""
    if b_status in RAN and n_status in ("failed", "error"):
        reasons.append(f"status {status_change}")
    if b_status in RAN and n_status == "skipped" and rule.strict:
        reasons.append(f"status {status_change} (strict)")

    if b_status in RAN and n_status in RAN:
        bv, bs = _metric(b, rule.metric)
        nv, ns = _metric(n, rule.metric)
        fields.update(base=bv, new=nv, base_spread=bs, new_spread=ns)
        bl, nl = _f(b["latency_ms"]), _f(n["latency_ms"])
        fields["speedup"] = bl / nl if nl > 0 else math.nan
        if "noisy" in (b_status, n_status):
            # shown, never judged: the runner could not measure it tightly
            fields.update(perf="noisy", change=(nv - bv) / bv if bv > 0 else math.nan)
        else:
            why: list[str] = []
            verdict, why = _same_run_check(b, n, rule, _judge(bv, bs, nv, ns, rule, why), why)
            fields.update(verdict)
            reasons += why

    acc = _accuracy(b, n, b_status, n_status)
    fields.update(acc)
    if acc["accuracy"] == "regressed":
        reasons.append(
            f"rel_err {acc['base_err']:.2e} -> {acc['new_err']:.2e} "
            f"(tolerance {acc['tolerance']:.0e})"
        )
    return RowChange(
        key=tuple(str(k) for k in key),
        dtype=str(n["dtype"]),
        base_status=b_status,
        new_status=n_status,
        status_change=status_change,
        regression=bool(reasons) and rule.gates(str(key[2])),
        reasons=tuple(reasons),
        **fields,
    )


def _judge(bv: float, bs: float, nv: float, ns: float, rule: GateRule,
           reasons: list[str]) -> dict:
    """The perf verdict of two ok rows under the noise rule; appends why when slower."""
    if not (bv > 0 and not math.isnan(nv)):
        if math.isnan(nv) or nv <= 0:
            reasons.append(f"{rule.metric} is {nv} in an ok row")
            return {"perf": "slower"}
        return {}
    noise = rule.noise_k * math.hypot(bs, ns)
    bound = max(rule.threshold * bv, noise)
    worse = (nv - bv) if rule.metric == "latency_ms" else (bv - nv)
    if worse > bound:
        perf = "slower"
        reasons.append(f"{rule.metric} {(nv - bv) / bv:+.1%} (bound {bound / bv:.1%} of base)")
    elif -worse > bound:
        perf = "faster"
    elif abs(worse) > rule.threshold * bv:
        perf = "noise"  # beyond the threshold but inside the runs' scatter
    else:
        perf = "same"
    return {"change": (nv - bv) / bv, "noise": noise, "perf": perf}


def _accuracy(b: pd.Series, n: pd.Series, b_status: str, n_status: str) -> dict:
    try:
        tol = dtype_tolerance(str(n["dtype"]))
    except ValueError:
        tol = math.nan
    b_err, n_err = _f(b["rel_err"]), _f(n["rel_err"])
    out = {"base_err": b_err, "new_err": n_err, "tolerance": tol, "accuracy": "n/a"}
    if n_status != "ok" or b_status != "ok" or math.isnan(tol):
        return out
    base_within = not math.isnan(b_err) and math.isfinite(b_err) and b_err <= tol
    if not math.isfinite(n_err):
        # became NaN/inf: a regression, unless the base was already non-finite
        out["accuracy"] = "regressed" if math.isfinite(b_err) else "out-of-tolerance"
    elif n_err > tol:
        out["accuracy"] = "regressed" if base_within else "out-of-tolerance"
    else:
        out["accuracy"] = "ok"
    return out


def rule_text(rule: GateRule) -> str:
    """The noise rule in a few words, for table titles."""
    same_run = ", same-run check" if rule.same_run else ""
    return f"{rule.metric}, threshold {rule.threshold:.0%}, noise k={rule.noise_k:g}{same_run}"


def perf_summary(c: dict[str, int]) -> str:
    """The performance verdict counts of `Comparison.counts()`, as one phrase."""
    clock = f"{c['clock']} slower with the whole run (clock, not gated), " if c["clock"] else ""
    return (f"{c['faster']} faster, {c['slower']} slower, {clock}{c['noise']} inside the noise, "
            f"{c['same']} unchanged")


def geomean(values: Iterable[float]) -> float:
    logs = [math.log(v) for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(logs) / len(logs)) if logs else math.nan


def _key_text(key: tuple[str, ...]) -> str:
    suite, case, impl, mode = key
    return f"{suite} / {case} / {impl} / {mode}"


def comparison_markdown(cmp: Comparison, base_label: str, new_label: str, limit: int = 25) -> str:
    """A short markdown summary of a comparison, fit for a pull-request comment."""
    c = cmp.counts()
    verdict = f"**FAIL**: {'; '.join(cmp.failures())}" if cmp.failed else "**PASS**"
    lines = [
        f"Gate {verdict} - `{new_label}` against `{base_label}` "
        f"({rule_text(cmp.rule)})",
        "",
        f"{perf_summary(c)}, {c['noisy']} noisy (not judged), "
        f"{c['accuracy regressions']} accuracy regressions, "
        f"{c['appeared']} appeared, {c['vanished']} vanished ({c['missing']} of them gated "
        f"rows missing, {c['excused']} excused by --allow-missing).",
    ]
    lines += [f"- {e}" for e in cmp.empty]
    regs = cmp.regressions
    if regs:
        lines += ["", "| regression | base | new | change | why |", "|---|---:|---:|---:|---|"]
        lines += _change_rows(regs, limit)
    drift = cmp.drift
    if drift:
        lines += ["", "| drift, not gated (reference implementations) | base | new | change | why |",
                  "|---|---:|---:|---:|---|"]
        lines += _change_rows(drift, limit)
    best = sorted(cmp.faster, key=lambda r: -r.speedup)[:limit]
    if best:
        lines += ["", "| faster | base | new | speedup |", "|---|---:|---:|---:|"]
        for r in best:
            lines.append(
                f"| {_key_text(r.key)} | {_num(r.base)} | {_num(r.new)} | {r.speedup:.2f}x |"
            )
    for title, keys in (
        ("Missing (gated rows absent from the new run: regressions)", cmp.missing),
        ("Noisy (spread above the runner's threshold; not judged)", [r.key for r in cmp.noisy]),
        ("Excused by --allow-missing", cmp.excused),
        ("Appeared", cmp.appeared),
        ("Vanished", [k for k in cmp.vanished if k not in set(cmp.missing + cmp.excused)]),
    ):
        if keys:
            shown = ", ".join(f"`{_key_text(k)}`" for k in keys[:limit])
            more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
            lines += ["", f"{title}: {shown}{more}"]
    return "\n".join(lines) + "\n"


def _change_rows(rows: list[RowChange], limit: int) -> list[str]:
    out = [f"| {_key_text(r.key)} | {_num(r.base)} | {_num(r.new)} | {_pct(r.change)} | "
           f"{'; '.join(r.reasons)} |" for r in rows[:limit]]
    if len(rows) > limit:
        out.append(f"| ... {len(rows) - limit} more | | | | |")
    return out


def _num(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.4g}"


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:+.1%}"
