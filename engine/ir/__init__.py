"""The traced IR: one expression DAG per hook, with a stable hash."""

from engine.ir.spec import TracedSpec
from engine.ir.trace import TraceError, trace_spec

__all__ = ["TraceError", "TracedSpec", "trace_spec"]
