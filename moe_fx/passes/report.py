"""What the passes found: one :class:`RegionReport` per candidate MoE region, matched or not."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["RegionReport"]


@dataclass
class RegionReport:
    """The outcome of looking at one candidate MoE region (a group of expert weights).

    Attributes:
        layer: module path of the experts (from Dynamo's ``nn_module_stack``) or the weight names.
        matched: whether the region was rewritten into a moe_fx op.
        form: how the experts were written (``grouped_mm``, ``batched_mm``, ``dense_bmm``,
            ``expert_loop``, ...), as far as it was recognised.
        family: the experts module class without its ``Experts`` suffix (``Mixtral``), or ``""``.
        num_experts, top_k, hidden, intermediate: E, K, H, I (0 where unknown).
        dtype: dtype of the hidden states.
        device: device type of the hidden states (``cpu``, ``cuda``).
        fp8: whether the expert weights are fp8 with block scales.
        activation: gated activation found (``silu``, ...).
        weights_on_input: True when routing weights scale the expert input (Llama 4 style).
        reason: why the region was not rewritten (empty when matched).
        kernel: the experts kernel the lowering picks for the op as traced (filled by explain from the
            lowering's own plan of the op node: :func:`moe_fx.lowering.experts.explain_experts`).
        layout: the row layout that kernel runs on (``"sorted"``, ``"masked"``, ``"reference"``).
        kernel_reasons: why the other kernels were not picked (and ``"layout"``: the plan of every
            token-count regime; ``"tiles"``: the Triton GEMM shapes never tuned on this GPU and the tiles
            they take instead).
        entry: for a rewritten region, which entry rewrites it: ``"any"`` (``torch.compile(model,
            backend="moe_fx")`` and ``moe_fx.compile``) or ``"moe_fx.compile"`` (a capture step patched
            the module before tracing; a backend never sees modules).
        verified: how a matched region was checked: ``"numerics"`` (the structure proves the form and the
            region itself, or a captured module's forward, run on random inputs, equals the op's reference) or
            ``"unverified"`` (``MoEConfig(verify="never")``: rewritten on its structure alone).
        tokens: the region's token count T as traced: ``"5"``, ``"symbolic (traced at 5)"`` when the graph
            is compiled for any T (``dynamic=True``, or automatic dynamic shapes after a recompile), or
            ``"data-dependent"`` (for a module captured before tracing: what explain reads from its op node); empty where unknown.
        probe: the numerical check's size, e.g. ``"T=14 x3"`` or ``"reduced T=32 of 2048 x3"`` (also
            set when the check ran and failed).
        probe_error: the largest relative error the check found (nan when none ran).
        warnings: what the user should know about a region beyond matched / not matched (weights
            that are copies, a request that cannot be honoured, ...).
        details: what the op computes beyond plain SwiGLU (activation variant, biases, identity experts,
            dense scores), empty for the plain form.
    """

    layer: str
    matched: bool = False
    form: str = ""
    family: str = ""
    num_experts: int = 0
    top_k: int = 0
    hidden: int = 0
    intermediate: int = 0
    dtype: str = ""
    device: str = ""
    fp8: bool = False
    activation: str = ""
    weights_on_input: bool = False
    reason: str = ""
    kernel: str = ""
    layout: str = ""
    kernel_reasons: dict[str, str] = field(default_factory=dict)
    entry: str = ""
    verified: str = ""
    tokens: str = ""
    probe: str = ""
    probe_error: float = float("nan")
    warnings: list[str] = field(default_factory=list)

    def verification(self) -> str:
        """How the region was checked, for explain: ``"T=14 x3, err 3e-07"``, ``"UNVERIFIED (...)"``."""
        if self.verified == "unverified":
            return "UNVERIFIED (rewritten on structure alone)"
        if self.probe:
            err = "" if math.isnan(self.probe_error) else f", err {self.probe_error:.1e}"
            return self.probe + err
        return "-"
    details: str = ""

    def one_line(self) -> str:
        """A single log line describing the outcome."""
        if self.matched:
            return (
                f"{self.layer}: matched {self.family or '-'}/{self.form} E={self.num_experts} K={self.top_k} "
                f"H={self.hidden} I={self.intermediate} {self.dtype} act={self.activation}"
                + (" weights_on_input" if self.weights_on_input else "")
                + (f" [{self.details}]" if self.details else "")
                + (f" kernel={self.kernel}" if self.kernel else "")
                + f" verified: {self.verification()}"
            )
        return f"{self.layer}: not matched ({self.form or 'unknown form'}): {self.reason}"
