"""``split_ep``: under expert parallelism, split each ``moe_fx::experts`` node into dispatch -> experts -> combine.

Runs after the MoE regions have been rewritten into ``torch.ops.moe_fx.experts`` nodes. When
``ctx.config.ep_group`` is set and the group has more than one rank, each experts node becomes::

    recv = moe_fx.ep_dispatch(hidden, topk_ids, E, max_tokens_per_rank, group_name, use_fp8)
    y    = moe_fx.masked_experts(recv[0], recv[2], w13_local, w2_local, activation, x_scale, ...)
    out  = moe_fx.ep_combine(y, topk_ids, topk_weights, recv[3], recv[4], E, max_tokens_per_rank, group_name)

Dispatch and the experts are placed where the experts node was, the combine (with the views that
re-shape its result) just before the first real consumer of its output, so work in between (a
DeepSeek block's shared experts) sits between the communication ops in the graph. ``use_fp8`` is set when the expert weights are fp8 and activations
bf16 (the experts then consume DeepEP's fp8 tokens and scales directly).

Invariants kept (moe_fx/passes/manager.py): every new node gets a fake value (``example_value`` and
``val``) computed by the ops' fake implementations under the graph's own fake mode; no graph input is
mutated; nothing it cannot handle is changed. ``E % world_size != 0`` is a ``ValueError`` here, at
compile time.

Local weights and what "frees the rest" means: each weight (and fp8 scale) node of an experts
node is narrowed in the graph to this rank's experts (``torch.narrow(w, 0, start, E_local)``, a view;
no new graph inputs, constants or buffers). When the node is a graph input whose real tensor is known
(``ctx.real_value``: the parameters Dynamo lifts into inputs), is contiguous, owns its whole
(resizable) storage and is read by nothing but experts nodes this pass splits, it is compacted in
place: the rank's experts are copied to its first ``E_local`` rows and its storage is shrunk to
exactly those rows (``untyped_storage().resize_``), and the graph narrows rows ``[0, E_local)``. So the
memory of the other ranks' experts is released while the model's ``Parameter`` objects keep their
shape, stride, dtype and device: Dynamo's guards still pass, nothing recompiles, and the compiled
graph reads only the rows that exist. Consequences, on purpose: after compiling under EP the eager
model cannot run any more (its expert weights hold only this rank's experts; reading past them is
invalid), as with a sharded checkpoint. The tensor is marked (``_moe_fx_ep_local``) so that a
recompile narrows it again instead of compacting twice; other passes must not read values of tensors
for which :func:`ep_weights_freed` is true. Otherwise (a get_attr tensor made by an earlier pass, a
computed weight, a view into a larger storage, other readers) the graph narrows rows
``[rank * E_local, ...)`` and nothing is freed.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any

import torch
from torch import fx

from moe_fx.ops.ep import ep_group_name, resolve_ep_group
from moe_fx.passes.graph_utils import op_name

__all__ = ["ep_weights_freed", "split_ep"]

log = logging.getLogger("moe_fx.passes")

_EXPERTS = torch.ops.moe_fx.experts.default
#: Dynamo records a direct call as the overload packet; rewrites produce the default overload.
_EXPERTS_TARGETS = (torch.ops.moe_fx.experts.default, torch.ops.moe_fx.experts)
_ARG_NAMES = [a.name for a in _EXPERTS._schema.arguments]
_ARG_DEFAULTS = {a.name: a.default_value for a in _EXPERTS._schema.arguments if a.has_default_value()}
#: Arguments of the extended contract (biases, activation variants, identity experts) masked_experts lacks.
_VARIANT_ARGS = ("w13_bias", "w2_bias", "gated", "gate_up_layout", "alpha", "limit", "up_offset", "identity_experts")
_LOCAL_ATTR = "_moe_fx_ep_local"
_FP8 = torch.float8_e4m3fn


def ep_weights_freed(t: torch.Tensor) -> bool:
    """True if ``split_ep`` reduced ``t`` to this rank's experts (only its first E_local rows hold data)."""
    return hasattr(t, _LOCAL_ATTR)


