"""The expert forms of GPT-OSS, Llama 4, DeepSeek-V4, Nemotron-H, JetMoE, DBRX and transformers' ``eager`` experts,
compiled whole on a GPU: Inductor's code launches moe_fx's kernels (biases, clamped / alpha / ``up + 1``
activations, interleaved gate/up, non-gated experts, dense scores reduced to top-k) and the logits equal
eager.

Run on the GPU machine: ``pytest -m gpu tests/test_expert_forms_gpu.py``. fp32 and one layer: the
router sees the same hidden states in both runs up to fp32 rounding, so no top-k near tie can flip.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

import moe_fx

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("triton")
pytest.importorskip("transformers")

# family -> experts implementation to build it with (None: the family's only one)
FAMILIES = {
    "gpt_oss": "grouped_mm",
    "llama4": None,
    "deepseek_v4": "grouped_mm",
    "nemotron_h": "grouped_mm",
    "jetmoe": None,
    "mixtral": "eager",  # a loop over the experts hit: captured at module level
    "dbrx": None,  # the same, with gate and up in separate flat parameters (packed into one storage)
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_compiled_on_gpu_launches_kernels_and_matches_eager(family):
    from torch._inductor.utils import run_and_get_code

    from moe_fx.testing.families import tiny_family_model

    model = tiny_family_model(family, num_layers=1, experts_implementation=FAMILIES[family]).cuda()
    tokens = torch.randint(3, 128, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(tokens, use_cache=False).logits.float()
        got, code = run_and_get_code(moe_fx.compile(model), tokens, use_cache=False)
    code = "\n".join(code)
    assert "permute_kernel" in code and "moe_fx.experts" not in code, family
    assert rel_err(got.logits.float(), want) < 1e-2, (family, rel_err(got.logits.float(), want))
