"""Tiny MoE models for the demo, the tests and the benchmarks (random weights, nothing downloaded).

Two kinds:

* transformers 5.x language models from small configs: :func:`tiny_hf_model` for the families
  ``"mixtral"``, ``"qwen3_moe"`` and ``"deepseek_v3"``;
* user-written MoE blocks in the forms the pass must recognise: :class:`TitanGroupedMoE`
  (torchtitan-like sort-and-permute with ``torch._grouped_mm``), :class:`DenseBmmMoE` (a dense
  ``bmm`` over all experts) and :class:`LoopMoE` (a fixed ``range(E)`` loop over an
  ``nn.ModuleList`` of SwiGLU experts, the transformers 4.x / OLMoE shape).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DENSE_MATCHING_VARIANTS",
    "DENSE_VARIANTS",
    "HF_FAMILIES",
    "OTHER_HF_FAMILIES",
    "DenseBmmMoE",
    "LoopMoE",
    "SwiGLUExpert",
    "TitanGroupedMoE",
    "randomise_weights",
    "tiny_hf_config",
    "tiny_hf_model",
]

HF_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
#: More transformers families: Qwen2-MoE and OLMoE are matched; GPT-OSS (clamped, interleaved, biased experts)
#: and Llama 4 (dense sigmoid scores on the expert input) are left untouched.
OTHER_HF_FAMILIES = ("qwen2_moe", "olmoe", "gpt_oss", "llama4")


def tiny_hf_config(
    family: str,
    *,
    num_layers: int = 2,
    hidden: int = 32,
    intermediate: int = 16,
    num_experts: int = 8,
    top_k: int = 2,
    experts_implementation: str = "grouped_mm",
    vocab: int = 128,
    **overrides: Any,
):
    """Build a small transformers config of ``family`` (one of :data:`HF_FAMILIES`)."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            intermediate_size=intermediate, num_local_experts=num_experts, num_experts_per_tok=top_k, **common
        )
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=4 * intermediate,
            moe_intermediate_size=intermediate,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            head_dim=hidden // 4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            intermediate_size=4 * intermediate,
            moe_intermediate_size=intermediate,
            n_routed_experts=num_experts,
            num_experts_per_tok=top_k,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=0,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **{**common, "num_key_value_heads": 4},
        )
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=4 * intermediate, moe_intermediate_size=intermediate,
            shared_expert_intermediate_size=2 * intermediate, num_experts=num_experts, num_experts_per_tok=top_k,
            **common,
        )
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(
            intermediate_size=intermediate, num_experts=num_experts, num_experts_per_tok=top_k, **common
        )
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            intermediate_size=intermediate, num_local_experts=num_experts, num_experts_per_tok=top_k,
            head_dim=hidden // 4, layer_types=["full_attention"] * num_layers, **common,
        )
    elif family == "llama4":
        cfg = transformers.Llama4TextConfig(
            intermediate_size=intermediate, intermediate_size_mlp=2 * intermediate, num_local_experts=num_experts,
            num_experts_per_tok=1, head_dim=hidden // 4, interleave_moe_layer_step=1, **common,
        )
    else:
        raise ValueError(f"unknown family {family!r}; known: {HF_FAMILIES + OTHER_HF_FAMILIES}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    if family != "llama4":  # Llama 4 has one experts implementation only
        cfg._experts_implementation = experts_implementation
    return cfg


def tiny_hf_model(family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: Any) -> nn.Module:
    """A randomly initialised tiny causal LM of ``family`` in eval mode (see :func:`tiny_hf_config`).

    DeepSeek-V3's router bias starts at zero in transformers; it is randomised here so that the
    selection-only correction bias is exercised.
    """
    import transformers

    cfg = tiny_hf_config(family, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    randomise_weights(model)
    return model.to(dtype).eval()


def randomise_weights(
    model: nn.Module, *, wide: tuple[str, ...] = ("gate",), biased: tuple[str, ...] = ("experts",)
) -> None:
    """Make every weight of a transformers model random and non-zero, in place.

    transformers initialises some routers, experts and biases with zeros or leaves them empty. Matrices
    get std 0.2 when 3-D or named with one of ``wide`` (routers, gates), else 0.05; 1-D biases named with
    one of ``biased`` get std 0.2 (GPT-OSS expert biases start at zero); DeepSeek-V3's selection-only
    correction bias gets U(0, 0.1).
    """
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.1)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2 if p.dim() == 3 or any(w in name for w in wide) else 0.05)
            elif name.endswith("bias") and any(w in name for w in biased):
                p.normal_(0.0, 0.2)


