"""The suite runner: for every case, every implementation and mode, one result row.

Before any case: the results folder is created and proven writable, the day file checked
(another schema refused, a cut-off last line repaired; `Runner.prepare`), and on a GPU a warning
noted when another process holds it. Per case: check each implementation's capabilities per mode
(a mismatch is a `skipped` row with the reason), make random inputs from the recorded seed
(never zeros), compute the float32 reference (float64 for small shapes) once, then per
implementation: prepare it (layout changes, compile; not timed), check accuracy on one untimed
call, time the call (see `attnbench.timing`), and build the row. A crashing implementation is an
`error` row with the exception text and the run goes on. The case's rows are appended to the
result file as soon as the case finishes, so an interrupted run keeps every finished case. An
implementation that has not finished after `impl_timeout_s` (a kernel that never ends: its
synchronisation never returns) ends the run with status 124, after its case's rows so far, an
error row for it and skipped rows for the implementations after it are written.

Noise: a timing whose interquartile spread exceeds the noise threshold (default 5% of the
median) is taken again after a pause, up to `attempts` in all; the row keeps the tightest
attempt, records the count in `attempts`, and is `noisy` when every attempt was above the
threshold. Right after each measurement the GPU's clocks, temperature and power are read
through NVML (`attnbench.gpustate`; NaN on a CPU).

Decode cases (kind "decode", attnbench.decode) get a KV cache instead of k and v (contiguous
or paged, ragged lengths or full), are checked against the engine's decode reference executor,
count FLOPs over the pairs attended, and their rows carry the bytes moved, TB/s and the fraction
of the GPU's peak memory bandwidth.

Linear cases (kind "linear", attnbench.linear) take their variant from the linear-attention
library, their inputs (q, k, v, decay and customs in [B, H, T, D]) from the variant, are checked
against the variant's `reference_fn` (outputs, dq, dk, dv and the gradients of its learnable
inputs, the decay or custom tensors; one sequence at a time), and count the chunked
algorithm's FLOPs (`metrics.linear_flops`). Their common layout is the engine's
[B, H, T, D]; an implementation's `Prepared.to_common` maps to it. A continuation case (the last
seqlen_q positions of sequences of seqlen_kv, from the state before them) times the forward
only, checks the output and the final state, counts the recurrent form's FLOPs below a chunk
and carries bytes, TB/s and the bandwidth fraction as decode rows do (`metrics.linear_step_bytes`:
the state read and written, the new positions' q, k, v, decay and o).

Accuracy: rel_err is the max over the output (and dq, dk, dv for bwd modes; a linear case's
learnable inputs' gradients too) of ||x - ref|| / ||ref||; a NaN/inf anywhere, or rel_err above
`metrics.REL_TOL[dtype]`, fails the row. For plain softmax variants too large to materialise at
once, the reference runs per (batch, group of query heads) slice, which is exact because those
slices are independent; for other variants that large, the engine's reference executor runs a
block of query rows at a time.

Peak memory: the CUDA allocator's peak during the implementation's preparation and
measurement, above what was allocated before it started (so the shared case inputs and the
reference do not count; the implementation's own copies of the inputs do).
"""

from __future__ import annotations

import functools
import gc
import inspect
import math
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from attnbench import metrics, timing
from attnbench.deadline import deadline
from attnbench.decode import build_module, case_traffic, decode_reference, make_decode_inputs
from attnbench.envinfo import environment
from attnbench.gpustate import GpuMonitor, monitor_for
from attnbench.impls import DeviceInfo, Impl, Prepared, Unsupported, registry
from attnbench.impls.base import PLAIN_SOFTMAX, TORCH_DTYPES
from attnbench.linear import (
    continuation_reference,
    is_continuation,
    linear_reference,
    make_continuation_inputs,
    make_linear_inputs,
)
from attnbench.results.read import dedupe_latest, read_results
from attnbench.results.schema import SCHEMA_VERSION
from attnbench.results.store import append_rows, check_day_file, check_out_dir, result_path
from attnbench.suites import Case, Suite
from attnbench.timing import L2Flusher, NoisePolicy, Timing

