"""Design probe for issue 20's D = 256 backward (results/NOTES.md 70), not engine code: a
standalone TileLang backward of plain softmax attention (no mask) with the head dim of dK/dV
split across two consumer warpgroups (FullCol), P^T and dS^T through shared memory, dQ in two
128-column halves added by fp32 atomics. On a GPU it checks dq, dk, dv against torch (float32)
and times the kernel against SDPA's cuDNN and flash backward at the same shape.

Usage (GPU host): python scripts/d256_backward_probe.py [S] [stages]"""

from __future__ import annotations

import sys
import time

import tilelang
import tilelang.language as T
import torch
import torch.nn.functional as F

LOG2E = 1.4426950408889634


def backward_kernel(B: int, H: int, S: int, D: int = 256, bN: int = 64, bM: int = 64,
                    stages: int = 2, dt: str = "bfloat16"):
    scale = D ** -0.5 * LOG2E
    half = D // 2

    @T.prim_func
    def main(Q: T.Tensor((B, S, H, D), dt), K: T.Tensor((B, S, H, D), dt),
             V: T.Tensor((B, S, H, D), dt), dO: T.Tensor((B, S, H, D), dt),
             LSE2: T.Tensor((B, H, S), "float32"), Delta: T.Tensor((B, H, S), "float32"),
             dQ: T.Tensor((B, S, H, D), "float32"), dK: T.Tensor((B, S, H, D), dt),
             dV: T.Tensor((B, S, H, D), dt)):
        with T.Kernel(S // bN, H, B, threads=256) as (bx, by, bz):
            K_s = T.alloc_shared((bN, D), dt)
            V_s = T.alloc_shared((bN, D), dt)
            Q_s = T.alloc_shared((bM, D), dt)
            dO_s = T.alloc_shared((bM, D), dt)
            pT_s = T.alloc_shared((bN, bM), dt)
            dsT_s = T.alloc_shared((bN, bM), dt)
            lse_s = T.alloc_shared((bM,), "float32")
            delta_s = T.alloc_shared((bM,), "float32")
            sT = T.alloc_fragment((bN, bM), "float32")
            dpT = T.alloc_fragment((bN, bM), "float32")
            dv = T.alloc_fragment((bN, D), "float32")
            dk = T.alloc_fragment((bN, D), "float32")
            dq = T.alloc_fragment((bM, half), "float32")
            T.copy(K[bz, bx * bN:(bx + 1) * bN, by, :], K_s)
            T.copy(V[bz, bx * bN:(bx + 1) * bN, by, :], V_s)
            T.clear(dv)
            T.clear(dk)
            for k in T.Pipelined(S // bM, num_stages=stages):
                T.copy(Q[bz, k * bM:(k + 1) * bM, by, :], Q_s)
                T.copy(dO[bz, k * bM:(k + 1) * bM, by, :], dO_s)
                T.copy(LSE2[bz, by, k * bM:(k + 1) * bM], lse_s)
                T.copy(Delta[bz, by, k * bM:(k + 1) * bM], delta_s)
                T.gemm(K_s, Q_s, sT, transpose_B=True, policy=T.GemmWarpPolicy.FullCol,
                       clear_accum=True)
                T.gemm(V_s, dO_s, dpT, transpose_B=True, policy=T.GemmWarpPolicy.FullCol,
                       clear_accum=True)
                for i, j in T.Parallel(bN, bM):
                    sT[i, j] = T.exp2(sT[i, j] * scale - lse_s[j])
                T.copy(sT, pT_s)
                for i, j in T.Parallel(bN, bM):
                    dpT[i, j] = sT[i, j] * (dpT[i, j] - delta_s[j]) * (D ** -0.5)
                T.copy(dpT, dsT_s)
                T.gemm(pT_s, dO_s, dv, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(dsT_s, Q_s, dk, policy=T.GemmWarpPolicy.FullCol)
                for h in T.serial(2):
                    T.gemm(dsT_s, K_s[:, h * half:(h + 1) * half], dq, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                    for i, j in T.Parallel(bM, half):
                        T.atomic_add(dQ[bz, k * bM + i, by, h * half + j], dq[i, j])
            for i, j in T.Parallel(bN, D):
                dV[bz, bx * bN + i, by, j] = T.Cast(dt, dv[i, j])
                dK[bz, bx * bN + i, by, j] = T.Cast(dt, dk[i, j])

    return tilelang.compile(main, target={"kind": "cuda", "arch": "sm_90a"},
                            pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})


def gpu_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main(S: int = 4096, stages: int = 2) -> None:
    B, H, D = 1, 16, 256
    t0 = time.time()
    kernel = backward_kernel(B, H, S, D, stages=stages)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", generator=gen).bfloat16()
                   for _ in range(4))
    leaves = [t.float().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) * D ** -0.5
    lse = scores.logsumexp(-1)
    o = scores.softmax(-1) @ leaves[2]
    ref = torch.autograd.grad(o, leaves, do.float().transpose(1, 2))
    delta = (o.detach() * do.float().transpose(1, 2)).sum(-1)
    dq = torch.zeros(B, S, H, D, device="cuda")
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, do, (lse * LOG2E).contiguous(), delta.contiguous(), dq, dk, dv)
    kernel(*args)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, strict=True):
        w = want.transpose(1, 2)
        err = ((got.float() - w).norm() / w.norm()).item()
        print(f"{name}: rel err {err:.2e}", flush=True)
    flops = 2.5 * 4 * B * H * S * S * D  # the backward's five S x S x D products
    ms = gpu_ms(lambda: (dq.zero_(), kernel(*args)))
    print(f"probe: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
        try:
            with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend,
                                                        backend)):
                out = F.scaled_dot_product_attention(qt, kt, vt)
                ms = gpu_ms(lambda out=out: torch.autograd.grad(out, (qt, kt, vt),
                                                                do.transpose(1, 2),
                                                                retain_graph=True))
            print(f"sdpa {backend}: backward {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
        except RuntimeError as exc:
            print(f"sdpa {backend}: {str(exc)[:120]}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