class SwiGLUExpert(nn.Module):
    """One SwiGLU expert: ``down(silu(gate(x)) * up(x))`` with separate bias-free linears."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _RoutedBlock(nn.Module):
    """Softmax top-k router shared by the user-written blocks; input ``[B, S, H]`` or ``[T, H]``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk: bool = True) -> None:
        super().__init__()
        self.hidden, self.num_experts, self.top_k, self.norm_topk = hidden, num_experts, top_k, norm_topk
        self.router = nn.Linear(hidden, num_experts, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class TitanGroupedMoE(_RoutedBlock):
    """torchtitan-like block: sort tokens by expert, ``torch._grouped_mm`` with offsets, scatter back.

    Weights are stored torchtitan-style, transposed for ``x @ w``: ``w13 [E, H, 2I]``, ``w2 [E, I, H]``.
    ``activation`` other than ``"silu"`` or ``weight_output=False`` make near-miss variants for tests.
    """

    def __init__(
        self,
        hidden: int = 32,
        inter: int = 16,
        num_experts: int = 8,
        top_k: int = 2,
        activation: str = "silu",
        weight_output: bool = True,
        sentinels: bool = False,
    ) -> None:
        super().__init__(hidden, num_experts, top_k)
        self.w13 = nn.Parameter(torch.randn(num_experts, hidden, 2 * inter) * 0.2)
        self.w2 = nn.Parameter(torch.randn(num_experts, inter, hidden) * 0.2)
        self.activation, self.weight_output, self.sentinels = activation, weight_output, sentinels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        weights, ids = self.route(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.histc(flat_ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        routed = x[order // self.top_k]
        if self.sentinels:
            # transformers >= 5.17 style expert-parallel sentinel handling (no-ops without EP).
            sorted_ids = flat_ids[order]
            mask = (sorted_ids >= self.num_experts).unsqueeze(-1)
            sorted_ids.clamp_(max=self.num_experts - 1)
            routed.masked_fill_(mask, 0.0)
        h = torch._grouped_mm(routed, self.w13, offs=offsets)
        if self.sentinels:
            h = h.masked_fill(mask, 0.0)
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate)
        y = torch._grouped_mm(act * up, self.w2, offs=offsets)
        if self.weight_output:
            y = y * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(y).index_copy(0, order, y)
        return out.view(-1, self.top_k, self.hidden).sum(dim=1).reshape(shape)


#: Near-miss variants of :class:`DenseBmmMoE` that the pass must leave untouched (all but "ok").
DENSE_VARIANTS = ("ok", "tanh", "clamp", "no_weight", "up_first", "weights_reused", "bias")
#: Variants of :class:`DenseBmmMoE` that compute a supported MoE differently (matched).
DENSE_MATCHING_VARIANTS = ("ok", "on_input", "relu")


class DenseBmmMoE(_RoutedBlock):
    """Every token through every expert with ``bmm``, combined with a dense ``[T, E]`` weight matrix.

    ``variant`` (one of :data:`DENSE_VARIANTS`) makes near misses: a ``tanh`` activation (none the op
    has), a ``clamp`` of the gate alone (the op's clamped SwiGLU also clamps up), ``no_weight`` (routing
    weights only select), ``up_first`` (halves of ``gate_up`` swapped), ``weights_reused`` (the expert
    weights also feed another output term), ``bias`` (an extra ``[E, 1, H]`` bias after the down
    projection). ``on_input`` (routing weights scale each expert's input, Llama 4 style) and ``relu``
    (a gated ReLU) are supported variants.
    """

    def __init__(
        self, hidden: int = 32, inter: int = 16, num_experts: int = 8, top_k: int = 2, variant: str = "ok"
    ) -> None:
        super().__init__(hidden, num_experts, top_k)
        if variant not in DENSE_VARIANTS + DENSE_MATCHING_VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; known: {DENSE_VARIANTS + DENSE_MATCHING_VARIANTS}")
        self.variant = variant
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * 0.2)
        self.down = nn.Parameter(torch.randn(num_experts, hidden, inter) * 0.2)
        self.bias = nn.Parameter(torch.randn(num_experts, 1, hidden) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, v = x.shape, self.variant
        x = x.reshape(-1, self.hidden)
        weights, ids = self.route(x)
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, ids, torch.ones_like(weights) if v == "no_weight" else weights)
        xe = x.unsqueeze(0).expand(self.num_experts, -1, -1)
        if v == "on_input":
            # Unselected experts see x * 0 and, bias-free, return 0: no output weighting needed.
            xe = xe * dense.t().unsqueeze(-1).to(x.dtype)
        h = torch.bmm(xe, self.gate_up.transpose(1, 2))
        gate, up = h.chunk(2, dim=-1)
        if v == "up_first":
            gate, up = up, gate
        if v == "relu":
            act = torch.relu(gate)
        elif v == "tanh":
            act = torch.tanh(gate)
        elif v == "clamp":
            act = F.silu(gate.clamp(max=1.0))
        else:
            act = F.silu(gate)
        y = torch.bmm(act * up, self.down.transpose(1, 2))
        if v == "bias":
            y = y + self.bias
        out = y.sum(dim=0) if v == "on_input" else (y * dense.t().unsqueeze(-1)).sum(dim=0)
        if v == "weights_reused":
            out = out + self.down.mean(dim=(0, 2))
        return out.reshape(shape)


class LoopMoE(_RoutedBlock):
    """transformers 4.x / OLMoE shape: a fixed ``range(E)`` loop over an ``nn.ModuleList`` of experts."""

    def __init__(self, hidden: int = 32, inter: int = 16, num_experts: int = 8, top_k: int = 2) -> None:
        super().__init__(hidden, num_experts, top_k)
        self.experts = nn.ModuleList(SwiGLUExpert(hidden, inter) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            slot, tok = torch.where(mask[e])
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out.reshape(shape)
