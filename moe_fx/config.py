"""User-facing configuration of moe_fx (one dataclass; recipes are fields, not new verbs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["MoEConfig"]


@dataclass(frozen=True)
class MoEConfig:
    """How moe_fx rewrites and runs the MoE blocks of a model.

    Attributes:
        kernel: expert-GEMM kernel request: ``"auto"`` (the lowering picks: DeepGEMM, Triton, or the
            torch reference on CPU), ``"reference"``, ``"triton"`` or ``"deepgemm"``.
        quantize: ``None`` keeps the model's expert weights; ``"fp8"`` quantises bf16 expert weights
            once, at rewrite time, to fp8 e4m3 with 128x128 block scales.
        verify: how a matched region is checked before it is rewritten. ``"auto"`` (default): the region
            itself runs on random inputs whose routing reaches every expert and must equal the op's
            reference; at its own token count when that costs at most ``verify_max_flops``, else on a
            reduced problem of a few tokens (see :mod:`moe_fx.passes.probe_plan`). ``"always"``: at its
            own token count whatever it costs. ``"never"`` (an expert option): no numerical check at
            all; a region that matches structurally is rewritten even if it computes something else
            (a sigmoid GLU, an extra scale, ...), and the report and explain mark it "UNVERIFIED".
        verify_max_flops: the most flops one probe run at the region's own token count may cost on CPU
            weights (1000x that on an accelerator) under ``verify="auto"``; above it the probe runs a
            reduced problem instead (never no probe).
        enabled: ``False`` turns every pass off (the backend then behaves like plain Inductor).
        ep_group: process group for expert parallelism: ``None`` (no expert parallelism), ``"default"``
            (torch.distributed's default group), a ``ProcessGroup``, or a group's c10d name. Each rank
            then keeps only its ``E / world_size`` experts (``E % world_size != 0`` is an error at
            compile time) and every rank runs the model on its own tokens.
        max_tokens_per_rank: tokens per rank in one expert-parallel exchange (a *round*); it sizes the
            masked layout (``[E_local, max_tokens_per_rank * world_size, H]``) and DeepEP's buffer. A
            step with more tokens on some rank runs in rounds every rank agrees on (not inside CUDA
            graphs; see docs/ep.md).
        eplb: expert-parallel load balancing: count each expert's tokens on the device every step,
            map logical experts to physical copies at dispatch, and move experts between ranks when
            ``moe_fx.rebalance_experts()`` is called (or every ``eplb_interval`` calls). Costs a few
            fused index ops per layer and step (docs/ep.md).
        eplb_redundant_slots: extra physical experts per rank for copies of hot experts (``eplb``
            only); each costs one expert's weights of memory per rank and layer.
        eplb_interval: rebalance before every N-th call of a compiled graph (``eplb`` only); 0 means
            only when the user calls ``moe_fx.rebalance_experts()``.
        inductor_options: extra options handed to Inductor's ``compile_fx``.
    """

    kernel: Literal["auto", "reference", "triton", "deepgemm"] = "auto"
    quantize: Literal[None, "fp8"] = None
    verify: Literal["auto", "always", "never"] = "auto"
    verify_max_flops: float = 2e10
    enabled: bool = True
    ep_group: Any = None
    max_tokens_per_rank: int = 128
    eplb: bool = False
    eplb_redundant_slots: int = 0
    eplb_interval: int = 0
    inductor_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kernel not in ("auto", "reference", "triton", "deepgemm"):
            raise ValueError(f"MoEConfig.kernel must be auto/reference/triton/deepgemm, got {self.kernel!r}")
        if self.quantize not in (None, "fp8"):
            raise ValueError(f"MoEConfig.quantize must be None or 'fp8', got {self.quantize!r}")
        if self.verify not in ("auto", "always", "never"):
            raise ValueError(f"MoEConfig.verify must be auto/always/never, got {self.verify!r}")
        ep = self.ep_group
        if ep is not None and not isinstance(ep, str) and not hasattr(ep, "group_name"):
            raise TypeError(  # a ProcessGroup has a c10d group_name; the EP ops pass groups by that name
                f"MoEConfig.ep_group must be None, 'default', a ProcessGroup or a group name, got {type(self.ep_group)}"
            )
        if self.max_tokens_per_rank <= 0:
            raise ValueError(f"MoEConfig.max_tokens_per_rank must be positive, got {self.max_tokens_per_rank}")
        if not isinstance(self.eplb, bool):
            raise TypeError(f"MoEConfig.eplb must be a bool, got {type(self.eplb).__name__}")
        for name in ("eplb_redundant_slots", "eplb_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MoEConfig.{name} must be an int >= 0, got {value!r}")
            if value and not self.eplb:
                raise ValueError(f"MoEConfig.{name}={value} needs eplb=True")