DEFAULT_NOISE_THRESHOLD = 0.05  # interquartile spread / median above which a timing is re-taken
GPU_OUT, CPU_OUT = Path("results/runs"), Path("results/local")  # CPU runs stay out of git
MEASURED = ("ok", "noisy")  # statuses whose rows carry timings
SMALL_FOR_FLOAT64 = 2**22  # B*Hq*Sq*Skv at or below which the reference runs in float64
REF_CHUNK_ELEMS = 2**28  # score elements per reference slice (1 GiB in float32)


@dataclass(frozen=True)
class RunOptions:
    device: str = "auto"  # auto | cpu | cuda
    repeats: int | None = None  # None: the suite's
    warmup: int | None = None
    seed: int = 0
    sleep_s: float | None = None  # between implementations; None: 0.1 s on CUDA, 0 on CPU
    out_dir: Path | None = None  # None: results/runs on CUDA, results/local on a CPU
    noise_threshold: float | None = None  # None: the suite's, else DEFAULT_NOISE_THRESHOLD
    attempts: int = 3  # timing attempts in all for a noisy row
    retry_pause_s: float | None = None  # before a re-measure; None: 1 s on CUDA, 0 on CPU
    # skip the cases the day file already holds from a run of this commit and seed (a suite
    # longer than one sitting finishes over several)
    resume: bool = False
    # an implementation's preparing and measuring past this many seconds ends the run (a
    # kernel that never ends holds its synchronisation for ever), its case's rows written
    # first: Runner._write_unfinished. None: no limit.
    impl_timeout_s: float | None = 1800.0


@dataclass
class RunResult:
    path: Path
    rows: list[dict] = field(default_factory=list)


def resolve_device(name: str) -> DeviceInfo:
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        return DeviceInfo("cuda", torch.cuda.get_device_name(),
                          tuple(torch.cuda.get_device_capability()))
    return DeviceInfo("cpu")


def default_get_variant(name: str):
    from engine.variants import get_variant

    return get_variant(name)


def default_get_linear_variant(name: str):
    from engine.variants.linear import LINEAR_VARIANTS

    if name not in LINEAR_VARIANTS:
        raise ValueError(f"unknown linear variant {name!r}; known: "
                         f"{', '.join(sorted(LINEAR_VARIANTS))}")
    return LINEAR_VARIANTS[name]


def _needs_grad(mode: str) -> bool:
    return mode != "fwd"


