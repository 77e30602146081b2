"""GPU names in paths and keys, in one place: two granularities, each for one job.

`gpu_slug` is the exact product ("NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"): tuned
kernel configs are keyed by it, because products of one model differ in SM count, clocks and
memory (an H100 PCIe has 114 SMs, the SXM 132) and a config tuned on one is not the other's.
`gpu_model` is the model ("h100"): result files, baselines and the dashboard group by it, where
a short, stable name matters more and the row's `gpu` column keeps the full product name.
"""

from __future__ import annotations

import math
import re


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (tune-file paths and keys)."""
    slug = re.sub(r"[^a-z0-9]+", "-", str(gpu).lower()).strip("-")
    return slug or "unknown-gpu"


def gpu_model(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100' (result files, baselines, the dashboard).

    The model number (letters then digits, such as h100, h200, a100, b200, gh200); memory size
    and form factor are dropped. A name without one is slugged whole; none is "unknown".
    """
    if name is None or (isinstance(name, float) and math.isnan(name)) or not str(name).strip():
        return "unknown"
    lowered = str(name).lower()
    match = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", lowered)
    if match:
        return match.group(1)
    return re.sub(r"[^a-z0-9]+", "-", lowered).strip("-") or "unknown"
