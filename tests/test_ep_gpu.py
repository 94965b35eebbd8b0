"""The expert-parallel ops on one GPU (an NCCL group of one rank): DeepEP's low-latency kernels and the
sync-free fixed-size torch.distributed exchange, for every form of the experts op, replayed from a CUDA
graph, against the single-process op.

Each case captures one EP step (ep_dispatch_send -> a shared-expert matmul while the tokens are in
flight -> ep_dispatch_recv -> masked_experts -> ep_combine -> ep_remaining_rounds, with the form's
identity experts and weights on the input handled as ``split_ep`` does) in ``torch.cuda.graph``,
replays it on new inputs copied into the captured ones, and compares with ``moe_fx.ops.experts``.
One more case compiles such a step with Inductor in ``mode="reduce-overhead"`` (CUDA graphs through
Inductor's cudagraph trees). DeepEP's cases skip where ``deep_ep`` does not import.

Run on the GPU machine: ``pytest -m gpu tests/test_ep_gpu.py`` (DeepEP on ``PYTHONPATH`` for its cases).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from ep_workers import FORMS, FormMoE
from helpers import rel_err

import moe_fx  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]
pytest.importorskip("triton")

ops = torch.ops.moe_fx
#: hidden size per form on the GPU: DeepEP's compiled sizes where the form allows (2880 is padded to
#: 4096 when DeepEP is requested; 2880 also stands for a size that is not a multiple of 128)
_HIDDEN = {"gpt_oss_h2880": 2880, "fp8_h192": 2880}
#: T * top-k <= max_tokens_per_rank for every form (weights on the input send T * K rows): one round,
#: the only kind a CUDA graph can replay
_T, _MAX_TOKENS = 32, 64


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 's')}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            from moe_fx.ops.ep import ep_group_name

            yield ep_group_name("default")
        finally:
            dist.destroy_process_group()


def _ep_kernel(name: str) -> str:
    if name == "deepep":
        from moe_fx.lowering.problem import probe_capabilities

        why = probe_capabilities("cuda").deep_ep_error
        if why is not None:
            pytest.skip(f"DeepEP cannot run here: {why}")
    return name


def _model(form: str) -> FormMoE:
    options = {**FORMS[form], "hidden": _HIDDEN.get(form, 2048), "inter": 256}
    return FormMoE(dtype=torch.bfloat16, **options).cuda().eval()


def _route(model: FormMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(torch.nn.functional.linear(x, model.router, model.router_bias).float(), dim=-1)
    weights, ids = torch.topk(probs, model.top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def _ep_step(model: FormMoE, x, ids, weights, shared, group_name: str, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's EP step for ``model``'s form, the way split_ep writes it; returns (out, shared expert out)."""
    kw = model.kwargs
    e = model.w13.shape[0]
    n_id = kw.get("identity_experts", 0)
    routed, send, send_w = ids, x, weights
    if n_id:
        is_id = (ids >= e) & (ids < e + n_id)
        routed = torch.where(is_id, -1, ids)
    if kw.get("weights_on_input"):
        send = (x.unsqueeze(1) * weights.unsqueeze(-1).to(x.dtype)).flatten(0, 1)
        routed = routed.reshape(-1, 1)
        send_w = torch.ones_like(routed, dtype=torch.float32)
    use_fp8 = model.w13.dtype == torch.float8_e4m3fn and x.shape[1] % 128 == 0
    common = (e, _MAX_TOKENS, group_name, use_fp8, kernel)
    ticket = ops.ep_dispatch_send(send, routed, *common)
    side = shared @ shared.t()  # independent work while the tokens are in flight
    recv_x, recv_scale, masked_m, src_info, layout_range = ops.ep_dispatch_recv(ticket, send, *common)
    form = {k: kw[k] for k in ("activation", "gated", "gate_up_layout", "alpha", "limit", "up_offset") if k in kw}
    activation = form.pop("activation", "silu")
    y = ops.masked_experts(recv_x, masked_m, model.w13, model.w2, activation, recv_scale if use_fp8 else None,
                           model.w13_scale, model.w2_scale, 16, "auto", w13_bias=model.w13_bias,
                           w2_bias=model.w2_bias, **form)
    out0 = ops.ep_combine(y, routed, send_w, src_info, layout_range, *common)
    out = ops.ep_remaining_rounds(out0, send, routed, send_w, model.w13, model.w2, *common, activation=activation,
                                  w13_scale=model.w13_scale, w2_scale=model.w2_scale, w13_bias=model.w13_bias,
                                  w2_bias=model.w2_bias, **form)
    if kw.get("weights_on_input"):
        out = out.view(-1, model.top_k, out.shape[-1]).float().sum(1).to(x.dtype)
    if n_id:
        out = (out.float() + x.float() * (weights.float() * is_id.float()).sum(-1, keepdim=True)).to(x.dtype)
    return out, side