class Runner:
    def __init__(
        self,
        suite: Suite,
        options: RunOptions = RunOptions(),
        *,
        get_variant: Callable[[str], object] = default_get_variant,
        get_linear_variant: Callable[[str], object] = default_get_linear_variant,
        impls: dict[str, Impl] | None = None,
        log: Callable[[str], None] = print,
        measure: Callable[..., Timing] = timing.measure,
        monitor: GpuMonitor | None = None,
    ) -> None:
        """`measure` (attnbench.timing.measure's signature) and `monitor` are for tests;
        `get_variant` looks up attention and decode cases' variants, `get_linear_variant`
        linear cases'."""
        self.suite = suite
        self.options = options
        self.device = resolve_device(options.device)
        self.get_variant = get_variant
        self.get_linear_variant = get_linear_variant
        self.impls = impls if impls is not None else registry()
        self.log = log
        self.env = environment(self.device.type)
        cuda = self.device.type == "cuda"
        self.repeats = options.repeats or suite.repeats
        self.warmup = suite.warmup if options.warmup is None else options.warmup
        self.sleep_s = (options.sleep_s if options.sleep_s is not None
                        else (0.1 if cuda else 0.0))
        threshold = next(t for t in (options.noise_threshold, suite.noise_threshold,
                                     DEFAULT_NOISE_THRESHOLD) if t is not None)
        pause = options.retry_pause_s if options.retry_pause_s is not None else (
            1.0 if cuda else 0.0)
        self.noise = NoisePolicy(threshold, options.attempts, pause)
        self._measure = measure
        self._monitor = monitor
        self._flusher: L2Flusher | None = None
        self._prepared = False
        out_dir = options.out_dir if options.out_dir is not None else (
            GPU_OUT if cuda else CPU_OUT)
        self.path = result_path(out_dir, suite.name, self.env["gpu"])

    # ------------------------------------------------------------------ before any case
    def prepare(self) -> list[str]:
        """Check the output and the GPU before anything is measured; the notes to show.

        Raises OutputDirError (folder not creatable/writable) or ResultFileError (a day file
        of another schema); repairs a day file's cut-off last line (one note). Idempotent."""
        if self._prepared:
            return []
        check_out_dir(self.path.parent)
        notes = [n for n in [check_day_file(self.path)] if n]
        if self._monitor is None:
            self._monitor = monitor_for(self.device.type)
        if self.device.type == "cuda":
            # before our first allocation, so that NVML cannot list this process (see gpustate)
            busy = self._monitor.busy_warning()
            notes += [busy] if busy else []
            if not self._monitor.available:
                notes.append(f"no GPU clocks/temperature/power in the rows: "
                             f"{self._monitor.error}")
            self._flusher = L2Flusher(torch.device("cuda"))
        self._prepared = True
        return notes

    # ------------------------------------------------------------------ plans
    def variant(self, case: Case):
        """The case's variant, from its kind's library."""
        lookup = self.get_linear_variant if case.kind == "linear" else self.get_variant
        return lookup(case.variant)

    def plan(self, case: Case) -> dict[str, dict[str, str | None]]:
        """Per implementation of `case`, per mode: the skip reason on this machine, or None."""
        variant = self.variant(case)
        return {name: self.impls[name].check_modes(case, variant, self.device)
                for name in case.impls}

    def skip_summary(self) -> list[tuple[str, str, int, int]]:
        """(impl, reason, rows skipped for it, rows of the impl) over the suite, from the
        capability checks alone (`prepare` may skip more once inputs exist)."""
        counts: dict[tuple[str, str], int] = {}
        totals: dict[str, int] = {}
        for case in self.suite.cases:
            for name, modes in self.plan(case).items():
                totals[name] = totals.get(name, 0) + len(modes)
                for reason in modes.values():
                    if reason is not None:
                        counts[(name, reason)] = counts.get((name, reason), 0) + 1
        return [(n, r, k, totals[n]) for (n, r), k in counts.items()]

    def measurements(self, case: Case) -> int:
        """How many (impl, mode) measurements the capability checks leave in `case`."""
        return sum(r is None for modes in self.plan(case).values() for r in modes.values())

    # ------------------------------------------------------------------ whole suite
    def gpu_only_skipped(self) -> list[str]:
        """GPU-only implementations of this suite that a CPU run skips."""
        if self.device.type == "cuda":
            return []
        names = {i for c in self.suite.cases for i in c.impls}
        return [n for n in self.impls if n in names and "cpu" not in self.impls[n].caps.devices]

    def iter_cases(self) -> Iterator[tuple[Case, list[dict]]]:
        """Run the cases one by one, appending each case's rows before yielding them (with
        options.resume, a case already in the day file yields its rows from there)."""
        for note in self.prepare():
            self.log(note)
        done = self._finished() if self.options.resume else {}
        for case in self.suite.cases:
            if case.name in done:
                self.log(f"{case.name}: resumed from {self.path}")
                yield case, done[case.name]
                continue
            rows = self.run_case(case)
            append_rows(self.path, rows, on_repair=self.log)
            yield case, rows

    def _finished(self) -> dict[str, list[dict]]:
        """The rows, by case, that the day file holds for every implementation and mode of a
        case of this suite from this commit and seed (a case's rows are appended together; a
        working tree with changes, "-dirty", never matches: its code is not named)."""
        sha = self.env["git_sha"]
        if not self.path.exists() or not sha or sha.endswith("-dirty"):
            return {}
        frame = dedupe_latest(read_results(self.path))
        frame = frame[(frame["suite"] == self.suite.name) & (frame["git_sha"] == sha)
                      & (frame["seed"] == self.options.seed)]
        out = {}
        for case in self.suite.cases:
            rows = frame[frame["case"] == case.name]
            want = {(i, m) for i in case.impls for m in case.modes}
            if want <= set(zip(rows["impl"], rows["mode"], strict=True)):
                out[case.name] = rows.to_dict("records")
        return out

    def run(self) -> RunResult:
        result = RunResult(self.path)
        for _, rows in self.iter_cases():
            result.rows.extend(rows)
        return result

    # ------------------------------------------------------------------ one case
    def run_case(self, case: Case) -> list[dict]:
        self.prepare()
        variant = self.variant(case)
        dev = self.device
        plan = self.plan(case)
        runnable = any(r is None for modes in plan.values() for r in modes.values())

        ctx = _CaseContext(case, variant, dev, self.options.seed) if runnable else None
        rows: list[dict] = []
        for name in case.impls:
            modes = plan[name]
            todo = [m for m, r in modes.items() if r is None]
            results: dict[str, dict] = {
                m: self._status("skipped", r) for m, r in modes.items() if r is not None
            }
            if todo:
                with deadline(self.options.impl_timeout_s, f"{case.name} {name}",
                              functools.partial(self._write_unfinished, case, variant, name,
                                                rows)):
                    results.update(self._run_impl(self.impls[name], ctx, todo))
                if self.sleep_s:
                    time.sleep(self.sleep_s)  # let clocks and temperature settle
            rows.extend(self._row(case, variant, name, m, results[m]) for m in case.modes)
        _fill_speedups(rows, case.baseline)
        return rows

    def _write_unfinished(self, case: Case, variant, hung: str, rows: list[dict],
                          message: str) -> None:
        """At an implementation's deadline (the run is about to end): append the case's rows
        so far, an error row per mode of `hung`, and a skipped row per mode of each
        implementation after it, so that --resume goes on with the next case."""
        done = {r["impl"] for r in rows}
        rows = list(rows)
        for name in case.impls:
            if name not in done:
                res = (self._status("error", f"{message}; the run ended here") if name == hung
                       else self._status("skipped", f"not run: {hung} did not finish"))
                rows.extend(self._row(case, variant, name, m, res) for m in case.modes)
        _fill_speedups(rows, case.baseline)
        append_rows(self.path, rows, on_repair=self.log)
        self.log(f"{case.name}: {message}; its rows so far written to {self.path}")

    def _run_impl(self, impl: Impl, ctx: _CaseContext, modes: list[str]) -> dict[str, dict]:
        """Rows of the `modes` of one implementation; a refusal that names some modes only
        (Unsupported.modes) skips those and prepares the implementation again for the rest."""
        out: dict[str, dict] = {}
        todo = list(modes)
        while todo:
            try:
                out.update(self._prepare_and_measure(impl, ctx, todo))
                break
            except Unsupported as exc:
                hit = [m for m in todo if exc.rules_out(m)] or todo
                out.update({m: self._status("skipped", str(exc)) for m in hit})
                todo = [m for m in todo if m not in hit]
        return out

    def _prepare_and_measure(self, impl: Impl, ctx: _CaseContext,
                             modes: list[str]) -> dict[str, dict]:
        """Raises the `Unsupported` of `prepare`; any other failure is an error row."""
        cuda = self.device.type == "cuda"
        out: dict[str, dict] = {}
        prepared: Prepared | None = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
        try:
            needs_grad = any(_needs_grad(m) for m in modes)
            prepared = impl.prepare(ctx.case, ctx.variant, ctx.inputs, needs_grad)
            for mode in modes:
                try:
                    res = self._measure_mode(prepared, ctx, mode)
                except Unsupported as exc:
                    res = self._status("skipped", str(exc))
                except Exception as exc:  # noqa: BLE001 - a crashing impl is a row
                    reason = prepared.refusal(exc)
                    res = (self._status("skipped", reason) if reason
                           else self._status("error", _exc_text(exc)))
                if cuda:
                    res["peak_mem_mb"] = (torch.cuda.max_memory_allocated() - base_mem) / 2**20
                    torch.cuda.reset_peak_memory_stats()
                res["compile_s"] = prepared.compile_s
                out[mode] = res
        except Unsupported:
            raise
        except Exception as exc:  # noqa: BLE001
            out = {m: self._status("error", _exc_text(exc)) for m in modes}
        finally:
            del prepared
            if cuda:  # free this impl's memory before the next (gc: ~0.2 s, CUDA runs only)
                gc.collect()
                torch.cuda.empty_cache()
        return out

    def _measure_mode(self, p: Prepared, ctx: _CaseContext, mode: str) -> dict:
        case = ctx.case
        with p.context():
            if mode == "fwd":
                fn = p.timed_call(mode)
                got = p.to_common(fn())  # a continuation's: (out, final state)
                outs = list(got) if isinstance(got, tuple) else [got]
                refs = list(ctx.reference(False)[:len(outs)])
            else:
                g = p.from_common(ctx.grad_out)
                out = p.forward()
                # Keep the graph only when the backward alone is timed on it below.
                grads = torch.autograd.grad(out, p.leaves, g, retain_graph=mode == "bwd")
                # q, k, v's gradients are checked here, and a linear case's learnable inputs'
                # (its reference has them); an attention variant's learnable custom input's
                # (timed too) is checked by the GPU tests against the reference executor
                checked = grads if case.kind == "linear" else grads[:3]
                outs = [p.to_common(out), *p.grads_to_common(checked)]
                refs = list(ctx.reference(True))
                if mode == "bwd":
                    def fn():
                        return torch.autograd.grad(out, p.leaves, g, retain_graph=True)
                else:
                    fn = p.timed_call(mode, g)
            rel, mx = _accuracy(outs, refs)
            flops = ctx.flops(mode)
            if (rejected := self._rejected_by_one_call(p, fn, flops)) is not None:
                return {**rejected, "rel_err": rel, "max_abs_err": mx}
            flush = None
            if self._flusher is not None and self._flusher.fits(ctx.nbytes):
                flush = self._flusher
            steady = timing.measure_steady(
                lambda: self._measure(fn, device=self.device.type, repeats=self.repeats,
                                      warmup=self.warmup, flush=flush), self.noise)
        state = self._monitor.sample() if self._monitor is not None else None
        t = steady.timing
        tf = metrics.tflops(flops, t.median_ms)
        res = self._status("ok", "")
        if steady.noisy:
            res.update(status="noisy", reason=(
                f"spread {t.relative_spread:.1%} of the median > {self.noise.threshold:.1%} "
                f"in each of {steady.attempts} attempts (the tightest kept)"))
        cuda = self.device.type == "cuda"
        nbytes = _case_bytes(case, ctx.variant, self.options.seed)
        tb = metrics.tbps(nbytes, t.median_ms)
        res.update(latency_ms=t.median_ms, latency_spread_ms=t.spread_ms,
                   repeats=t.repeats, flops=flops, tflops=tf,
                   mfu=metrics.mfu(tf, self.device.name, case.dtype) if cuda else math.nan,
                   bytes=nbytes, tbps=tb,
                   bw_frac=metrics.bw_frac(tb, self.device.name) if cuda else math.nan,
                   rel_err=rel, max_abs_err=mx, attempts=steady.attempts,
                   **(state.columns() if state is not None else {}))
        tol = metrics.REL_TOL[case.dtype]
        if math.isnan(rel):
            res.update(status="failed", reason="NaN or inf in the output or gradients")
        elif rel > tol:
            res.update(status="failed", reason=f"rel_err {rel:.3g} > tolerance {tol:g}")
        elif p.verify is not None and (bad := p.verify(tf, flops)) is not None:
            res.update(status="failed", reason=bad)
        return res

    def _rejected_by_one_call(self, p: Prepared, fn: Callable[[], object], flops: float
                              ) -> dict | None:
        """A failed row from one timed call of `fn` where the implementation's own check
        rejects its speed (flex's compiled path not running: 0.9-4 s a call, where the full
        measurement would take minutes), else None. One call after the accuracy check's, so
        compilation and first-call setup are behind it; a call that slow is not noise."""
        if p.verify is None:
            return None
        ms = timing.call_ms(fn, torch.cuda.synchronize if self.device.type == "cuda"
                            else lambda: None)
        tf = metrics.tflops(flops, ms)
        if (bad := p.verify(tf, flops)) is None:
            return None
        res = self._status("failed", f"{bad} (one call timed, not measured further)")
        res.update(latency_ms=ms, repeats=1, flops=flops, tflops=tf, attempts=1)
        return res

    # ------------------------------------------------------------------ rows
    @staticmethod
    def _status(status: str, reason: str | None) -> dict:
        return {"status": status, "reason": reason or ""}

    def _row(self, case: Case, variant, impl: str, mode: str, res: dict) -> dict:
        nan = math.nan
        row = {
            "schema_version": SCHEMA_VERSION, "suite": self.suite.name, "case": case.name,
            "variant": case.variant, "shape": case.shape, "batch": case.batch,
            "heads_q": case.heads_q, "heads_kv": case.heads_kv, "seqlen_q": case.seqlen_q,
            "seqlen_kv": case.seqlen_kv, "head_dim": case.head_dim,
            "head_dim_v": case.head_dim_v, "dtype": case.dtype, **_causal_and_mask(case, variant),
            "mode": mode, "impl": impl, "baseline": case.baseline,
            "latency_ms": nan, "latency_spread_ms": nan, "repeats": 0, "flops": nan,
            "tflops": nan, "mfu": nan, "speedup": nan, "rel_err": nan, "max_abs_err": nan,
            "peak_mem_mb": nan, "compile_s": nan, "status": "", "reason": "",
            "device": self.device.type, **self.env, "seed": self.options.seed,
            "attempts": 0, "sm_clock_mhz": nan, "mem_clock_mhz": nan, "gpu_temp_c": nan,
            "gpu_power_w": nan, "bytes": nan, "tbps": nan, "bw_frac": nan,
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        row.update(res)
        if row["status"] not in MEASURED and math.isnan(row["flops"]):
            row["flops"] = _case_flops(case, variant, mode, self.options.seed)
            row["bytes"] = _case_bytes(case, variant, self.options.seed)
        return row


class _CaseContext:
    """Inputs, output gradient and (lazily) the reference of one case, shared by its impls."""

    def __init__(self, case: Case, variant, device: DeviceInfo, seed: int) -> None:
        self.case, self.variant, self.device, self.seed = case, variant, device, seed
        self.grad_out: torch.Tensor | None = None  # decode cases run no backward
        self.whole: dict[str, torch.Tensor] = {}  # a continuation's whole sequences
        if case.kind == "decode":
            self.inputs = make_decode_inputs(case, variant, device.type, seed)
        elif case.kind == "linear" and is_continuation(case):
            self.inputs, self.whole = make_continuation_inputs(case, variant, device.type, seed)
        elif case.kind == "linear":
            self.inputs, self.grad_out = make_linear_inputs(case, variant, device.type, seed)
        else:
            self.inputs, self.grad_out = _attention_inputs(case, variant, device, seed)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.inputs.values()
                          if isinstance(t, torch.Tensor))
        if self.grad_out is not None:
            self.nbytes += 2 * self.grad_out.numel() * self.grad_out.element_size()  # out, dout
        self._ref: dict[bool, tuple[torch.Tensor, ...]] = {}

    def flops(self, mode: str) -> float:
        return _case_flops(self.case, self.variant, mode, self.seed)

    def reference(self, with_grads: bool) -> tuple[torch.Tensor, ...]:
        """(out,) or (out, dq, dk, dv) in the common layout ([B, S, H, D]; linear cases
        [B, H, T, D]; a continuation's (out, final state)), float32/float64, computed once."""
        if with_grads in self._ref:
            return self._ref[with_grads]
        if not with_grads and True in self._ref:
            return self._ref[True][:1]
        c = self.case
        if c.kind == "decode":  # forward only (the suite refuses other modes)
            self._ref[False] = (decode_reference(c, self.variant, self.inputs),)
            return self._ref[False]
        n = c.batch * max(c.heads_q, c.heads) * c.seqlen_q * c.seqlen_kv
        dt = torch.float64 if n <= SMALL_FOR_FLOAT64 else torch.float32
        if c.kind == "linear" and is_continuation(c):  # forward only (the suite says so)
            self._ref[False] = continuation_reference(c, self.variant, self.whole, dt)
            return self._ref[False]
        if c.kind == "linear":
            self._ref[with_grads] = linear_reference(c, self.variant, self.inputs, self.grad_out,
                                                     dt, with_grads)
            return self._ref[with_grads]
        how = _reference_whole
        if n > REF_CHUNK_ELEMS:
            plain = c.variant in PLAIN_SOFTMAX and set(self.inputs) == {"q", "k", "v"}
            how = _reference_chunked if plain else _reference_by_rows
        res = how(self.variant, self.inputs, self.grad_out, dt, with_grads, c)
        self._ref[with_grads] = res
        return res


