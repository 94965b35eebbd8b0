"""The expert activation as kernel arguments: the codes and constants that the activation kernel and the
GEMM epilogue (``masked_gemm_kernel``'s ACT_FUSED) both take, from one :class:`moe_fx.ops.ExpertActivation`.

A module of its own so that the GEMM wrappers and the activation wrapper import it without importing
each other.
"""

from __future__ import annotations

from moe_fx.ops import ExpertActivation

__all__ = ["ACT_CODES", "epilogue_args"]

#: Activation names (those of :data:`moe_fx.ops.ACTIVATIONS`) to the kernel's code.
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}


def epilogue_args(spec: ExpertActivation, name: str = "expert_activation") -> dict[str, object]:
    """The kernel arguments that make a GEMM apply ``spec`` in its epilogue (``masked_gemm_kernel``'s
    ACT_FUSED); the activation kernel takes the same codes. Raises ``ValueError`` for a spec no kernel runs."""
    bad = spec.problems()
    if bad or spec.name not in ACT_CODES:
        raise ValueError(f"{name}: {'; '.join(bad) or f'no kernel for activation {spec.name!r}'}")
    return {"ACT_FUSED": True, "ACT": ACT_CODES[spec.name], "GATED": spec.gated,
            "INTERLEAVED": spec.gate_up_layout == "interleaved", "HAS_LIMIT": spec.limit is not None,
            "alpha": float(spec.alpha), "limit": float(spec.limit or 0.0), "up_offset": float(spec.up_offset)}
