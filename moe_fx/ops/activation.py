"""What happens between an expert's two GEMMs: :class:`ExpertActivation` and the activation functions.

Shared by the op's contract (:mod:`moe_fx.ops.experts`, :mod:`moe_fx.ops.checks`), the graph passes
(which read a spec from the graph) and the lowering (which compiles one into its kernels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "GATE_UP_LAYOUTS", "ExpertActivation"]

#: Activation functions the op understands, by name (applied to the gate, or to ``h`` when non-gated).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}
#: How gate and up rows are laid out in a gated ``w13``.
GATE_UP_LAYOUTS = ("halves", "interleaved")


@dataclass(frozen=True)
class ExpertActivation:
    """What happens between an expert's two GEMMs (the op's activation arguments as one value).

    Attributes:
        name: a key of :data:`ACTIVATIONS`.
        gated: ``act(gate) * (up + up_offset)`` on ``N1 = 2I`` columns, or ``act(h)`` on ``I``.
        gate_up_layout: ``"halves"`` or ``"interleaved"`` (gated only).
        alpha: ``silu(g) = g * sigmoid(alpha * g)``; 1 for every other activation.
        limit: clamp bound before the activation, or None.
        up_offset: added to ``up`` (GPT-OSS: 1).
    """

    name: str = "silu"
    gated: bool = True
    gate_up_layout: str = "halves"
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    @classmethod
    def of(cls, a: dict) -> ExpertActivation:
        """The activation of an op's bound arguments (``moe_fx::experts``, ``masked_experts``, ...: the schema's
        ``activation``, ``gated``, ``gate_up_layout``, ``alpha``, ``limit`` and ``up_offset``)."""
        return cls(a["activation"], a["gated"], a["gate_up_layout"], a["alpha"], a["limit"], a["up_offset"])

    def problems(self) -> list[str]:
        """Everything wrong with this spec (empty when valid)."""
        bad = []
        if self.name not in ACTIVATIONS:
            bad.append(f"unknown activation {self.name!r}; known: {sorted(ACTIVATIONS)}")
        if self.gate_up_layout not in GATE_UP_LAYOUTS:
            bad.append(f"unknown gate_up_layout {self.gate_up_layout!r}; known: {GATE_UP_LAYOUTS}")
        if self.alpha != 1.0 and self.name != "silu":
            bad.append(f"alpha={self.alpha} applies to 'silu' only, not {self.name!r}")
        if not math.isfinite(self.alpha):
            bad.append(f"alpha must be finite, got {self.alpha}")
        if self.limit is not None and not (self.limit > 0 and math.isfinite(self.limit)):
            bad.append(f"limit must be a positive finite number or None, got {self.limit}")
        if not self.gated and (self.up_offset != 0.0 or self.gate_up_layout != "halves"):
            bad.append("up_offset and gate_up_layout apply to gated experts only")
        return bad

    @property
    def is_plain(self) -> bool:
        """True for the classic gated forms (SwiGLU/GeGLU halves, no clamp, no offset, alpha 1)."""
        return self.gated and self.gate_up_layout == "halves" and self.alpha == 1.0 and self.limit is None \
            and self.up_offset == 0.0

    def columns(self, inter: int) -> int:
        """``N1``, the first GEMM's output width for intermediate size ``inter``."""
        return 2 * inter if self.gated else inter

    def act(self, g: torch.Tensor) -> torch.Tensor:
        """The activation alone, on fp32 ``g``."""
        if self.name == "silu":
            return g * torch.sigmoid(self.alpha * g)
        return ACTIVATIONS[self.name](g)

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., N1]`` first-GEMM output (fp32, biases added) -> ``[..., I]`` second-GEMM input."""
        if not self.gated:
            if self.limit is not None:
                h = h.clamp(-self.limit, self.limit)
            return self.act(h)
        if self.gate_up_layout == "interleaved":
            gate, up = h[..., 0::2], h[..., 1::2]
        else:
            gate, up = h.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.act(gate) * (up + self.up_offset)

    def describe(self) -> str:
        """Short text for reports: ``silu``, ``swiglu(alpha=1.702, limit=7, up+1, interleaved)``, ``relu2``."""
        if self.is_plain:
            return self.name
        extras = []
        if self.alpha != 1.0:
            extras.append(f"alpha={self.alpha:g}")
        if self.limit is not None:
            extras.append(f"limit={self.limit:g}")
        if self.up_offset:
            extras.append(f"up+{self.up_offset:g}")
        if self.gated and self.gate_up_layout != "halves":
            extras.append(self.gate_up_layout)
        head = f"gated {self.name}" if self.gated else f"{self.name} (not gated)"
        return head + (f"({', '.join(extras)})" if extras else "")