def _attention_inputs(case: Case, variant, device: DeviceInfo,
                      seed: int) -> tuple[dict, torch.Tensor]:
    """q, k, v and the custom tensors of an attention case, and the output gradient."""
    dtype = TORCH_DTYPES[case.dtype]
    inputs = variant.make_inputs(
        batch=case.batch, heads_q=case.heads_q, heads_kv=case.heads_kv,
        seqlen_q=case.seqlen_q, seqlen_kv=case.seqlen_kv, head_dim=case.head_dim,
        head_dim_v=case.head_dim_v, dtype=dtype, device=device.type, seed=seed,
        requires_grad=False,
    )
    gen = torch.Generator(device=device.type).manual_seed(seed + 1)
    grad_out = torch.randn(case.batch, case.seqlen_q, case.heads_q, case.head_dim_v,
                           generator=gen, device=device.type, dtype=dtype)
    return inputs, grad_out


def _reference_whole(variant, inputs, grad_out, dt, with_grads, case):
    ref_in = {n: (t.detach().to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point()
                  else t) for n, t in inputs.items()}
    if not with_grads:
        with torch.no_grad():
            return (_call_reference(variant, ref_in, dt).detach(),)
    leaves = [ref_in[n].requires_grad_(True) for n in ("q", "k", "v")]
    out = _call_reference(variant, ref_in, dt)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return (out.detach(), *grads)


