import math

import pytest
import torch

from attnbench import metrics


def test_forward_flops_hand_computed():
    # B2 H4 S128 D64: 2 * 2*4*128*128 * (64 + 64) = 33_554_432
    assert metrics.attention_flops(2, 4, 128, 128, 64, 64, "fwd") == 33_554_432
    # Dv != D: 2 * 1*1*10*20 * (192 + 128) = 128_000
    assert metrics.attention_flops(1, 1, 10, 20, 192, 128, "fwd") == 128_000


def test_backward_is_2_5x_forward_at_equal_dims_and_sum_for_fwd_bwd():
    f = metrics.attention_flops(8, 32, 4096, 4096, 128, 128, "fwd")
    assert f == pytest.approx(4 * 8 * 32 * 4096**2 * 128)
    b = metrics.attention_flops(8, 32, 4096, 4096, 128, 128, "bwd")
    assert b == pytest.approx(2.5 * f)
    assert metrics.attention_flops(8, 32, 4096, 4096, 128, 128, "fwd+bwd") == pytest.approx(3.5 * f)
    # D 128, Dv 256: bwd = 2*pairs*(3*128 + 2*256) = 2*pairs*896
    assert metrics.attention_flops(1, 1, 4, 4, 128, 256, "bwd") == 2 * 16 * 896
    with pytest.raises(ValueError, match="mode must be one of"):
        metrics.attention_flops(1, 1, 1, 1, 1, 1, "sideways")


class Window:
    def unmasked_fraction(self, sq, skv):
        return 0.3


def test_unmasked_fraction_conventions():
    assert metrics.unmasked_fraction(None, "none", 10, 10) == 1.0
    assert metrics.unmasked_fraction(None, "causal", 7, 7) == 0.5  # FlashAttention's convention
    assert metrics.unmasked_fraction(Window(), "sliding_window", 10, 10) == 0.3
    causal = metrics.attention_flops(8, 32, 4096, 4096, 128, 128, "fwd", 0.5)
    assert causal == pytest.approx(2 * 8 * 32 * 4096**2 * 128)


def test_tflops_mfu_speedup():
    # 989e12 FLOPs in 1 s = 989 TFLOP/s = 100% of an H100 SXM
    assert metrics.tflops(989e12, 1000.0) == pytest.approx(989.0)
    assert metrics.mfu(494.5, "NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(0.5)
    assert metrics.peak_tflops("NVIDIA H100 PCIe", "float16") == 756.0
    assert math.isnan(metrics.mfu(10.0, "cpu", "float32"))
    assert metrics.speedup(2.0, 1.0) == 2.0
    assert math.isnan(metrics.speedup(None, 1.0))
    assert math.isnan(metrics.tflops(1.0, math.nan))


def test_errors_relative_and_nan():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 8, generator=g)
    noise = torch.randn(4, 8, generator=g)
    out = ref + 1e-3 * noise
    rel, mx = metrics.errors(out, ref)
    assert rel == pytest.approx(1e-3 * noise.norm().item() / ref.norm().item(), rel=1e-4)
    assert mx == pytest.approx(1e-3 * noise.abs().max().item(), rel=1e-3)
    bad = out.clone()
    bad[1, 2] = float("nan")
    assert all(math.isnan(x) for x in metrics.errors(bad, ref))
    with pytest.raises(ValueError, match="shape"):
        metrics.errors(out[:2], ref)
