"""User-facing configuration of moe_fx (one dataclass; recipes are fields, not new verbs).

Every field is validated when a :class:`MoEConfig` is built: a wrong type is a ``TypeError`` and a bad
value a ``ValueError``, both naming the field. Each field names its check in its ``metadata`` (one small
checker per kind of field: :func:`choice`, :func:`flag`, :func:`positive_number`, :func:`int_at_least`,
:func:`str_keyed_dict`, :func:`process_group`), so a new field is one line plus its check; a field that
only means something with a flag on says so (``int_at_least(0, requires="eplb")``), checked after all
fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any, Literal

__all__ = ["MoEConfig", "choice", "flag", "int_at_least", "positive_number", "process_group", "str_keyed_dict"]

#: A field check: ``check(name, value)`` raises ``TypeError`` / ``ValueError`` naming ``name``.
Check = Callable[[str, Any], None]


def choice(*allowed: object) -> dict[str, Check]:
    """Field metadata: the value is one of ``allowed`` (strings, or None)."""
    kinds = tuple({type(a) for a in allowed})
    shown = "/".join(repr(a) for a in allowed)

    def check(name: str, value: Any) -> None:
        if not isinstance(value, kinds):
            raise TypeError(f"{name} must be one of {shown}, got {type(value).__name__} {value!r}")
        if value not in allowed:
            raise ValueError(f"{name} must be one of {shown}, got {value!r}")

    return {"check": check}


def flag() -> dict[str, Check]:
    """Field metadata: the value is a ``bool`` (``"no"`` or ``0`` are refused, not read as truth values)."""

    def check(name: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")

    return {"check": check}


def _real(name: str, value: Any, want: str) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")


def positive_number() -> dict[str, Check]:
    """Field metadata: a finite real number > 0 (an int or a float)."""

    def check(name: str, value: Any) -> None:
        _real(name, value, "a positive number")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    return {"check": check}


def int_at_least(low: int, *, requires: str | None = None) -> dict[str, Any]:
    """Field metadata: an integer >= ``low``; ``requires`` names a flag field that a non-zero value needs."""

    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise TypeError(f"{name} must be an int >= {low}, got {type(value).__name__} {value!r}")
        if value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    return {"check": check, "requires": requires}


def str_keyed_dict() -> dict[str, Check]:
    """Field metadata: a ``dict`` whose keys are strings (Inductor config names)."""

    def check(name: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict (use {{}} for none), got {type(value).__name__} {value!r}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{name} keys must be strings, got {bad[0]!r}")

    return {"check": check}


def process_group() -> dict[str, Check]:
    """Field metadata: None, ``"default"``, a c10d group name, or a ``ProcessGroup``."""

    def check(name: str, value: Any) -> None:
        if value is None or hasattr(value, "group_name"):  # a ProcessGroup has a c10d group_name
            return
        if not isinstance(value, str):
            raise TypeError(
                f"{name} must be None, 'default', a ProcessGroup or a group name, got {type(value).__name__}"
            )
        if not value:
            raise ValueError(f"{name} must be 'default' or a c10d group name, got ''")

    return {"check": check}


@dataclass(frozen=True)
class MoEConfig:
    """How moe_fx rewrites and runs the MoE blocks of a model.

    Every field is checked when the config is built (``TypeError`` for a wrong type, ``ValueError`` for a
    bad value, each naming the field).

    Attributes:
        kernel: expert-GEMM kernel request: ``"auto"`` (the lowering picks: DeepGEMM, Triton, or the
            torch reference on CPU), ``"reference"``, ``"triton"`` or ``"deepgemm"``.
        quantize: ``None`` keeps the model's expert weights; ``"fp8"`` quantises bf16 expert weights
            at rewrite time to fp8 e4m3 with 128x128 block scales, and again whenever the bf16 weights
            change (what is tracked: :mod:`moe_fx.passes.expert_storage`).
        verify: how a matched region is checked before it is rewritten. ``"auto"`` (default): the region
            itself runs on random inputs whose routing reaches every expert and must equal the op's
            reference; at its own token count when that costs at most ``verify_max_flops``, else on a
            reduced problem of a few tokens (see :mod:`moe_fx.verify.probe_plan`). ``"always"``: at its
            own token count whatever it costs. ``"never"`` (an expert option): no numerical check at
            all; a region whose structure proves the form is rewritten with its routing plumbing
            unchecked (docs/soundness.md), and the report and explain mark it "UNVERIFIED".
        verify_max_flops: the most flops one probe run at the region's own token count may cost on CPU
            weights (1000x that on an accelerator) under ``verify="auto"``; above it the probe runs a
            reduced problem instead (never no probe). A finite number > 0.
        enabled: ``False`` turns every pass off (the backend then behaves like plain Inductor). A bool.
        ep_group: process group for expert parallelism: ``None`` (no expert parallelism), ``"default"``
            (torch.distributed's default group), a ``ProcessGroup``, or a group's c10d name. Each rank
            then keeps only its ``E / world_size`` experts (``E % world_size != 0`` is an error at
            compile time) and every rank runs the model on its own tokens.
        max_tokens_per_rank: tokens per rank in one expert-parallel exchange (a *round*); it sizes the
            masked layout (``[E_local, max_tokens_per_rank * world_size, H]``) and DeepEP's buffer. A
            step with more tokens on some rank runs in rounds every rank agrees on (not inside CUDA
            graphs; see docs/ep.md). An int >= 1.
        eplb: expert-parallel load balancing: count each expert's tokens on the device every step,
            map logical experts to physical copies at dispatch, and move experts between ranks when
            ``moe_fx.rebalance_experts()`` is called (or every ``eplb_interval`` calls). Costs a few
            fused index ops per layer and step (docs/ep.md). A bool.
        eplb_redundant_slots: extra physical experts per rank for copies of hot experts (``eplb``
            only); each costs one expert's weights of memory per rank and layer. An int >= 0.
        eplb_interval: rebalance before every N-th call of a compiled graph (``eplb`` only); 0 means
            only when the user calls ``moe_fx.rebalance_experts()``. An int >= 0.
        inductor_options: extra options handed to Inductor's ``compile_fx`` (a dict keyed by option name).
    """

    kernel: Literal["auto", "reference", "triton", "deepgemm"] = field(
        default="auto", metadata=choice("auto", "reference", "triton", "deepgemm"))
    quantize: Literal[None, "fp8"] = field(default=None, metadata=choice(None, "fp8"))
    verify: Literal["auto", "always", "never"] = field(default="auto", metadata=choice("auto", "always", "never"))
    verify_max_flops: float = field(default=2e10, metadata=positive_number())
    enabled: bool = field(default=True, metadata=flag())
    ep_group: Any = field(default=None, metadata=process_group())
    max_tokens_per_rank: int = field(default=128, metadata=int_at_least(1))
    eplb: bool = field(default=False, metadata=flag())
    eplb_redundant_slots: int = field(default=0, metadata=int_at_least(0, requires="eplb"))
    eplb_interval: int = field(default=0, metadata=int_at_least(0, requires="eplb"))
    inductor_options: dict[str, Any] = field(default_factory=dict, metadata=str_keyed_dict())

    def __post_init__(self) -> None:
        for f in fields(self):
            check = f.metadata.get("check")
            if check is None:  # every field says how it is checked (tests/test_config.py holds it to that)
                raise TypeError(f"MoEConfig.{f.name} has no check in its field metadata")
            check(f"MoEConfig.{f.name}", getattr(self, f.name))
        for f in fields(self):  # options that only mean something with another one on
            needs, value = f.metadata.get("requires"), getattr(self, f.name)
            if needs is not None and value and not getattr(self, needs):
                raise ValueError(f"MoEConfig.{f.name}={value!r} needs {needs}=True")
