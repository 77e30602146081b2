"""Per-call host time of the module on the GPU (issue 20): forward and forward+backward at a tiny
shape, where the GPU waits on Python, against launching the forward kernel alone; and at
llama3-8b S 4k the module's time per call against its kernel's (CUDA events, back to back).
Usage: python scripts/host_overhead.py OUT.json"""

from __future__ import annotations

import json
import sys
import time

import torch

from engine.variants import VARIANTS

N = 2000


def per_call_us(fn, n: int = N) -> float:
    """Wall time per call of `fn` queued back to back (the GPU work is tiny: host-bound)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def gpu_ms(fn, n: int = 50) -> float:
    """GPU time per call of `fn`, back to back, between two events."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def profile(fn, n: int = 500) -> str:
    """Where the host time of `fn` goes: cProfile's top functions by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def setup(batch: int, seqlen: int, hq: int, hkv: int, d: int):
    sizes = dict(batch=batch, heads_q=hq, heads_kv=hkv, seqlen_q=seqlen, seqlen_kv=seqlen,
                 head_dim=d, head_dim_v=d)
    v = VARIANTS["softmax_causal"]
    mod = v.build(**sizes, dtype=torch.bfloat16, backend="tilelang")
    inp = v.make_inputs(**sizes, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    q, k, vv = inp["q"], inp["k"], inp["v"]
    do = torch.randn_like(q)
    fk = mod.forward_kernel()
    finals = {f"F_{n}": torch.empty(batch, hq, seqlen, device="cuda", dtype=torch.float32)
              for n in fk.final_names}
    args = dict(Q=q.detach(), K=k.detach(), V=vv.detach(), **fk.tables.named({}, q.device),
                O=torch.empty_like(q), **finals)

    def forward():
        with torch.no_grad():
            mod(q, k, vv)

    def forward_backward():
        mod(q, k, vv).backward(do)

    return forward, forward_backward, (lambda: fk.kernel(**args))


def main(out: str) -> None:
    fwd, fwd_bwd, kernel = setup(1, 128, 8, 2, 64)
    tiny = {"shape": "B1 S128 Hq8 Hkv2 D64 bf16 causal",
            "forward_us": per_call_us(fwd), "forward_backward_us": per_call_us(fwd_bwd, 1000),
            "kernel_launch_us": per_call_us(kernel), "forward_gpu_ms": gpu_ms(kernel)}
    tiny["profile"] = profile(fwd)
    fwd, fwd_bwd, kernel = setup(2, 4096, 32, 8, 128)
    big = {"shape": "B2 S4096 Hq32 Hkv8 D128 bf16 causal (llama3-8b)",
           "module_forward_ms": gpu_ms(fwd), "kernel_forward_ms": gpu_ms(kernel)}
    big["module_over_kernel"] = big["module_forward_ms"] / big["kernel_forward_ms"]
    result = {"device": torch.cuda.get_device_name(), "tiny": tiny, "llama3_8b_4k": big}
    print(json.dumps(result, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