def _bound_args(node: fx.Node) -> dict[str, Any]:
    """The experts node's arguments by schema name (positional and keyword, defaults filled in)."""
    out = dict(_ARG_DEFAULTS)
    out.update(zip(_ARG_NAMES, node.args))
    out.update(node.kwargs)
    return out


def _value(node: Any) -> Any:
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def _fake_mode(gm: fx.GraphModule):
    # The mode of the graph's own values (Dynamo's), not the ambient TracingContext's: they can differ
    # inside a backend, and fake tensors of two modes cannot meet in one op.
    for n in gm.graph.nodes:
        v = _value(n)
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    return None


def _set_val(node: fx.Node, val: Any) -> None:
    node.meta["example_value"] = val
    node.meta["val"] = val


def _real_value(ctx: Any, gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    real = ctx.real_value(node) if hasattr(ctx, "real_value") else None
    if real is None and node.op == "get_attr":
        real = gm
        for part in str(node.target).split("."):
            real = getattr(real, part, None)
    if not isinstance(real, torch.Tensor) or isinstance(real, torch._subclasses.FakeTensor):
        return None
    return real


def _spans_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


class _Rewriter:
    """State of one ``split_ep`` run over one graph."""

    def __init__(self, gm: fx.GraphModule, ctx: Any, group_name: str, world: int, rank: int) -> None:
        self.gm, self.ctx, self.group_name, self.world, self.rank = gm, ctx, group_name, world, rank
        self.fake_mode = _fake_mode(gm)
        self.max_tokens = int(ctx.config.max_tokens_per_rank)
        self.key = (group_name, world, rank)
        self.to_compact: dict[int, tuple[torch.Tensor, int]] = {}

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.gm.graph.call_function(target, args, kwargs or {})
        if self.fake_mode is not None:
            fargs = torch.fx.node.map_arg(args, _value)
            fkwargs = torch.fx.node.map_arg(kwargs or {}, _value)
            with self.fake_mode:
                _set_val(node, target(*fargs, **fkwargs))
        return node

    def local_weight(self, arg: Any, num_experts: int, compact: set[int]) -> fx.Node | None:
        """A node for this rank's ``E_local`` experts of weight (or scale) ``arg`` (see module docstring)."""
        if arg is None:
            return None
        e_local = num_experts // self.world
        real = _real_value(self.ctx, self.gm, arg)
        mark = getattr(real, _LOCAL_ATTR, None) if real is not None else None
        if mark is not None:
            if mark != self.key:
                raise ValueError(
                    f"moe_fx.split_ep: the expert weight behind {arg.name} was already reduced to the experts of "
                    f"(group, world, rank) = {mark} by an earlier compilation; this one is {self.key}. "
                    "Recompile from a freshly loaded model."
                )
            start = 0
        elif real is not None and id(real) in compact:
            self.to_compact[id(real)] = (real, e_local)
            start = 0
        else:
            start = self.rank * e_local
        return self.call(torch.narrow, (arg, 0, start, e_local))

    def compactable(self, arg: Any, splittable: set[fx.Node]) -> int | None:
        """``id`` of the real tensor behind ``arg`` if it may be compacted in place, else None."""
        if not isinstance(arg, fx.Node) or arg.op != "placeholder":
            # Only Dynamo-lifted parameters: a get_attr tensor was made by an earlier pass (stacked
            # per-expert weights, whose original parameters may be views into it) and is left whole.
            return None
        real = _real_value(self.ctx, self.gm, arg)
        if real is None or hasattr(real, _LOCAL_ATTR):
            return None
        if not (real.is_contiguous() and _spans_storage(real) and real.untyped_storage().resizable()):
            return None
        if any(u not in splittable for u in arg.users):
            return None
        return id(real)

    def compact(self) -> int:
        """Shrink every scheduled weight to this rank's experts, in place; returns bytes released."""
        released = 0
        for real, e_local in self.to_compact.values():
            d = real.detach()
            lo = self.rank * e_local
            with torch.no_grad():
                if lo:
                    d[:e_local].copy_(d[lo : lo + e_local])
            before = real.untyped_storage().nbytes()
            real.untyped_storage().resize_(e_local * d.stride(0) * d.element_size())
            released += before - real.untyped_storage().nbytes()
            setattr(real, _LOCAL_ATTR, self.key)
        return released

    def check(self, node: fx.Node) -> str | None:
        """Why ``node`` cannot be split (None: it can). ``ValueError`` for E not divisible by the world size."""
        a = _bound_args(node)
        w13 = _value(a["w13"])
        if not isinstance(w13, torch.Tensor):
            w13 = _real_value(self.ctx, self.gm, a["w13"])
        if w13 is None:
            return "no value known for w13 (cannot tell the number of experts)"
        num_experts = int(w13.shape[0])
        if num_experts % self.world:
            raise ValueError(
                f"moe_fx.split_ep: {num_experts} experts cannot be split evenly over {self.world} ranks "
                f"(node {node.name}); expert parallelism needs E % world_size == 0"
            )
        variants = [k for k in _VARIANT_ARGS if a.get(k, _ARG_DEFAULTS.get(k)) != _ARG_DEFAULTS.get(k)]
        if variants:
            # masked_experts computes plain gated experts: splitting would drop these arguments.
            return f"the expert-parallel ops do not take {', '.join(variants)}; the node stays local"
        ids = _value(a["topk_ids"])
        top_k = int(ids.shape[1]) if isinstance(ids, torch.Tensor) else None
        if a["weights_on_input"] and top_k != 1:
            return f"weights_on_input with top-k {top_k}: each copy of a token has its own input; only top-1 is split"
        return None

    def rewrite(self, node: fx.Node, compact: set[int]) -> None:
        """Replace ``node`` by dispatch -> masked_experts -> combine (``check`` said it can)."""
        a = _bound_args(node)
        w13_v = _value(a["w13"])
        w13_v = w13_v if isinstance(w13_v, torch.Tensor) else _real_value(self.ctx, self.gm, a["w13"])
        num_experts = int(w13_v.shape[0])
        hidden, ids, weights = a["hidden"], a["topk_ids"], a["topk_weights"]
        ids_v, hidden_v = _value(ids), _value(hidden)
        top_k = int(ids_v.shape[1]) if isinstance(ids_v, torch.Tensor) else None
        use_fp8 = w13_v.dtype == _FP8 and isinstance(hidden_v, torch.Tensor) and hidden_v.dtype == torch.bfloat16

        graph = self.gm.graph
        with graph.inserting_before(node):
            w13 = self.local_weight(a["w13"], num_experts, compact)
            w2 = self.local_weight(a["w2"], num_experts, compact)
            w13_scale = self.local_weight(a["w13_scale"], num_experts, compact)
            w2_scale = self.local_weight(a["w2_scale"], num_experts, compact)
            send, combine_weights = hidden, weights
            if a["weights_on_input"]:
                # Top-1 with the weight on the input: scale before sending, combine with weight 1.
                dtype = hidden_v.dtype if isinstance(hidden_v, torch.Tensor) else None
                scale = self.call(torch.Tensor.to, (weights, dtype)) if dtype is not None else weights
                send = self.call(torch.mul, (hidden, scale))
                combine_weights = self.call(torch.ones_like, (weights,))
            disp = self.call(
                torch.ops.moe_fx.ep_dispatch.default,
                (send, ids, num_experts, self.max_tokens, self.group_name, use_fp8, "auto"),
            )
            parts = [self.call(operator.getitem, (disp, i)) for i in range(5)]
            y = self.call(
                torch.ops.moe_fx.masked_experts.default,
                (
                    parts[0],
                    parts[2],
                    w13,
                    w2,
                    a["activation"],
                    parts[1] if use_fp8 else None,
                    w13_scale,
                    w2_scale,
                    self.expected_m(hidden_v, top_k, num_experts),
                    a.get("impl", a.get("kernel", "auto")),
                ),
            )
        # The combine goes just before the first reader of the result, so that independent work the
        # model does in between (shared experts) sits between dispatch and combine.
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_user = min(node.users, key=order.__getitem__, default=None)
        with graph.inserting_before(first_user if first_user is not None else node.next):
            out = self.call(
                torch.ops.moe_fx.ep_combine.default,
                (
                    y,
                    ids,
                    combine_weights,
                    parts[3],
                    parts[4],
                    num_experts,
                    self.max_tokens,
                    self.group_name,
                    use_fp8,
                    "auto",
                ),
            )
        out.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        _sink(out)

    def expected_m(self, hidden_v: Any, top_k: int | None, num_experts: int) -> int:
        """Uniform-load rows per local expert (DESIGN.md): ``ceil(T_total * K / E)``, to 16, in ``[16, M]``."""
        m = self.max_tokens * self.world
        t = hidden_v.shape[0] if isinstance(hidden_v, torch.Tensor) else None
        t = t if isinstance(t, int) else self.max_tokens
        est = math.ceil(t * self.world * (top_k or 1) / num_experts)
        return max(16, min(m, -(-est // 16) * 16))


#: Pure ops that only re-view or cast a tensor: the combine is moved with them to their first other consumer.
_VIEW_OPS = frozenset(
    {"view", "reshape", "unsqueeze", "squeeze", "flatten", "contiguous", "view_as", "reshape_as", "to", "type"}
)


def _sink(out: fx.Node) -> None:
    """Move ``out`` (a combine) and the view/cast nodes that follow it down to their first other consumer.

    Models usually re-view the experts' result at once (``.view(*orig_shape)``) and add the shared
    experts after; placing the combine (and those views) just before the add leaves the shared-expert
    work between dispatch and combine, where it can overlap the exchange.
    """
    chain, frontier = [out], [out]
    while frontier:
        for u in frontier.pop().users:
            if u not in chain and op_name(u) in _VIEW_OPS and u.args and u.args[0] in chain:
                chain.append(u)
                frontier.append(u)
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    consumers = [u for n in chain for u in n.users if u not in chain]
    if not consumers:
        return
    first = min(consumers, key=order.__getitem__)
    # Every chain node's other inputs precede the node itself, hence also ``first``; keep their order.
    for n in sorted((n for n in chain if order[n] < order[first]), key=order.__getitem__):
        first.prepend(n)


def split_ep(gm: fx.GraphModule, ctx: Any) -> int:
    """Split every ``moe_fx::experts`` node of ``gm`` for expert parallelism; return how many were split.

    Does nothing (returns 0) without ``ctx.config.ep_group``, with a one-rank group, or when the
    graph has no experts node. ``ctx`` is a :class:`moe_fx.passes.manager.PassContext`.
    """
    config = ctx.config
    if getattr(config, "ep_group", None) is None or not getattr(config, "enabled", True):
        return 0
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _EXPERTS_TARGETS]
    if not nodes:
        return 0
    group_name = ep_group_name(config.ep_group)
    group = resolve_ep_group(group_name)
    world, rank = group.size(), group.rank()
    if world == 1:
        log.info("split_ep: EP group %s has one rank; the experts ops stay local", group_name)
        return 0
    rw = _Rewriter(gm, ctx, group_name, world, rank)
    splittable: set[fx.Node] = set()
    for node in nodes:
        why = rw.check(node)
        if why is None:
            splittable.add(node)
        else:
            log.info("split_ep: left %s local: %s", node.name, why)
    compact: set[int] = set()
    for node in splittable:
        a = _bound_args(node)
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            if isinstance(a[name], fx.Node):
                key = rw.compactable(a[name], splittable)
                if key is not None:
                    compact.add(key)
    for node in nodes:
        if node in splittable:
            rw.rewrite(node, compact)
    released = rw.compact()
    if splittable:
        gm.graph.lint()
        gm.recompile()
    log.info(
        "split_ep: %d experts node(s) split over %d ranks (rank %d); %.1f MiB of other ranks' experts released",
        len(splittable),
        world,
        rank,
        released / 2**20,
    )
    return len(splittable)
