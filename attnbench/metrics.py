"""FLOP counts, throughput, MFU, speedup and accuracy metrics.

FLOP convention (shared/ARCHITECTURE.md, FlashAttention's benchmarks), counting query heads
(GQA does not reduce the work):

    forward  = 2 * B * Hq * Sq * Skv * (D + Dv)  * f     (QK^T: 2*D, PV: 2*Dv per (q, kv) pair)
    backward = 2 * B * Hq * Sq * Skv * (3D + 2Dv) * f    (dS recompute + dQ + dK: 3 x D,
                                                          dP + dV: 2 x Dv) = 2.5 x forward at D=Dv
    fwd+bwd  = forward + backward

`f` is the unmasked fraction of (q, kv) pairs: exactly 0.5 for pure causal attention (so numbers
compare with FlashAttention's and shared/ANCHORS.md, although the exact causal count is
(S+1)/(2S)); for every other mask the variant's exact `unmasked_fraction(Sq, Skv)`; 1 without a
mask. Masked work a kernel may do anyway (partial blocks) is not counted.

Linear attention (kind "linear", attnbench.linear) counts the matmul FLOPs of the chunked
algorithm at chunk size C = 64 (`LINEAR_CHUNK`; fla's and the engine's default), per output head
(H, the value heads: Mamba2's shared q/k heads do not reduce the work), unmasked work only as
above (the causal half of each chunk's C x C block, C/2 key positions per token):

    forward  = 2 * B * H * T * ((C/2) * (D + Dv)   + 2 * D * Dv)   (intra-chunk QK^T and PV;
                                                                    inter-chunk q.state and
                                                                    the state update k^T v)
    backward = 2 * B * H * T * ((C/2) * (3D + 2Dv) + 5 * D * Dv)   (intra: as attention's
                                                                    backward; inter: the state
                                                                    recompute, dq, dk, dv and
                                                                    the state gradient)

Elementwise work (decays, mods, cumulative sums) is not counted. A continuation of fewer than C
positions (a generation step) counts the recurrent form instead, 2 * B * H * T * 2 * D * Dv (the
state update k v^T and the output q . S per position).

MFU is TFLOP/s divided by the device's dense (no sparsity) tensor-core peak for the dtype.
Bandwidth-bound rows (decode, linear continuations) also carry TB/s and its fraction of the
device's peak memory bandwidth (`GPU_MEM_BW`; the bytes counted in
`attnbench.decode.decode_bytes` and `linear_step_bytes`).
"""

from __future__ import annotations

import math

import torch

from engine.dtypes import elem_bytes
from engine.problem import attention_flops, of_mode  # noqa: F401 - the one FLOP count (engine.problem)

# Dense peaks in TFLOP/s from NVIDIA datasheets (no structured sparsity): {dtype: peak}.
# Matched against the device name in order, so more specific names come first.
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),  # SXM5
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),  # incl. GH200
    ("H800", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("H20", {"bfloat16": 148.0, "float16": 148.0, "float32": 44.0}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}),
)


