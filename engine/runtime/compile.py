"""Compile generated TileLang source for sm_90a, with an in-process cache keyed by
(spec hash, shape, config) on top of TileLang's own disk cache (TILELANG_CACHE_DIR)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.fsutil import atomic_write_text

TARGET = {"kind": "cuda", "arch": "sm_90a"}
_lock = threading.Lock()
_kernels: dict[str, Any] = {}


def source_dir() -> Path:
    d = Path(
        os.environ.get("ATTNBENCH_KERNEL_DIR", Path.home() / ".cache" / "attnbench" / "kernels")
    )
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_program(source: str) -> tuple[Any, dict[str, Any]]:
    """(`main`, the program's own TileLang pass configs: its PASS_CONFIGS, if any).
    TVMScript parses functions from their source file, so the generated program is written
    to a file (named by its content hash) and imported from there."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    path = source_dir() / f"k_{digest}.py"
    if not path.exists():
        atomic_write_text(path, source)
    spec = importlib.util.spec_from_file_location(f"attnbench_kernel_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.main, dict(getattr(module, "PASS_CONFIGS", {}))


def compile_source(source: str, *, fast_math: bool = True) -> Any:
    """Compile (or fetch from cache) a generated program; returns TileLang's JIT kernel."""
    key = hashlib.sha256(source.encode()).hexdigest()
    with _lock:
        if key in _kernels:
            return _kernels[key]
    from engine.runtime.device import require_nvcc

    require_nvcc()
    import tilelang

    func, own_configs = load_program(source)
    kernel = tilelang.compile(func, target=TARGET,
                              pass_configs=_pass_configs(own_configs, fast_math))
    with _lock:
        _kernels[key] = kernel
    return kernel


def lowered_cuda(source: str, *, fast_math: bool = True) -> str:
    """The CUDA source TileLang lowers a generated program to, as compile_source's kernel
    holds it, without building it: for reading ptxas's view (engine.runtime.ptxas), which
    builds it once itself."""
    import tilelang
    import tvm

    func, own_configs = load_program(source)
    with tvm.transform.PassContext(opt_level=3, config=_pass_configs(own_configs, fast_math)), \
            tvm.target.Target(TARGET):
        return tilelang.lower(func, target=TARGET).kernel_source


def _pass_configs(own: dict[str, Any], fast_math: bool) -> dict[str, Any]:
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: fast_math, **own}


def launcher(kernel: Any) -> Callable[..., Any]:
    """What launches a compiled kernel with every tensor positional (the engine's kernels
    have no outputs TileLang allocates): its TVM-FFI function itself where TileLang's
    adapter is TVM-FFI's, else the kernel. The adapter's own Python (argument count, output
    allocation, device) took 3.5 of a launch's 12.7 us on the H100 (decode at B 1, KV 1k)."""
    adapter = getattr(kernel, "adapter", None)
    get = getattr(adapter, "_get_executable", None)
    if get is None or getattr(adapter, "result_idx", None):
        return kernel
    # A kernel compiled in this process has a tvm.runtime.Executable; one loaded from
    # TileLang's disk cache, the loaded TVM-FFI module itself.
    executable = get()
    module = executable.jit() if callable(getattr(type(executable), "jit", None)) else executable
    return module.main


def cache_size() -> int:
    return len(_kernels)
