"""attnbench: the benchmarking and autotuning harness around the attention engine."""

__version__ = "0.1.0"