# Peak memory bandwidth in bytes/s from NVIDIA datasheets, matched like GPU_PEAKS (None: not
# known). GH200 comes before H200: its HBM differs by memory size, which the name may not say.
GPU_MEM_BW: tuple[tuple[str, float | None], ...] = (
    ("H100 PCIe", 2.0e12),  # HBM2e
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM5, HBM3
    ("GH200", None),
    ("H200", 4.8e12),  # HBM3e
    ("H800", 3.35e12),
    ("H20", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("L40S", 0.864e12),
)


LINEAR_CHUNK = 64  # the chunk size the linear FLOP count assumes (module docstring)


def linear_flops(batch: int, heads: int, seqlen: int, head_dim: int, head_dim_v: int,
                 mode: str, chunk: int = LINEAR_CHUNK, recurrent: bool = False) -> float:
    """FLOPs of a chunked linear-attention layer by the convention of the module docstring
    (`recurrent`: the recurrent form's, forward only)."""
    tokens = 2.0 * batch * heads * seqlen
    d, dv, half = head_dim, head_dim_v, chunk / 2
    if recurrent:
        return tokens * 2 * d * dv
    return of_mode(mode, tokens * (half * (d + dv) + 2 * d * dv),
                   tokens * (half * (3 * d + 2 * dv) + 5 * d * dv))


def linear_step_bytes(case) -> float:
    """Bytes a linear continuation case must move: the [B, H, D, Dv] float32 state read and
    the final state written, the new positions' q, k and v in the case's dtype, their float32
    decays and the output."""
    state = 2 * case.batch * case.heads * case.head_dim * case.head_dim_v * 4
    rows = case.batch * case.seqlen_q
    qkvo = rows * ((case.heads_q + case.heads_kv) * case.head_dim + 2 * case.heads
                   * case.head_dim_v)
    return float(state + qkvo * elem_bytes(case.dtype) + rows * case.heads * 4)


def unmasked_fraction(variant, mask: str, seqlen_q: int, seqlen_kv: int) -> float:
    """The fraction of (q, kv) pairs counted as work (see the module docstring)."""
    if mask == "none":
        return 1.0
    if mask == "causal":
        return 0.5
    return float(variant.unmasked_fraction(seqlen_q, seqlen_kv))


def tflops(flops: float, latency_ms: float) -> float:
    if not latency_ms or latency_ms <= 0 or math.isnan(latency_ms):
        return math.nan
    return flops / (latency_ms * 1e-3) / 1e12


def peak_tflops(gpu_name: str, dtype: str) -> float | None:
    """The dense peak of a known GPU for `dtype`, or None (unknown GPU, or a CPU)."""
    for key, peaks in GPU_PEAKS:
        if key.lower() in gpu_name.lower():
            return peaks.get(dtype)
    return None


def mfu(tflops_value: float, gpu_name: str, dtype: str) -> float:
    peak = peak_tflops(gpu_name, dtype)
    return tflops_value / peak if peak and not math.isnan(tflops_value) else math.nan


def peak_bandwidth(gpu_name: str) -> float | None:
    """The peak memory bandwidth (bytes/s) of a known GPU, or None (unknown GPU, or a CPU)."""
    for key, peak in GPU_MEM_BW:
        if key.lower() in gpu_name.lower():
            return peak
    return None


def tbps(nbytes: float, latency_ms: float) -> float:
    """Bytes moved per second in TB/s (1e12 B/s); NaN without a latency."""
    if not latency_ms or latency_ms <= 0 or math.isnan(latency_ms):
        return math.nan
    return nbytes / (latency_ms * 1e-3) / 1e12


def bw_frac(tbps_value: float, gpu_name: str) -> float:
    """TB/s over the device's peak memory bandwidth; NaN for an unknown GPU."""
    peak = peak_bandwidth(gpu_name)
    return tbps_value * 1e12 / peak if peak and not math.isnan(tbps_value) else math.nan


def speedup(baseline_ms: float | None, latency_ms: float) -> float:
    if baseline_ms is None or not latency_ms or math.isnan(latency_ms) or math.isnan(baseline_ms):
        return math.nan
    return baseline_ms / latency_ms


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative error ||out - ref|| / ||ref||, max abs error), computed in float64.

    NaN or inf anywhere in `out` gives NaN for both, which fails the row."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    o = out.detach().double()
    r = ref.detach().double().to(o.device)
    if not torch.isfinite(o).all():
        return math.nan, math.nan
    diff = o - r
    denom = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(diff).item()
    rel = num / denom if denom > 0 else (0.0 if num == 0 else math.inf)
    return rel, diff.abs().max().item() if diff.numel() else 0.0


# Accuracy bounds on rel_err, per input dtype: half precision rounds P and the output to
# 8-11 mantissa bits; gradients accumulate more rounding than the forward.
REL_TOL = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
