"""Expert-parallel dispatch and combine: implementations of ``moe_fx::ep_dispatch`` / ``moe_fx::ep_combine``.

Kernels (family ``"prepare_finalize"`` of :mod:`moe_fx.lowering.select`, chosen once per problem and
logged once; the ops' ``kernel`` argument), each a module with the same ``dispatch`` / ``combine`` functions,
which the :class:`~moe_fx.lowering.select.Choice` carries:

* :mod:`.deepep_ll` — DeepEP's low-latency kernels (CUDA, bf16, hidden sizes it was compiled for);
* :mod:`.torch_dist_fixed` — a fixed-size exchange over any torch.distributed backend, no host sync
  (CUDA-graph capturable); the default on GPUs where DeepEP does not run;
* :mod:`.torch_dist` — ``all_to_all_single`` with counts read on the host; the default on CPU.

Dispatch comes in two halves (``dispatch_send`` starts it and returns a state, ``dispatch_recv``
finishes it): ``moe_fx::ep_dispatch_send`` / ``ep_dispatch_recv`` expose them to the graph, with a
ticket tensor standing for the state in between (kept here, keyed by the ticket's address), and
``moe_fx::ep_dispatch`` is the two back to back.

One call is one round of at most ``max_tokens_per_rank`` tokens per rank; larger steps run in rounds
agreed by all ranks (:mod:`.rounds`).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from moe_fx.lowering.problem import DispatchProblem, dtype_name
from moe_fx.lowering.select import Choice, choose
from moe_fx.ops.checks import check_combine, check_dispatch
from moe_fx.ops.ep import bind_combine, bind_dispatch, bind_dispatch_recv, bind_dispatch_send, resolve_ep_group

__all__ = ["ep_combine_impl", "ep_dispatch_impl", "ep_dispatch_recv_impl", "ep_dispatch_send_impl", "kernel_for"]

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


def kernel_for(
    hidden: int, dtype: torch.dtype, device: torch.device, top_k: int, num_experts: int, max_tokens: int,
    world: int, use_fp8: bool, kernel: str,
) -> Choice:
    """The prepare/finalize choice for one problem (cached); ``choice.implementation`` runs it."""
    key = (hidden, dtype, device.type, top_k, num_experts, max_tokens, world, use_fp8, kernel)
    choice = _CHOICES.get(key)
    if choice is None:
        problem = DispatchProblem(world, device.type, dtype_name(dtype), hidden, top_k, num_experts, max_tokens,
                                  use_fp8, expert_parallel=True)
        choice = choose("prepare_finalize", problem, kernel=kernel, device=device)
        if choice.error is not None:
            raise RuntimeError(
                f"moe_fx EP: kernel={kernel!r} requested but cannot run: {choice.error} ({problem.describe()})"
            )
        if choice.kernel != "deepep" and kernel == "auto" and device.type == "cuda" and world > 1:
            # A GPU fallback away from DeepEP is worth a warning: it is slower at decode sizes.
            log.warning("moe_fx EP %s: DeepEP not taken (%s); using %s", problem.describe(),
                        choice.reasons.get("deepep", ""), choice.kernel)
        _CHOICES[key] = choice
    return choice


def _send(a: dict) -> tuple[ModuleType, object]:
    group = _group(a["group_name"])
    world = group.size()
    check_dispatch(a, world)
    hidden, topk_ids = a["hidden"], a["topk_ids"]
    # combine decides from expert_out's dtype: bf16 after fp8 dispatch (DeepEP's only case), else hidden's.
    module = kernel_for(hidden.shape[1], hidden.dtype, hidden.device, topk_ids.shape[1], a["num_experts"],
                        a["max_tokens_per_rank"], world, a["use_fp8"], a["kernel_choice"]).implementation
    state = module.dispatch_send(hidden, topk_ids, a["num_experts"], a["max_tokens_per_rank"], group, a["use_fp8"])
    return module, state


def ep_dispatch_impl(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
    """Run ``moe_fx::ep_dispatch`` on the chosen kernel (shapes in :mod:`moe_fx.ops.ep`)."""
    module, state = _send(bind_dispatch(*args, **kwargs))
    return module.dispatch_recv(state)


#: ticket address -> (kernel module, its dispatch state), between a send and its receive.
_IN_FLIGHT: dict[int, tuple[ModuleType, object]] = {}


def ep_dispatch_send_impl(*args: object, **kwargs: object) -> torch.Tensor:
    """Run ``moe_fx::ep_dispatch_send``: start the dispatch, return its ticket."""
    a = bind_dispatch_send(*args, **kwargs)
    ticket = torch.empty(1, dtype=torch.int64, device=a["hidden"].device)
    _IN_FLIGHT[ticket.data_ptr()] = _send(a)
    return ticket


def ep_dispatch_recv_impl(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
    """Run ``moe_fx::ep_dispatch_recv``: finish the dispatch the ticket stands for."""
    a = bind_dispatch_recv(*args, **kwargs)
    entry = _IN_FLIGHT.pop(a["ticket"].data_ptr(), None)
    if entry is None:
        raise ValueError("moe_fx.ep_dispatch_recv: this ticket has no dispatch in flight (received twice, or never sent)")
    module, state = entry
    return module.dispatch_recv(state)


def ep_combine_impl(*args: object, **kwargs: object) -> torch.Tensor:
    """Run ``moe_fx::ep_combine`` on the kernel its dispatch used (same static inputs, same choice)."""
    a = bind_combine(*args, **kwargs)
    group = _group(a["group_name"])
    world = group.size()
    check_combine(a, world)
    y, topk_ids = a["expert_out"], a["topk_ids"]
    module = kernel_for(y.shape[2], y.dtype, y.device, topk_ids.shape[1], a["num_experts"],
                        a["max_tokens_per_rank"], world, a["use_fp8"], a["kernel_choice"]).implementation
    return module.combine(y, topk_ids, a["topk_weights"], a["src_info"], a["layout_range"], a["num_experts"],
                          a["max_tokens_per_rank"], group)
