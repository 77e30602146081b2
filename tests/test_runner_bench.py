"""The runner's own per-case overhead (capability checks, inputs, reference, accuracy, timing
harness, rows, atomic append) with an implementation that does almost nothing."""

from attnbench.impls import Capabilities, Impl, Prepared
from attnbench.runner import Runner, RunOptions
from attnbench.suites import parse_suite

CAPS = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}))


class Echo(Impl):
    """Returns the reference output it was handed: the cheapest implementation possible."""

    gpu_only = False

    def __init__(self, name, skip=False):
        self.name = name
        self._caps = CAPS if not skip else Capabilities(devices=frozenset({"cuda"}),
                                                        dtypes=frozenset({"float32"}))

    @property
    def caps(self):
        return self._caps

    def prepare(self, case, variant, inputs, needs_grad):
        out = variant.torch_reference(inputs)
        return Prepared(forward=lambda: out)


def test_runner_per_case_overhead(benchmark, variants, tmp_path):
    impls = {"a": Echo("a"), "b": Echo("b"), "gpu": Echo("gpu", skip=True)}
    suite = parse_suite(
        {"impls": list(impls), "modes": ["fwd"], "dtypes": ["float32"], "repeats": 1,
         "warmup": 0, "cases": [{"variants": ["softmax"], "shapes": ["smoke-gqa"],
                                 "seqlens": [16]}]},
        name="bench", variant_names=["softmax"], impl_names=list(impls))
    runner = Runner(suite, RunOptions(device="cpu", out_dir=tmp_path),
                    get_variant=variants.__getitem__, impls=impls, log=lambda s: None)
    case = suite.cases[0]

    def one_case():
        rows = runner.run_case(case)
        from attnbench.results.store import append_rows

        append_rows(runner.path, rows)
        return rows

    rows = benchmark.pedantic(one_case, rounds=20, iterations=1, warmup_rounds=2)
    assert [r["status"] for r in rows] == ["ok", "ok", "skipped"]
    # the harness itself must stay far below the cost of any real measurement
    assert benchmark.stats.stats.median < 0.5
