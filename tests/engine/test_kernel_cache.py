"""The module owns its kernels: a typed KernelCache keyed by the request (spec, problem, dtype,
options), so that a changed option builds new kernels and nothing else writes module state."""

from __future__ import annotations

import torch

from engine.plan.config import KernelConfig
from engine.runtime.kernel_cache import KernelCache
from engine.variants import VARIANTS

SIZES = dict(batch=1, heads_q=4, heads_kv=2, seqlen_q=512, seqlen_kv=512, head_dim=128,
             head_dim_v=128)


def _mod(name="softmax_causal", **kw):
    return VARIANTS[name].build(**SIZES, dtype=torch.bfloat16, backend="tilelang", **kw)


def test_kernels_are_built_once_per_request():
    mod = _mod()
    fk = mod.forward_kernel()
    assert mod.forward_kernel() is fk
    assert mod.backward_kernels() is mod.backward_kernels()
    assert mod.backward_kernels(deterministic=True) is not mod.backward_kernels()
    assert isinstance(mod.kernel_cache, KernelCache)
    assert not {"_kernels", "_bwd_kernels", "_tune_checked"} & set(vars(mod))


def test_a_changed_option_is_a_new_request():
    mod = _mod()
    default = mod.forward_kernel()
    mod.config = KernelConfig(64, 64, 2, 128)
    assert mod.forward_kernel().config == KernelConfig(64, 64, 2, 128)
    assert "config M64_N64" in mod.kernel_source
    mod.dynamic_shapes = True
    assert mod.forward_kernel().shape.dynamic and "T.dynamic" in mod.kernel_source
    mod.config, mod.dynamic_shapes = None, False
    assert mod.forward_kernel() is default
    mod.deterministic = True
    assert mod.backward_kernels().deterministic


def test_clear_drops_the_built_kernels():
    mod = _mod()
    fk = mod.forward_kernel()
    mod.kernel_cache.clear()
    assert mod.forward_kernel() is not fk and mod.forward_kernel().source == fk.source


def test_kernel_sources_follow_the_modes():
    mod = _mod()
    assert mod.kernel_sources() == [mod.kernel_source]
    both = mod.kernel_sources(("fwd", "bwd"))
    assert both[0] == mod.kernel_source and both[1:] == mod.backward_kernels().sources()
