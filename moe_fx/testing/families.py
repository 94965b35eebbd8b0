"""Tiny random models of every transformers text MoE family, and user-written blocks of every expert form.

Two parts:

* :func:`tiny_family_model` builds a small causal LM of any transformers 5.x MoE family from its default
  config, shrunk by attribute name (hidden 32, 2 layers, 8 experts, top-2, small heads), with every
  layer a sparse MoE layer where the config allows it. :data:`TEXT_MOE_FAMILIES` lists the families the
  family survey (``bench/families.py``) runs; :data:`FAMILY_OVERRIDES` holds the few per-family settings
  a generic shrink cannot guess.
* User-written MoE blocks in the forms the pass must recognise beyond transformers' own
  implementations: :class:`NonGatedMoE` (up -> plain activation -> down, Nemotron-H style),
  :class:`ClampedSwiGLUMoE` (DeepSeek-V4-style ``swiglu_limit``), :class:`DenseScoresMoE` (Llama 4's
  dense ``[T, E]`` scores on the expert input), :class:`JetSortMoE` (hand-written
  sort-based dispatch with ``div(..., rounding_mode="trunc")``, ``split`` by counts, a per-expert
  ``F.linear`` loop and an output bias after the combine, JetMoE style), :class:`HitLoopExperts`
  (a loop over the experts actually hit, ``for e in expert_hit:``, optional biases, clamp, alpha,
  interleaved gate/up rows and identity experts; DBRX / Step / LongCat-Flash / transformers ``eager``
  style).

Nothing is downloaded; weights are random (``torch.manual_seed``), every weight non-zero.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moe_fx.testing.models import randomise_weights

__all__ = [
    "FAMILY_OVERRIDES",
    "TEXT_MOE_FAMILIES",
    "ClampedSwiGLUMoE",
    "DenseScoresMoE",
    "HitLoopExperts",
    "HitLoopMoE",
    "JetSortMoE",
    "NonGatedMoE",
    "tiny_family_config",
    "tiny_family_model",
]

#: transformers 5.x causal-LM families with a text MoE (``AutoModelForCausalLM`` builds them).
TEXT_MOE_FAMILIES = (
    "afmoe", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "doge", "dots1", "dots3_note", "ernie4_5_moe", "exaone_moe", "flex_olmo",
    "flint", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "jamba", "jetmoe", "kimi_linear",
    "kolibri1", "laguna", "lara_mini", "lfm2_moe", "llama4", "longcat_flash", "mellum", "mimo_v2_flash", "minimax",
    "minimax_m2", "mixtral", "nemotron_h", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
    "qwen4_exp", "solar_open", "step3p7", "zaya",
)  # fmt: skip

# Scalar config attributes set by name when the family's config has them.
_SHRINK: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "d_model": 32, "num_hidden_layers": 2, "n_layers": 2, "num_layers": 2,
    "num_attention_heads": 4, "n_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "kv_channels": 8,
    "intermediate_size": 64, "intermediate_size_mlp": 64, "ffn_hidden_size": 64, "shared_intermediate_size": 32,
    "moe_intermediate_size": 16, "expert_ffn_hidden_size": 16, "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_topk": 2, "moe_top_k": 2, "top_k": 2,
    "n_group": 2, "num_expert_group": 2, "topk_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 24, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "index_head_dim": 8, "index_n_heads": 2, "index_topk": 8, "o_groups": 2,
    "first_k_dense_replace": 0, "num_dense_layers": 0, "moe_layer_start_index": 0, "decoder_sparse_step": 1,
    "moe_layer_interval": 1, "expert_layer_period": 1, "expert_layer_offset": 0, "interleave_moe_layer_step": 1,
    "max_position_embeddings": 256, "max_seq_len": 256, "sliding_window": 64, "attention_chunk_size": 64,
    "num_nextn_predict_layers": 0, "zero_expert_num": 2,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 8, "linear_num_heads": 4, "mamba_num_heads": 4, "mamba_n_heads": 4, "mamba_head_dim": 8,
    "mamba_d_head": 8, "n_groups": 1, "mamba_n_groups": 1, "mamba_d_state": 8, "ssm_state_size": 8,
    "mamba_dt_rank": 4, "router_hidden_size": 16, "gated_norm_rank": 4, "hc_lowrank": 4, "ple_embed_dim": 16,
    "ngram_vocab_size_base": 64, "layer_group_size": 2, "global_attn_every_n_layers": 2,
}  # fmt: skip
# Per-layer lists: which entry names an MoE layer.
_MOE_LAYER_WORDS = ("sparse", "moe", "hash_moe")

#: Settings a name-based shrink cannot guess, per family.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # transformers 5.24's DBRX attention reads attn_config.rope_theta, which its config class no longer sets.
    "dbrx": {"ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2, "hidden_size": 32},
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "dots1": {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "hunyuan_v1_moe": {"head_dim": 8, "num_experts": 8, "moe_topk": 2},
    "nemotron_h": {"moe_latent_size": None, "n_group": 1, "topk_group": 1},
    "granitemoehybrid": {"mamba_d_head": 16},
    "qwen4_exp": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
                  "indexer_compress_ratio": 2},
    "zaya": {"num_experts_per_tok": 1},
    "llama4": {"num_experts_per_tok": 1},
    "longcat_flash": {"num_hidden_layers": 2},  # = 2 * num_layers: one layer of two sub-blocks
    "flint": {"mlp_only_layers": []},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "mimo_v2_flash": {"head_dim": 24, "v_head_dim": 16, "num_key_value_heads": 2},  # sliding layers double kv heads
    "step3p7": {"sliding_window": 64},
    "jamba": {"expert_layer_period": 1},
    "doge": {"is_moe": True, "num_experts": 16, "num_experts_per_tok": 4},
    "deepseek_v4": {"num_key_value_heads": 1, "head_dim": 16},
}


def _last_attention(n: int, other: str, attention: str) -> list[str]:
    """``n`` layer types, the last one attention (hybrid models' caches need one attention layer)."""
    return [other] * (n - 1) + [attention]


#: Per-layer settings, as functions of the number of layers.
_PER_LAYER: dict[str, Callable[[int], dict[str, Any]]] = {
    "lfm2_moe": lambda n: {"layer_types": _last_attention(n, "conv", "full_attention")},
    "granitemoehybrid": lambda n: {"layer_types": _last_attention(n, "linear_attention", "attention")},
    "qwen4_exp": lambda n: {"layer_types": _last_attention(n, "linear_attention", "indexed_attention")},
    "llama4": lambda n: {"no_rope_layers": [1] * n, "moe_layers": list(range(n))},
    "deepseek_v4": lambda n: {"mlp_layer_types": ["moe"] * n},
    # Step-3.7 clamps after the activation on some layers (bound 7 in the real model): the first layer here.
    "step3p7": lambda n: {"swiglu_limits": [2.0] + [0.0] * (n - 1)},
    "jamba": lambda n: {"attn_layer_period": 2, "attn_layer_offset": 1} if n > 1 else {"attn_layer_period": 1,
                                                                                      "attn_layer_offset": 0},
    # One block per layer: num_layers MoE blocks around one attention block.
    "nemotron_h": lambda n: {"layers_block_type": (blocks := ["full_attention", "moe"] if n == 1 else
                                                   ["moe", "full_attention"] + ["moe"] * (n - 1)),
                             "num_hidden_layers": len(blocks)},
}


def _shrink_list(key: str, value: list, num_layers: int) -> list | None:
    if not value or len(value) < num_layers:
        return None
    items = list(value[:num_layers])
    attention = [w for w in value if isinstance(w, str) and "attention" in w and "linear" not in w]
    if attention and attention[0] not in items:
        items[-1] = attention[0]  # hybrid models need one attention layer (their cache asks it for lengths)
    if "mlp" in key or "block" in key:
        moe = next((w for w in value if isinstance(w, str) and w in _MOE_LAYER_WORDS), None)
        if moe is not None:
            items = [moe if isinstance(w, str) and w in ("dense", "mlp") else w for w in items]
    return items


def tiny_family_config(family: str, *, num_layers: int = 2, **overrides: Any):
    """A small config of transformers family ``family`` (shrunk from its defaults; see the module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        raise ValueError(f"transformers has no config for family {family!r}")
    cls = CONFIG_MAPPING[family]
    default = cls()
    text = default.get_text_config() if hasattr(default, "get_text_config") else default
    if text is not default:
        cls = type(text)
    base = text.to_dict()
    default_layers = next((base[k] for k in ("num_hidden_layers", "n_layers", "num_layers") if k in base), None)
    kwargs: dict[str, Any] = {}
    for key, value in base.items():
        if key in _SHRINK and isinstance(value, (int, float)) and not isinstance(value, bool):
            kwargs[key] = _SHRINK[key]
        elif isinstance(value, list) and default_layers and len(value) == default_layers:
            shrunk = _shrink_list(key, value, num_layers)
            if shrunk is not None:
                kwargs[key] = shrunk
    for key in ("num_hidden_layers", "n_layers", "num_layers"):
        if key in kwargs:
            kwargs[key] = num_layers
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "sep_token_id"):
        if key in base:
            kwargs[key] = 0 if key == "pad_token_id" else 1
    kwargs.update(FAMILY_OVERRIDES.get(family, {}))
    if family in _PER_LAYER:
        kwargs.update(_PER_LAYER[family](num_layers))
    kwargs.update(overrides)
    kwargs["tie_word_embeddings"] = False
    cfg = cls(**kwargs)
    return cfg


def tiny_family_model(
    family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, experts_implementation: str | None = None,
    **overrides: Any,
) -> nn.Module:
    """A random tiny causal LM of ``family`` in eval mode; ``experts_implementation`` sets transformers' choice."""
    cfg = tiny_family_config(family, **overrides)
    torch.manual_seed(seed)
    try:
        model = _build(family, cfg, experts_implementation)
    except ValueError as exc:
        if "does not support setting experts implementation" not in str(exc):
            raise
        model = _build(family, cfg, None)  # a family with one experts forward only (Llama 4, JetMoE, ...)
    _randomise(model)
    return model.to(dtype).eval()


def _build(family: str, cfg: Any, experts_implementation: str | None) -> nn.Module:
    import transformers

    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    cfg = copy.deepcopy(cfg)  # from_config writes the implementation into the config, even when it refuses it
    try:
        return transformers.AutoModelForCausalLM.from_config(cfg, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
    # A text config without a registered causal-LM class (Step-3.7): its text model.
    if experts_implementation is not None:
        cfg._experts_implementation = experts_implementation
    return _text_model_class(family)(cfg)


def _text_model_class(family: str) -> type[nn.Module]:
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = [n for n in dir(module) if n.endswith("TextModel") or n.endswith("ForCausalLM")]
    if not names:
        raise ValueError(f"transformers.models.{family} has no text model class")
    return getattr(module, sorted(names, key=lambda n: not n.endswith("ForCausalLM"))[0])


def _randomise(model: nn.Module) -> None:
    """Every weight random and non-zero (transformers leaves some routers, biases and experts at zero)."""
    randomise_weights(model, wide=("gate", "router"), biased=("expert", "router"))


# ----------------------------------------------------------------------------------------------------------
# User-written blocks of the forms the pass recognises beyond transformers' grouped_mm / batched_mm.


class _Router(nn.Module):
    """Softmax top-k router: ``[T, H] -> (weights [T, K], ids [T, K])``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) * 0.3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), ids


_ACTS = {"relu2": lambda x: F.relu(x).square(), "gelu": F.gelu, "relu": F.relu, "silu": F.silu}


class NonGatedMoE(nn.Module):
    """Non-gated experts (Nemotron-H style): ``down(act(up(x)))`` with stacked ``up [E, I, H]``, ``down [E, H, I]``.

    Written as transformers' ``batched_mm`` form does it (each routed token gathers its expert's weights,
    ``bmm``, weighted sum over the top-k). ``activation``: ``"relu2"`` (squared ReLU), ``"gelu"``,
    ``"relu"`` or ``"silu"``.
    """

    def __init__(self, hidden: int = 32, inter: int = 24, num_experts: int = 8, top_k: int = 2,
                 activation: str = "relu2") -> None:
        super().__init__()
        self.hidden, self.num_experts, self.top_k, self.activation = hidden, num_experts, top_k, activation
        self.router = _Router(hidden, num_experts, top_k)
        self.up_proj = nn.Parameter(torch.randn(num_experts, inter, hidden) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        weights, ids = self.router(x)
        flat = ids.reshape(-1)
        tokens = x.repeat_interleave(self.top_k, dim=0)
        h = torch.bmm(self.up_proj[flat], tokens.unsqueeze(-1)).squeeze(-1)
        y = torch.bmm(self.down_proj[flat], _ACTS[self.activation](h).unsqueeze(-1)).squeeze(-1)
        y = y * weights.reshape(-1, 1)
        return y.view(-1, self.top_k, self.hidden).sum(dim=1).reshape(shape)


class ClampedSwiGLUMoE(nn.Module):
    """Clamped SwiGLU experts without GPT-OSS's extras (DeepSeek-V4 ``swiglu_limit``), as a dense ``bmm``.

    ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``. Near misses the op cannot express:
    ``up_limit`` other than ``limit``, ``clamp_after_act=True`` (Step-3.7's ``silu(gate).clamp(max=limit)``),
    ``bias="after_weight"`` (a per-expert ``[E, H]`` bias added after the routing weight). ``bias="output"``
    adds it before the routing weight (the op's ``w2_bias``: matched).
    """

    def __init__(self, hidden: int = 32, inter: int = 16, num_experts: int = 8, top_k: int = 2, limit: float = 1.5,
                 up_limit: float | None = None, clamp_after_act: bool = False, bias: str | None = None) -> None:
        super().__init__()
        if bias not in (None, "output", "after_weight"):
            raise ValueError(f"bias must be None, 'output' or 'after_weight', got {bias!r}")
        self.hidden, self.num_experts = hidden, num_experts
        self.limit, self.up_limit = limit, limit if up_limit is None else up_limit
        self.clamp_after_act, self.bias_mode = clamp_after_act, bias
        self.router = _Router(hidden, num_experts, top_k)
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * 0.2)
        self.down = nn.Parameter(torch.randn(num_experts, hidden, inter) * 0.2)
        self.down_bias = nn.Parameter(torch.randn(num_experts, hidden) * 0.2) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        weights, ids = self.router(x)
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
        h = torch.bmm(x.unsqueeze(0).expand(self.num_experts, -1, -1), self.gate_up.transpose(1, 2))
        gate, up = h.chunk(2, dim=-1)
        if self.clamp_after_act:
            act = F.silu(gate).clamp(max=self.limit)
        else:
            act = F.silu(gate.clamp(max=self.limit))
        y = torch.bmm(act * up.clamp(-self.up_limit, self.up_limit), self.down.transpose(1, 2))
        if self.bias_mode == "output":
            y = y + self.down_bias.unsqueeze(1)
        y = y * dense.t().unsqueeze(-1)
        if self.bias_mode == "after_weight":
            y = y + self.down_bias.unsqueeze(1)
        return y.sum(dim=0).reshape(shape)


class DenseScoresMoE(nn.Module):
    """Llama 4's shape: every expert runs on ``x * score``, scores a dense ``[T, E]`` matrix, summed over E.

    ``scores="topk_sigmoid"`` (Llama 4): ``sigmoid`` of the top-k logits scattered into ``-inf``, so zero
    outside the top-k (matched, the op runs only the top-k). ``scores="softmax"``: a softmax over all
    experts, non-zero everywhere (a near miss: reducing it to a top-k would drop experts).
    """

    def __init__(self, hidden: int = 32, inter: int = 16, num_experts: int = 8, top_k: int = 1,
                 scores: str = "topk_sigmoid") -> None:
        super().__init__()
        if scores not in ("topk_sigmoid", "softmax"):
            raise ValueError(f"scores must be 'topk_sigmoid' or 'softmax', got {scores!r}")
        self.hidden, self.num_experts, self.top_k, self.scores = hidden, num_experts, top_k, scores
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, hidden, 2 * inter) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(num_experts, inter, hidden) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        logits = self.router(x)
        if self.scores == "softmax":
            scores = torch.softmax(logits.float(), dim=-1).to(x.dtype)
        else:
            top, ids = torch.topk(logits, self.top_k, dim=1)
            scores = torch.full_like(logits, float("-inf")).scatter_(1, ids, top)
            scores = torch.sigmoid(scores.float()).to(x.dtype)
        routed = x.repeat(self.num_experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
        h = torch.bmm(routed.view(self.num_experts, -1, self.hidden), self.gate_up_proj)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(up * F.silu(gate), self.down_proj).view(-1, self.hidden)
        return y.reshape(self.num_experts, -1, self.hidden).sum(dim=0).reshape(shape)


class JetSortMoE(nn.Module):
    """JetMoE-style hand-written dispatch: sort, ``div(..., rounding_mode="trunc")``, ``split`` by per-expert
    counts (``tolist()``), one ``F.linear`` per expert, ``index_add`` back, then an output bias ``[H]``.

    Weights ``input_linear [E, 2I, H]`` (gate rows first), ``output_linear [E, H, I]``.
    """

    def __init__(self, hidden: int = 32, inter: int = 16, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.input_linear = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * 0.2)
        self.output_linear = nn.Parameter(torch.randn(num_experts, hidden, inter) * 0.2)
        self.bias = nn.Parameter(torch.randn(hidden) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        logits = self.router(x).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=1)
        gates = torch.softmax(top_logits, dim=1).type_as(x)
        one_hot = torch.zeros(x.shape[0], self.num_experts, dtype=gates.dtype, device=x.device).scatter(1, top_ids, 1)
        expert_size = one_hot.long().sum(0).tolist()
        _, order = top_ids.flatten().sort(0)
        batch_index = order.div(self.top_k, rounding_mode="trunc")
        batch_gates = gates.flatten()[order]
        inputs = x[batch_index].split(expert_size, dim=0)
        h = torch.cat([F.linear(inputs[e], self.input_linear[e]) for e in range(self.num_experts)], dim=0)
        gate, up = h.chunk(2, dim=-1)
        mids = (F.silu(gate) * up).split(expert_size, dim=0)
        y = torch.cat([F.linear(mids[e], self.output_linear[e]) for e in range(self.num_experts)], dim=0)
        y = y * batch_gates[:, None]
        out = torch.zeros_like(x).index_add(0, batch_index, y)
        return (out + self.bias).reshape(shape)


class HitLoopExperts(nn.Module):
    """Experts looped over the experts actually hit (``for e in expert_hit:``), as transformers' ``eager`` does.

    ``forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``. The loop length depends on
    the routing (a graph break for Dynamo): the capture step replaces it before tracing. Options:
    ``bias`` (``[E, 2I]`` and ``[E, H]``), ``limit``/``alpha``/``up_offset`` (GPT-OSS's clamped SwiGLU),
    ``interleaved`` gate/up rows, ``transposed`` storage (``x @ w``), ``identity_experts`` (ids
    ``E .. E+Z-1`` return their input, LongCat-Flash), ``item`` (``int(idx.item())`` like LongCat),
    ``clamp_after_act`` (Step-3.7: ``silu(gate).clamp(max=limit)``, a near miss).
    """

    def __init__(
        self, hidden: int = 32, inter: int = 16, num_experts: int = 8, *, bias: bool = False,
        limit: float | None = None, alpha: float = 1.0, up_offset: float = 0.0, interleaved: bool = False,
        transposed: bool = False, identity_experts: int = 0, item: bool = False, clamp_after_act: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.limit, self.alpha, self.up_offset = limit, alpha, up_offset
        self.interleaved, self.transposed, self.item = interleaved, transposed, item
        self.zero_expert_num, self.clamp_after_act = identity_experts, clamp_after_act
        self.act_fn = {"silu": nn.SiLU(), "gelu": nn.GELU()}[activation]
        shape13 = (num_experts, hidden, 2 * inter) if transposed else (num_experts, 2 * inter, hidden)
        shape2 = (num_experts, inter, hidden) if transposed else (num_experts, hidden, inter)
        self.gate_up_proj = nn.Parameter(torch.randn(shape13) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(shape2) * 0.2)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(num_experts, 2 * inter) * 0.2) if bias else None
        self.down_proj_bias = nn.Parameter(torch.randn(num_experts, hidden) * 0.2) if bias else None

    def _gate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = (h[..., ::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)
        if self.limit is not None and not self.clamp_after_act:
            gate = gate.clamp(max=self.limit)
        if self.limit is not None:
            up = up.clamp(-self.limit, self.limit)
        act = gate * torch.sigmoid(gate * self.alpha) if self.alpha != 1.0 else self.act_fn(gate)
        if self.clamp_after_act:
            act = act.clamp(max=self.limit)
        return act * (up + self.up_offset)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w if self.transposed else F.linear(x, w)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        total = self.num_experts + self.zero_expert_num
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=total).permute(2, 1, 0)
            expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            e = int(expert_idx.item()) if self.item else expert_idx[0]
            slot, tok = torch.where(mask[e])
            x = hidden_states[tok]
            if e >= self.num_experts:
                y = x
            else:
                h = self._linear(x, self.gate_up_proj[e])
                if self.gate_up_proj_bias is not None:
                    h = h + self.gate_up_proj_bias[e]
                y = self._linear(self._gate(h), self.down_proj[e])
                if self.down_proj_bias is not None:
                    y = y + self.down_proj_bias[e]
            out.index_add_(0, tok, (y * top_k_weights[tok, slot, None]).to(out.dtype))
        return out


class HitLoopMoE(nn.Module):
    """A router plus :class:`HitLoopExperts` (same options); ``[T, H]`` or ``[B, S, H]`` in and out."""

    def __init__(self, hidden: int = 32, inter: int = 16, num_experts: int = 8, top_k: int = 2, **options: Any):
        super().__init__()
        self.hidden = hidden
        total = num_experts + options.get("identity_experts", 0)
        self.router = _Router(hidden, total, top_k)
        self.experts = HitLoopExperts(hidden, inter, num_experts, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        weights, ids = self.router(x)
        return self.experts(x, ids, weights).reshape(shape)