def _call_reference(variant, inputs, dt):
    """variant.torch_reference in `dt` math (the engine's takes dtype=; fall back without)."""
    if "dtype" in inspect.signature(variant.torch_reference).parameters:
        return variant.torch_reference(inputs, dtype=dt)
    return variant.torch_reference(inputs)


def _reference_chunked(variant, inputs, grad_out, dt, with_grads, case):
    """Plain softmax only: each (batch, group of q heads sharing one kv head) is independent."""
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    g = case.heads_q // case.heads_kv
    per = max(1, min(g, REF_CHUNK_ELEMS // (case.seqlen_q * case.seqlen_kv)))
    while g % per:
        per -= 1
    out = torch.empty(*grad_out.shape, dtype=dt, device=q.device)
    dq, dk, dv = (torch.zeros(t.shape, dtype=dt, device=q.device) for t in (q, k, v))
    for b in range(case.batch):
        for j in range(case.heads_kv):
            for h0 in range(j * g, (j + 1) * g, per):
                sl = {"q": q[b:b + 1, :, h0:h0 + per], "k": k[b:b + 1, :, j:j + 1],
                      "v": v[b:b + 1, :, j:j + 1]}
                res = _reference_whole(variant, sl, grad_out[b:b + 1, :, h0:h0 + per], dt,
                                       with_grads, case)
                out[b:b + 1, :, h0:h0 + per] = res[0]
                if with_grads:
                    dq[b:b + 1, :, h0:h0 + per] = res[1]
                    dk[b:b + 1, :, j:j + 1] += res[2]
                    dv[b:b + 1, :, j:j + 1] += res[3]
    return (out, dq, dk, dv) if with_grads else (out,)


def _reference_by_rows(variant, inputs, grad_out, dt, with_grads, case):
    """Any other variant too large to materialise: the engine's reference executor (the
    variant's spec in plain torch, checked against its torch reference by the engine's tests),
    a block of query rows at a time: each row's normalisation is its own."""
    from engine.reference import executor

    mod = build_module(case, variant, "reference")
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    customs = {n: inputs[n].detach() for n in mod.custom_io.names()}
    with torch.no_grad():
        out, finals = executor.forward(mod.spec, q, k, v, customs, dtype=dt)
        if not with_grads:
            return (out,)
        dq, dk, dv, _ = executor.backward(mod.spec, q, k, v, customs, out, finals, grad_out,
                                          dtype=dt)
    return out, dq, dk, dv


def _accuracy(outs, refs) -> tuple[float, float]:
    rel = mx = 0.0
    for o, r in zip(outs, refs, strict=True):
        e, m = metrics.errors(o, r)
        if math.isnan(e):
            return math.nan, math.nan
        rel, mx = max(rel, e), max(mx, m)
    return rel, mx


def _case_flops(case: Case, variant, mode: str, seed: int) -> float:
    if case.kind == "decode":  # over the lengths the seed draws (ragged cases)
        return case_traffic(case, variant, seed)[1]
    if case.kind == "linear":
        recurrent = is_continuation(case) and case.seqlen_q < metrics.LINEAR_CHUNK
        return metrics.linear_flops(case.batch, case.heads, case.seqlen_q, case.head_dim,
                                    case.head_dim_v, mode, recurrent=recurrent)
    frac = metrics.unmasked_fraction(variant, variant.mask, case.seqlen_q, case.seqlen_kv)
    return metrics.attention_flops(case.batch, case.heads_q, case.seqlen_q, case.seqlen_kv,
                                   case.head_dim, case.head_dim_v, mode, frac)


def _causal_and_mask(case: Case, variant) -> dict:
    """The row's causal and mask columns (a linear layer is causal by definition)."""
    if case.kind == "linear":
        return {"causal": True, "mask": "causal"}
    return {"causal": bool(variant.causal), "mask": variant.mask}


def _case_bytes(case: Case, variant, seed: int) -> float:
    """Bytes the case must move (decode and linear continuation cases; NaN for the others:
    compute-bound)."""
    if case.kind == "decode":
        return case_traffic(case, variant, seed)[0]
    if case.kind == "linear" and is_continuation(case):
        return metrics.linear_step_bytes(case)
    return math.nan


def _fill_speedups(rows: list[dict], baseline: str) -> None:
    """Speedups of the timed rows, noisy ones included (their mark says how far to trust)."""
    base = {r["mode"]: r["latency_ms"] for r in rows
            if r["impl"] == baseline and r["status"] in MEASURED}
    for r in rows:
        if r["status"] in MEASURED:
            r["speedup"] = metrics.speedup(base.get(r["mode"]), r["latency_ms"])


def _exc_text(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500] + where