def _tolerance(form: str) -> float:
    return 0.08 if form.startswith("fp8") else 2e-2


@pytest.mark.parametrize("kernel", ["torch_dist_fixed", "deepep"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_ep_step_every_form_in_a_cuda_graph(group, kernel, form):
    kernel = _ep_kernel(kernel)
    model = _model(form)
    h = model.router.shape[1]
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(_T, h, device="cuda", generator=gen).bfloat16()
    shared = torch.randn(64, h, device="cuda", generator=gen).bfloat16()
    ids, weights = _route(model, x)
    ops.ep_agree_step(x.shape[0] * (model.top_k if model.kwargs.get("weights_on_input") else 1), _MAX_TOKENS, group)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (DeepEP's buffer, Triton compilation) outside the capture
            for _ in range(2):
                _ep_step(model, x, ids, weights, shared, group, kernel)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, side = _ep_step(model, x, ids, weights, shared, group, kernel)
        for seed in (2, 3):  # new inputs through the captured buffers
            g2 = torch.Generator("cuda").manual_seed(seed)
            x.copy_(torch.randn(x.shape, device="cuda", generator=g2).bfloat16())
            new_ids, new_w = _route(model, x)
            ids.copy_(new_ids)
            weights.copy_(new_w)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want = model(x)
            assert not out.isnan().any()
            assert rel_err(out.float(), want.float()) < _tolerance(form), (form, kernel, rel_err(out, want))
            torch.testing.assert_close(side, shared @ shared.t())


@pytest.mark.parametrize("kernel", ["torch_dist_fixed", "deepep"])
def test_ep_step_compiled_with_cuda_graphs(group, kernel):
    """Inductor compiles the step (masked_experts lowered to its Triton kernels, the EP ops as calls) and
    replays it through its cudagraph trees; a second step of two rounds is refused on every rank once a
    graph was captured (one rank here)."""
    kernel = _ep_kernel(kernel)
    model = _model("biases")
    gen = torch.Generator("cuda").manual_seed(4)
    x = torch.randn(_T, 2048, device="cuda", generator=gen).bfloat16()
    shared = torch.randn(64, 2048, device="cuda", generator=gen).bfloat16()
    torch._dynamo.reset()
    step = torch.compile(lambda x, i, w, s: _ep_step(model, x, i, w, s, group, kernel)[0], mode="reduce-overhead")
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(_T, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()
            ids, weights = _route(model, x)
            ops.ep_agree_step(_T, _MAX_TOKENS, group)
            out = step(x, ids, weights, shared).clone()
            assert rel_err(out.float(), model(x).float()) < 2e-2
        with pytest.raises(ValueError, match="replays expert-parallel layers from CUDA graphs"):
            ops.ep_agree_step(2 * _MAX_TOKENS, _MAX_TOKENS, group)


def test_deepep_pads_gpt_oss_hidden_size(group):
    """H = 2880 through DeepEP (requested): padded to the next compiled size, said once in the log."""
    _ep_kernel("deepep")
    model = _model("gpt_oss_h2880")
    x = torch.randn(_T, 2880, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).bfloat16()
    ids, weights = _route(model, x)
    ops.ep_agree_step(_T, _MAX_TOKENS, group)
    with torch.no_grad():
        out, _ = _ep_step(model, x, ids, weights, x[:8], group, "deepep")
    assert rel_err(out.float(), model(x).float()) < 2e-2
    from moe_fx.lowering.prepare_finalize import deepep_ll

    assert deepep_ll.padded_hidden(2880) > 2880 and 2880 in deepep_ll._warned_padding  # warned (once per process)
