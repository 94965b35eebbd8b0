"""Tiny transformers models with fine-grained FP8 experts, built on CPU without downloads.

transformers loads fine-grained FP8 checkpoints (DeepSeek-V3 style, ``FineGrainedFP8Config``) by
swapping every ``*.experts`` module for its ``FP8Experts`` class: fp8 e4m3 ``gate_up_proj
[E, 2I, H]`` and ``down_proj [E, H, I]`` with fp32 128x128 block scales ``gate_up_proj_scale_inv
[E, ceil(2I/128), ceil(H/128)]`` and ``down_proj_scale_inv [E, ceil(H/128), ceil(I/128)]``
(``w ~= fp8 * scale_inv`` per block). The quantizer's environment check wants a GPU, so this module
does the swap itself, exactly as ``replace_with_fp8_linear`` does for experts, and fills the fp8
weights from a random bf16 model with the same recipe (``scale_inv = amax / 448``).

Only the experts are converted (attention and the router stay bf16), so the model's FP8 content is
what moe_fx's FP8 path must use as it is. See docs/fp8_checkpoints.md for what these modules look
like to Dynamo.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["dequantized_copy", "fp8_experts_like", "is_fp8_experts", "tiny_fp8_hf_model"]

BLOCK = (128, 128)


def _fp8_experts_class():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    # What replace_with_fp8_linear does for a module named "*.experts" (gated, no bias).
    return use_experts_implementation(
        experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS, has_bias=False, has_gate=True
    )


def is_fp8_experts(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' fine-grained FP8 experts module."""
    return type(module).__name__ == "FP8Experts" and hasattr(module, "gate_up_proj_scale_inv")


def fp8_experts_like(experts: nn.Module, config: Any) -> nn.Module:
    """An ``FP8Experts`` module holding ``experts``' weights quantised to fp8 with 128x128 block scales.

    ``experts``: a transformers 5.x fused experts module (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``). Returns the FP8 module on the same device, weights float8_e4m3fn,
    scales float32 (``scale_inv = amax / 448`` per block, the layout of transformers' checkpoints).
    """
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    cls = _fp8_experts_class()
    with torch.device("meta"):
        fp8 = cls(config=config, block_size=list(BLOCK), activation_scheme="dynamic")
    device = experts.gate_up_proj.device
    fp8 = fp8.to_empty(device=device)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            w, s = quantize_fp8_blockwise(getattr(experts, name).detach())
            if getattr(fp8, name).shape != w.shape or getattr(fp8, f"{name}_scale_inv").shape != s.shape:
                raise ValueError(
                    f"fp8_experts_like: {name} {list(w.shape)} / scales {list(s.shape)} do not fit FP8Experts' "
                    f"{list(getattr(fp8, name).shape)} / {list(getattr(fp8, f'{name}_scale_inv').shape)}"
                )
            setattr(fp8, name, nn.Parameter(w, requires_grad=False))
            setattr(fp8, f"{name}_scale_inv", nn.Parameter(s, requires_grad=False))
    return fp8.eval()


def tiny_fp8_hf_model(
    family: str = "mixtral",
    *,
    hidden: int = 256,
    intermediate: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    experts_implementation: str = "grouped_mm",
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> nn.Module:
    """A tiny causal LM of ``family`` whose experts are transformers' ``FP8Experts`` (fp8 + fp32 block scales).

    Everything else (embeddings, attention, router, norms, lm_head) stays in ``dtype``. Shapes default
    to multiples of 128 so the DeepGEMM path applies. Nothing is downloaded.
    """
    from moe_fx.testing.models import tiny_hf_model

    model = tiny_hf_model(
        family, dtype=dtype, hidden=hidden, intermediate=intermediate,
        experts_implementation=experts_implementation, **kwargs,
    ).to(device)  # fmt: skip
    text_config = model.config.get_text_config()
    names = [n for n, m in model.named_modules() if n.endswith(".experts") and hasattr(m, "gate_up_proj")]
    if not names:
        raise ValueError(f"tiny_fp8_hf_model: no fused experts module in the {family} model")
    for name in names:
        model.set_submodule(name, fp8_experts_like(model.get_submodule(name), text_config))
    return model.eval()


def dequantized_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of an FP8-experts model whose experts hold the dequantised weights (``fp8 * scale_inv``).

    The original experts class comes back, so the copy runs anywhere (transformers' FP8 kernels come
    from the Hub's ``kernels`` package, absent offline and on CPU): it is the eager oracle of what
    the FP8 model means. ``dtype`` defaults to the dtype of the model's other weights.
    """
    from moe_fx.ops import dequantize_blockwise

    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if not is_fp8_experts(module):
            continue
        cfg = module.config
        fam = type(out).__name__.replace("ForCausalLM", "")
        experts_cls = _original_experts_class(out, fam)
        target = dtype or next(p.dtype for p in out.parameters() if p.dtype.is_floating_point and p.element_size() > 1)
        with torch.device("meta"):
            plain = experts_cls(cfg)
        plain = plain.to_empty(device=module.gate_up_proj.device)
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                w = dequantize_blockwise(getattr(module, proj), getattr(module, f"{proj}_scale_inv")).to(target)
                setattr(plain, proj, nn.Parameter(w, requires_grad=False))
        out.set_submodule(name, plain)
    return out


def _original_experts_class(model: nn.Module, family: str) -> type[nn.Module]:
    import importlib

    module = importlib.import_module(type(model).__module__)
    for attr in dir(module):
        if attr.endswith("Experts") and attr.lower().startswith(family.lower()[:4]):
            return getattr(module, attr)
    raise ValueError(f"dequantized_copy: no experts class found in {module.__name__}")
