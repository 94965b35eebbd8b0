"""Expert-parallel dispatch and combine: implementations of ``moe_fx::ep_dispatch`` / ``moe_fx::ep_combine``.

Backends (family ``"prepare_finalize"`` of :mod:`moe_fx.lowering.select`, chosen once per problem and
logged once): :mod:`.deepep_ll` (DeepEP low-latency kernels) and :mod:`.torch_dist`
(``all_to_all_single``, any torch.distributed backend; with one rank it runs no collective).

Limit: more tokens on a rank than ``max_tokens_per_rank`` is an error, not chunked. Why: the masked
layout ``[E_local, max_tokens_per_rank * world, H]`` is a static shape in the compiled graph and is
what DeepEP's registered RDMA buffer holds; that is what makes the path free of host syncs and
CUDA-graph capturable. Chunking would need the experts to run between per-chunk dispatch and combine
rounds whose number depends on every rank's T, i.e. a data-dependent loop around three separate ops
(or a fused op, losing the separate dispatch/experts/combine nodes that let shared experts overlap).
The torch.distributed backend exchanges counts first, so every rank sees every rank's T and all raise
the same ``ValueError`` together; with DeepEP the overflowing rank raises before the collective.
Size ``MoEConfig.max_tokens_per_rank`` for the largest step (prefill), or run prefill without EP.
"""

from __future__ import annotations

import torch

import logging

from moe_fx.lowering.problem import DispatchProblem, dtype_name
from moe_fx.lowering.select import Choice, choose
from moe_fx.ops.ep import check_combine_inputs, check_dispatch_inputs, resolve_ep_group

__all__ = ["ep_combine_impl", "ep_dispatch_impl"]

log = logging.getLogger("moe_fx.lowering")

# Per-call host work is on the latency path (DeepEP's dispatch + combine take ~90 µs on an H200):
# groups and choices are looked up once per distinct problem.
_GROUPS: dict[str, torch.distributed.ProcessGroup] = {}
_CHOICES: dict[tuple, Choice] = {}


def _group(group_name: str) -> torch.distributed.ProcessGroup:
    group = _GROUPS.get(group_name)
    if group is None:
        group = _GROUPS[group_name] = resolve_ep_group(group_name)
    return group


def _choose(hidden: int, dtype: torch.dtype, device: torch.device, top_k: int, num_experts: int, max_tokens: int,
            world: int, use_fp8: bool, backend: str) -> Choice:
    key = (hidden, dtype, device.type, top_k, num_experts, max_tokens, world, use_fp8, backend)
    choice = _CHOICES.get(key)
    if choice is None:
        problem = DispatchProblem(world, device.type, dtype_name(dtype), hidden, top_k, num_experts, max_tokens,
                                  use_fp8, expert_parallel=True)
        choice = choose("prepare_finalize", problem, request=backend, device=device)
        if choice.error is not None:
            raise RuntimeError(
                f"moe_fx EP: backend={backend!r} requested but cannot run: {choice.error} ({problem.describe()})"
            )
        if choice.name == "torch_dist" and backend == "auto" and device.type == "cuda" and world > 1:
            # A GPU fallback away from DeepEP is worth a warning: it is much slower at decode sizes.
            log.warning("moe_fx EP %s: falling back to torch.distributed: %s", problem.describe(),
                        choice.reasons.get("deepep_ll", ""))
        _CHOICES[key] = choice
    return choice


def ep_dispatch_impl(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group_name: str,
    use_fp8: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``moe_fx::ep_dispatch`` on the chosen backend (shapes in :mod:`moe_fx.ops.ep`)."""
    group = _group(group_name)
    world = group.size()
    check_dispatch_inputs(hidden, topk_ids, num_experts, max_tokens_per_rank, world, use_fp8, backend)
    # combine decides from expert_out's dtype: bf16 after fp8 dispatch (DeepEP's only case), else hidden's.
    choice = _choose(
        hidden.shape[1],
        hidden.dtype,
        hidden.device,
        topk_ids.shape[1],
        num_experts,
        max_tokens_per_rank,
        world,
        use_fp8,
        backend,
    )
    if choice.name == "deepep_ll":
        from moe_fx.lowering.prepare_finalize import deepep_ll

        return deepep_ll.dispatch(hidden, topk_ids, num_experts, max_tokens_per_rank, group, use_fp8)
    from moe_fx.lowering.prepare_finalize import torch_dist

    return torch_dist.dispatch(hidden, topk_ids, num_experts, max_tokens_per_rank, group, use_fp8)


def ep_combine_impl(
    expert_out: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    src_info: torch.Tensor,
    layout_range: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group_name: str,
    use_fp8: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Run ``moe_fx::ep_combine`` on the backend its dispatch used (same static inputs, same choice)."""
    group = _group(group_name)
    world = group.size()
    check_combine_inputs(
        expert_out, topk_ids, topk_weights, src_info, layout_range, num_experts, max_tokens_per_rank, world, backend
    )
    choice = _choose(
        expert_out.shape[2],
        expert_out.dtype,
        expert_out.device,
        topk_ids.shape[1],
        num_experts,
        max_tokens_per_rank,
        world,
        use_fp8,
        backend,
    )
    if choice.name == "deepep_ll":
        from moe_fx.lowering.prepare_finalize import deepep_ll

        return deepep_ll.combine(
            expert_out, topk_ids, topk_weights, src_info, layout_range, num_experts, max_tokens_per_rank, group
        )
    from moe_fx.lowering.prepare_finalize import torch_dist

    return torch_dist.combine(expert_out, topk_ids, topk_weights, layout_range, num_experts, group)
