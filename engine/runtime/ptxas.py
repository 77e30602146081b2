"""What ptxas makes of a generated kernel: its registers, spill bytes and serialised-wgmma
warnings (C751x), and, in the SASS, how many exponentials come before each wait for the P V
gemm. For the compile tests and for surveys of the kernel library (scripts/ptxas_survey.py);
the build that runs kernels is TileLang's own (compile.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PtxasReport:
    """ptxas's resource report of one kernel; `cubin` is the compiled file. `registers` is
    the count at launch: warp-specialised kernels raise their consumers' with setmaxnreg."""

    registers: int
    spill_bytes: int
    serialised: tuple[str, ...]
    cubin: Path


def compile_cubin(cuda: str, workdir: Path, name: str = "k") -> PtxasReport:
    """nvcc a TileLang kernel's CUDA source (as TileLang compiles it: sm_90a, -O3, fast math,
    TileLang's and CUTLASS's headers) into `workdir`/`name`.cubin and read ptxas's report."""
    import tilelang

    tl = os.path.dirname(tilelang.__file__)
    src, cubin = workdir / f"{name}.cu", workdir / f"{name}.cubin"
    src.write_text(cuda)
    r = subprocess.run(
        ["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-std=c++20", f"-I{tl}/src",
         f"-I{tl}/3rdparty/cutlass/include", "--use_fast_math", "--resource-usage",
         "-o", str(cubin), str(src)],
        capture_output=True, text=True, check=True,
    )
    out = r.stdout + r.stderr
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", out)]
    return PtxasReport(
        registers=max(regs, default=0),
        spill_bytes=sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", out)),
        serialised=tuple(re.findall(r"\(C751\d\)[^\n]*", out)),
        cubin=cubin,
    )


def nvdisasm() -> str | None:
    """The nvdisasm binary: on PATH, beside nvcc, or from the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    if nvcc and os.path.exists(beside := os.path.join(os.path.dirname(os.path.realpath(nvcc)),
                                                      "nvdisasm")):
        return beside
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_nvdisasm"):
            if os.path.exists(path := os.path.join(root, sub, "bin", "nvdisasm")):
                return path
    return None


def exponentials_before_pv_waits(cubin: Path, tool: str) -> list[int]:
    """pv_wait_placement of the cubin's SASS, disassembled by `tool` (nvdisasm)."""
    sass = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return pv_wait_placement(sass)


def pv_wait_placement(sass: str) -> list[int]:
    """For each wait for a step's scores in the SASS (`WARPGROUP.DEPBAR.LE gsb0, 0x1`: the
    P V behind them may still run), the MUFU.EX2 that ptxas placed before the next wait for
    every wgmma (`0x0`: the P V's). All of the step's exponentials: the softmax overlaps P V;
    none: the wait comes first (results/NOTES.md, 89 and 120)."""
    counts: list[int] = []
    seen: int | None = None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            seen = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and seen is not None:
            counts.append(seen)
            seen = None
        elif seen is not None and "MUFU.EX2" in line:
            seen += 1
    return counts
