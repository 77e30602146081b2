"""The kernel kinds, each named once: the tuner, tune files, `tune=True`, precompile and the
harness's engine implementations find a kind here, never by spelling its name.

A kind's name is the stem of its search space (search_spaces/<name>.toml) and of its tune
files (results/tune/<gpu>/<name>.json). See engine/kernels/README.md to add one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.kernels.attention_bwd import launch as bwd_launch
from engine.kernels.attention_bwd import plan as bwd_plan
from engine.kernels.attention_bwd.codegen import generate_backward
from engine.kernels.attention_decode import launch as dec_launch
from engine.kernels.attention_decode import plan as dec_plan
from engine.kernels.attention_decode.codegen import generate_split
from engine.kernels.attention_fwd import launch as fwd_launch
from engine.kernels.attention_fwd import plan as fwd_plan
from engine.kernels.attention_fwd.codegen import generate_forward
from engine.kernels.linear_bwd import launch as lin_bwd_launch
from engine.kernels.linear_bwd.codegen import generate_dqk
from engine.kernels.linear_fwd import launch as lin_fwd_launch
from engine.kernels.linear_fwd import plan as lin_plan
from engine.kernels.linear_fwd.codegen import generate_output
from engine.kernels.linear_fwd.tune_shape import default_at
from engine.kernels.linear_step import launch as step_launch
from engine.kernels.linear_step import plan as step_plan
from engine.kernels.linear_step.codegen import generate_step
from engine.plan.config import KernelConfig
from engine.reference import executor
from engine.reference.decode import decode_forward
from engine.reference.linear import chunked, naive_recurrence

SEARCH_SPACES = Path(__file__).resolve().parents[2] / "search_spaces"


@dataclass(frozen=True)
class KernelKind:
    name: str
    # The problems it serves (a suite case's `kind`: attention, decode, linear) and the pass a
    # tuning study of it times ("fwd", or "bwd": forward and backward): (family, mode) picks it.
    family: str
    mode: str
    config_type: type
    # The front end's argument that fixes this kind's config (AttentionEngine's, or
    # LinearAttentionEngine's for the linear kinds); tuning trials set it.
    config_arg: str
    # (cfg, head_dim, head_dim_v, elem_bytes) -> every reason cfg is invalid (empty: valid).
    problems: Callable[..., list[str]]
    # (head_dim, head_dim_v, elem_bytes, spec) -> the config used when no tune file has one
    # (ValueError: none is valid).
    default: Callable[..., Any]
    generate: Callable[..., Any]  # the main kernel's generator -> GeneratedKernel
    # (spec, shape, cfg, ...) -> the kind's kernels, not compiled; the linear kinds have no
    # spec (their mods run as a torch pre-pass): (LinearShape, cfg)
    build: Callable[..., Any]
    launch: Callable[..., Any]  # runs built kernels on tensors
    reference: Callable[..., Any]  # what every kernel of the kind is tested against
    # (tune-file shape, dtype) -> the config the engine runs at that shape when no tune file
    # has one, where it depends on more than the head dims (None: `default`)
    at_shape: Callable[[dict, str], Any] | None = None
    # Whether the engine runs a tune-file entry of the nearest tuned shape when the exact one
    # is missing (the linear kinds: exact shapes only, engine.runtime.linear_tuning).
    nearest: bool = True
    # Whether `default` also takes the lengths (seqlen_q=..., seqlen_kv=...): the forward's
    # short rows take the least padded tile, its short keys one block.
    default_rows: bool = False

    @property
    def search_space(self) -> Path:
        return SEARCH_SPACES / f"{self.name}.toml"


ATTENTION_FWD = KernelKind(
    name="attention_fwd", family="attention", mode="fwd", config_type=KernelConfig, config_arg="config",
    problems=fwd_plan.config_problems, default=fwd_plan.default_forward_config,
    generate=generate_forward, build=fwd_launch.build_forward, launch=fwd_launch.launch_forward,
    reference=executor.forward, default_rows=True,
)
ATTENTION_BWD = KernelKind(
    name="attention_bwd", family="attention", mode="bwd", config_type=KernelConfig,
    config_arg="backward_config",
    problems=bwd_plan.backward_config_problems, default=bwd_plan.default_backward_config,
    generate=generate_backward, build=bwd_launch.build_backward,
    launch=bwd_launch.launch_backward, reference=executor.backward,
)

ATTENTION_DECODE = KernelKind(
    name="attention_decode", family="decode", mode="fwd", config_type=dec_plan.DecodeConfig,
    config_arg="decode_config",
    problems=dec_plan.config_problems, default=dec_plan.default_decode_config,
    generate=generate_split, build=dec_launch.build_decode, launch=dec_launch.launch_decode,
    reference=decode_forward,
)

# The chunked linear attention (LinearAttentionEngine). A linear_bwd study times forward and
# backward at one config: its entry is the pair a training step runs (linear_tuning.pick).
LINEAR_FWD = KernelKind(
    name="linear_fwd", family="linear", mode="fwd", config_type=lin_plan.LinearConfig,
    config_arg="config", problems=lin_plan.config_problems,
    default=lin_plan.default_linear_config, generate=generate_output,
    build=lin_fwd_launch.build_forward, launch=lin_fwd_launch.launch_forward,
    reference=chunked, at_shape=default_at, nearest=False,
)
LINEAR_BWD = KernelKind(
    name="linear_bwd", family="linear", mode="bwd", config_type=lin_plan.LinearConfig,
    config_arg="backward_config", problems=lin_plan.config_problems,
    default=lin_plan.default_linear_config, generate=generate_dqk,
    build=lin_bwd_launch.build_backward, launch=lin_bwd_launch.launch_backward,
    reference=chunked, at_shape=default_at, nearest=False,
)

# The recurrent step: a few positions against the state (generation), no gradient.
LINEAR_STEP = KernelKind(
    name="linear_step", family="linear", mode="step", config_type=step_plan.StepConfig,
    config_arg="step_config", problems=step_plan.config_problems,
    default=step_plan.default_step_config, generate=generate_step,
    build=step_launch.build_step, launch=step_launch.launch_step, reference=naive_recurrence,
    nearest=False,
)

KINDS: dict[str, KernelKind] = {k.name: k for k in (ATTENTION_FWD, ATTENTION_BWD,
                                                    ATTENTION_DECODE, LINEAR_FWD, LINEAR_BWD,
                                                    LINEAR_STEP)}


def get_kind(name: str) -> KernelKind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"kernel kind {name!r}: expected one of {sorted(KINDS)}") from None


def kind_for(family: str, mode: str) -> KernelKind:
    """The kind a tuning study of a `family` problem in `mode` tunes."""
    for kind in KINDS.values():
        if (kind.family, kind.mode) == (family, mode):
            return kind
    have = sorted((k.family, k.mode) for k in KINDS.values())
    raise ValueError(f"family={family!r}, mode={mode!r}: no kernel kind; have {have}")
