"""Per-call host time of the module on the GPU (issue 20): forward and forward+backward at a tiny
shape, where the GPU waits on Python, against launching the forward kernel alone; and at
llama3-8b S 4k the module's time per call against its kernel's (CUDA events, back to back).
Decode (issue 23) at a tiny cache (B 1, KV 1k, 32/8 heads): the module's call per step, with
and without its value check of the lengths, against its kernels' GPU time and launches.
Usage: python scripts/host_overhead.py OUT.json [decode]   (decode: only the decode record)"""

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


def decode_setup():
    """The module's decode call (value check on and off) and its kernels launched directly."""
    from engine.kernels.attention_decode.launch import launch_decode
    from engine.runtime.device import sm_count

    sizes = dict(batch=1, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_kv=1024, head_dim=128,
                 head_dim_v=128)
    mod = VARIANTS["softmax"].build(**sizes, dtype=torch.bfloat16, backend="tilelang")
    inp = VARIANTS["softmax"].make_inputs(**sizes, dtype=torch.bfloat16, device="cuda")
    q, k, v = inp["q"], inp["k"], inp["v"]
    lens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    dk = mod.decode_kernels(0, 0, sm_count(q.device))

    def call(check: bool):
        """The step with the value check on or off (set here, not per step: setting a
        module attribute is itself a few us)."""
        mod.check_cache_values = check

        def step():
            with torch.no_grad():
                mod(q, k, v, cache_seqlens=lens)
        return step

    return call, (lambda: launch_decode(dk, q, k, v, {}, lens))


def kernels_busy_us(fn, n: int = 200) -> float:
    """The GPU's busy time per call of `fn` (the sum of its kernels' durations, from the
    profiler): back-to-back event timing of a host-bound step measures the host instead."""
    from attnbench.kernel_profile import kernel_events

    return sum(dur for _, _, dur in kernel_events(fn, n, 10)) / n


def decode_record() -> dict:
    call, kernels = decode_setup()
    rec = {"shape": "decode B1 KV1024 Hq32 Hkv8 D128 bf16 softmax",
           "module_checked_us": per_call_us(call(True)), "module_us": per_call_us(call(False)),
           "kernels_launch_us": per_call_us(kernels), "kernels_gpu_ms": gpu_ms(kernels),
           "kernels_busy_us": kernels_busy_us(kernels)}
    rec["module_minus_kernel_us"] = rec["module_us"] - rec["kernels_busy_us"]
    rec["profile"] = profile(call(False))
    return rec


def main(out: str) -> None:
    if len(sys.argv) > 2 and sys.argv[2] == "decode":
        result = {"device": torch.cuda.get_device_name(), "decode": decode_record()}
        print(json.dumps({k: v for k, v in result["decode"].items() if k != "profile"},
                         indent=1))
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        return
    fwd, fwd_bwd, kernel = setup(1, 128, 8, 2, 64)
    tiny = {"shape": "B1 S128 Hq8 Hkv2 D64 bf16 causal",
            "forward_us": per_call_us(fwd), "forward_backward_us": per_call_us(fwd_bwd, 1000),
            "kernel_launch_us": per_call_us(kernel), "forward_gpu_ms": gpu_ms(kernel)}
    tiny["profile"] = profile(fwd)
    fwd, fwd_bwd, kernel = setup(2, 4096, 32, 8, 128)
    big = {"shape": "B2 S4096 Hq32 Hkv8 D128 bf16 causal (llama3-8b)",
           "module_forward_ms": gpu_ms(fwd), "kernel_forward_ms": gpu_ms(kernel)}
    big["module_over_kernel"] = big["module_forward_ms"] / big["kernel_forward_ms"]
    result = {"device": torch.cuda.get_device_name(), "tiny": tiny, "llama3_8b_4k": big,
              "decode": decode_record()}
    print(json.dumps(result, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
