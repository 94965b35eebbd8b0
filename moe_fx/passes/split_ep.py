"""``split_ep``: under expert parallelism, split each ``moe_fx::experts`` node into dispatch -> experts -> combine.

Runs after the MoE regions have been rewritten into ``torch.ops.moe_fx.experts`` nodes. When
``ctx.config.ep_group`` is set and the group has more than one rank, each experts node becomes::

    ids'  = ids with identity-expert ids set to -1            (identity experts: computed here, below)
    ids'  = the EPLB map of ids' (logical -> physical)         (MoEConfig.eplb; loads counted too)
    x, ids', w = per-slot inputs w_k * x (weights on the input), else hidden, ids', topk_weights
    tkt   = moe_fx.ep_dispatch_send(x[:R0], ids'[:R0], E', max_tokens_per_rank, group_name, use_fp8)
            ... (independent work of the model, e.g. shared experts: overlaps the transfer)
    recv  = moe_fx.ep_dispatch_recv(tkt, x[:R0], E', max_tokens_per_rank, group_name, use_fp8)
    y     = moe_fx.masked_experts(recv[0], recv[2], w13_local, w2_local, <every experts argument>)
    out0  = moe_fx.ep_combine(y, ids'[:R0], w[:R0], recv[3], recv[4], E', max_tokens_per_rank, group_name)
    out   = moe_fx.ep_remaining_rounds(out0, x, ids', w, w13_local, w2_local, ...)   (the step's other rounds)
    out   = out (summed over slots for weights on the input) + sum_k w_k * hidden for identity experts

``R0 = min(T, max_tokens_per_rank)`` (round 0) and ``E'`` the number of (physical) experts. Every form
the experts op takes is split: biases (narrowed to the rank's experts with the weights), every
activation variant, fp8 weights, identity experts (no weights: their ``w * x`` is added on the
token's own rank, no communication), weights on the input for any top-k (each (token, k) pair is
sent as its own row ``w_k * x_t`` with weight 1 and the K results summed, which for top-1 is Llama 4's
scale-before-sending). ``use_fp8`` is set when the expert weights are fp8, activations bf16 and H a
multiple of 128 (the experts then consume the dispatched fp8 tokens and scales directly; any other H,
GPT-OSS's 2880 for one, is dispatched in bf16 and quantised by the experts).

The dispatch's send is placed where the experts node was; its receive, the experts, the combine, the
other rounds and what follows them (with the views that re-shape the result) just before the first
real consumer of the output, so work in between (a DeepSeek block's shared experts) runs while the
tokens are in flight.

Call checks (run before every call of the compiled graph, in Python): ``ep_agree_step`` with the
largest token count of the graph's expert-parallel layers (every rank learns how many rounds this
step needs), and, with ``MoEConfig.eplb_interval``, the EPLB rebalance trigger.

Invariants kept (moe_fx/passes/README.md): every new node gets a fake value (``example_value`` and
``val``) computed by the ops' fake implementations under the graph's own fake mode; no graph input is
mutated (the EPLB counts live in buffers the pass adds); nothing it cannot handle is changed.
``E % world_size != 0`` is a ``ValueError`` here, at compile time.

Local weights and what "frees the rest" means: each weight, scale and bias node of an experts node
is narrowed in the graph to this rank's experts (``torch.narrow(w, 0, start, rows)``, a view; no new
graph inputs). When the node is a graph input whose real tensor is known (``ctx.real_value``: the
parameters Dynamo lifts into inputs), is contiguous, owns its whole (resizable) storage and is read by
nothing but experts nodes this pass splits, it is compacted in place: the rank's experts (with EPLB,
its physical experts, copies of other ranks' included) are copied to its first rows and its storage
is shrunk to exactly those rows (``untyped_storage().resize_``), and the graph narrows rows
``[0, rows)``. So the memory of the other ranks' experts is released while the model's ``Parameter``
objects keep their shape, stride, dtype and device: Dynamo's guards still pass, nothing recompiles,
and the compiled graph reads only the rows that exist. Consequences, on purpose: after compiling
under EP the eager model cannot run any more (its expert weights hold only this rank's experts;
reading past them is invalid), as with a sharded checkpoint. The tensor is marked
(``_moe_fx_ep_local``) so that a recompile narrows it again instead of compacting twice; other passes
must not read values of tensors for which :func:`ep_weights_freed` is true. Otherwise (a get_attr
tensor made by an earlier pass, a computed weight, a view into a larger storage, other readers) the
graph narrows rows ``[rank * E_local, ...)`` and nothing is freed; with EPLB such a weight gets a
``[P, ...]`` buffer of the rank's physical experts instead (:mod:`moe_fx.passes.eplb`).
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from moe_fx.ops.ep import ep_group_name, resolve_ep_group
from moe_fx.ops.signature import binder
from moe_fx.passes import eplb
from moe_fx.passes.graph_utils import add_weight_buffer, op_name

__all__ = ["ep_weights_freed", "split_ep"]

log = logging.getLogger("moe_fx.passes")

#: Dynamo records a direct call as the overload packet; rewrites produce the default overload.
_EXPERTS_TARGETS = (torch.ops.moe_fx.experts.default, torch.ops.moe_fx.experts)
_bind_experts = binder("moe_fx::experts")
#: Per-expert tensors of an experts node (leading dimension E), narrowed to the rank's experts.
_WEIGHTS = ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")
#: Arguments that pass unchanged from the experts node to masked_experts (and the remaining rounds).
_FORM_ARGS = ("gated", "gate_up_layout", "alpha", "limit", "up_offset")
_LOCAL_ATTR = "_moe_fx_ep_local"
_FP8 = torch.float8_e4m3fn
_FP8_BLOCK = 128


def ep_weights_freed(t: torch.Tensor) -> bool:
    """True if ``split_ep`` reduced ``t`` to this rank's experts (only its first rows hold data)."""
    return hasattr(t, _LOCAL_ATTR)


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


def _dim0_view(node: Any) -> tuple[fx.Node, tuple[int, int]] | None:
    """``(input, (d0, d1))`` if ``node`` transposes two dims of its input other than dim 0 (the experts)."""
    if not isinstance(node, fx.Node) or op_name(node) != "transpose" or len(node.args) != 3:
        return None
    src, d0, d1 = node.args
    v = _value(src)
    if not isinstance(src, fx.Node) or not isinstance(v, torch.Tensor) or not all(isinstance(d, int) for d in (d0, d1)):
        return None
    if 0 in (d0 % v.dim(), d1 % v.dim()):
        return None
    return src, (d0, d1)


def _base_of(node: Any) -> tuple[Any, list[tuple[int, int]]]:
    """The node a weight argument is a transposed view of (itself if none), and the transposes, in order."""
    dims: list[tuple[int, int]] = []
    while (step := _dim0_view(node)) is not None:
        node, d = step
        dims.insert(0, d)
    return node, dims


def _real_weight(ctx: Any, gm: fx.GraphModule, node: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(base, value)``: the real tensor behind a weight argument (through transposes) and the argument's value."""
    base_node, dims = _base_of(node)
    base = _real_value(ctx, gm, base_node)
    if base is None:
        return None, None
    value = base
    for d0, d1 in dims:
        value = value.transpose(d0, d1)
    return base, value


def _spans_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _layer_key(node: fx.Node, seen: dict[str, int]) -> str:
    """The layer's name, the same on every rank and in every recompile: module path and position."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else "<model>"
    index = seen.get(path, 0)
    seen[path] = index + 1
    return f"{path}#{index}" if index else path


def _token_counter(value: Any, gm: fx.GraphModule) -> Callable[[Sequence[Any]], int] | None:
    """A function of the graph's inputs giving ``value`` (an int or a SymInt of the inputs' sizes)."""
    if isinstance(value, int):
        return lambda args: value
    if not isinstance(value, torch.SymInt):
        return None
    expr = value.node.expr
    where: dict[Any, tuple[int, int | None]] = {}
    for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        v = _value(ph)
        if isinstance(v, torch.SymInt) and v.node.expr.is_symbol:
            where.setdefault(v.node.expr, (i, None))
        elif isinstance(v, torch.Tensor):
            for d, s in enumerate(v.shape):
                if isinstance(s, torch.SymInt) and s.node.expr.is_symbol:
                    where.setdefault(s.node.expr, (i, d))
    if any(sym not in where for sym in expr.free_symbols):
        return None
    places = {sym: where[sym] for sym in expr.free_symbols}

    def count(args: Sequence[Any]) -> int:
        subs = {sym: (args[i] if d is None else args[i].shape[d]) for sym, (i, d) in places.items()}
        return int(expr.xreplace({k: int(v) for k, v in subs.items()}))

    return count


class _StepAgreement:
    """Call check: ``ep_agree_step`` with the graph's largest expert-parallel token count (one host collective)."""

    def __init__(self, group_name: str, max_tokens: int, counters: list[Callable[[Sequence[Any]], int]]) -> None:
        self.group_name, self.max_tokens, self.counters = group_name, max_tokens, counters

    def __call__(self, args: Sequence[Any]) -> None:
        tokens = max(c(args) for c in self.counters)
        torch.ops.moe_fx.ep_agree_step(tokens, self.max_tokens, self.group_name)


class _Rewriter:
    """State of one ``split_ep`` run over one graph."""

    def __init__(self, gm: fx.GraphModule, ctx: Any, group_name: str, world: int, rank: int) -> None:
        self.gm, self.ctx, self.group_name, self.world, self.rank = gm, ctx, group_name, world, rank
        config = ctx.config
        self.fake_mode = _fake_mode(gm)
        self.max_tokens = int(config.max_tokens_per_rank)
        self.eplb = bool(getattr(config, "eplb", False))
        self.redundant = int(getattr(config, "eplb_redundant_slots", 0))
        self.to_compact: dict[int, tuple[torch.Tensor, list[int], tuple, Any]] = {}
        self.counters: list[Callable[[Sequence[Any]], int]] = []
        self.layer_names: dict[str, int] = {}
        self.buffers = 0
        self.stale_views: list[fx.Node] = []

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.gm.graph.call_function(target, args, kwargs or {})
        if self.fake_mode is not None:
            fargs = torch.fx.node.map_arg(args, _value)
            fkwargs = torch.fx.node.map_arg(kwargs or {}, _value)
            with self.fake_mode:
                _set_val(node, target(*fargs, **fkwargs))
        return node

    def buffer(self, name: str, value: torch.Tensor, like: fx.Node) -> fx.Node:
        """A get_attr node reading ``value``, registered as a buffer of the graph module."""
        self.buffers += 1
        return add_weight_buffer(self.gm, f"moe_fx_ep_{self.buffers}_{name}", value, like)

    # ---- checks -------------------------------------------------------------------------------

    def num_experts(self, a: dict) -> int | None:
        w13 = _value(a["w13"])
        if not isinstance(w13, torch.Tensor):
            w13 = _real_value(self.ctx, self.gm, a["w13"])
        return None if w13 is None else int(w13.shape[0])

    def check(self, node: fx.Node) -> str | None:
        """Why ``node`` cannot be split (None: it can). ``ValueError`` for E not divisible by the world size."""
        a = _bind_experts(*node.args, **node.kwargs)
        num_experts = self.num_experts(a)
        if num_experts is None:
            return "no value known for w13 (cannot tell the number of experts)"
        if num_experts % self.world:
            raise ValueError(
                f"moe_fx.split_ep: {num_experts} experts cannot be split evenly over {self.world} ranks "
                f"(node {node.name}); expert parallelism needs E % world_size == 0"
            )
        hidden, ids = _value(a["hidden"]), _value(a["topk_ids"])
        if not isinstance(hidden, torch.Tensor) or not isinstance(ids, torch.Tensor):
            return "no value known for hidden or topk_ids"
        if not isinstance(ids.shape[1], int) or not isinstance(hidden.shape[1], int):
            return "top-k or hidden size is symbolic"
        t = hidden.shape[0] * (ids.shape[1] if a["weights_on_input"] else 1)
        if _token_counter(t, self.gm) is None:
            return "its token count cannot be computed from the graph's inputs at call time"
        return None

    # ---- weights ------------------------------------------------------------------------------

    def rows_of_rank(self, num_experts: int, layer: eplb.EPLBLayer | None) -> list[int]:
        """The logical experts of this rank's (physical) rows, in order."""
        if layer is not None:
            return layer.rows_of(self.rank)
        e_local = num_experts // self.world
        return list(range(self.rank * e_local, (self.rank + 1) * e_local))

    def local_weight(self, name: str, arg: Any, rows: list[int], compact: set[int],
                     layer: eplb.EPLBLayer | None) -> fx.Node | None:
        """A node for this rank's rows of weight (or scale, or bias) ``arg`` (see the module docstring)."""
        if arg is None:
            return None
        real, value = _real_weight(self.ctx, self.gm, arg)  # the model's tensor, and arg's view of it
        key = (self.group_name, self.world, self.rank, len(rows))
        mark = getattr(real, _LOCAL_ATTR, None) if real is not None else None
        if mark is not None:
            if mark != key:
                raise ValueError(
                    f"moe_fx.split_ep: the expert weight behind {arg.name} was already reduced to the experts of "
                    f"(group, world, rank, rows) = {mark} by an earlier compilation; this one is {key}. "
                    "Recompile from a freshly loaded model."
                )
            return self.first_rows(arg, len(rows))
        if real is not None and id(real) in compact:
            self.to_compact[id(real)] = (real, rows, key, (layer, name))
            return self.first_rows(arg, len(rows))
        if layer is None:
            return self.call(torch.narrow, (arg, 0, rows[0], len(rows)))
        physical = layer.weights.get(name)
        if physical is None:
            if value is None:
                raise ValueError(f"moe_fx.split_ep: EPLB needs the real value of {arg.name} to build its copies")
            with torch.no_grad():
                physical = layer.weights[name] = value.detach()[rows].contiguous()
        return self.buffer(name, physical, arg)

    def first_rows(self, arg: fx.Node, rows: int) -> fx.Node:
        """``arg`` narrowed to its first ``rows`` experts, narrowing the compacted tensor itself before any
        transpose of it (a view of all E experts would reach past its shrunk storage)."""
        base, dims = _base_of(arg)
        node = self.call(torch.narrow, (base, 0, 0, rows))
        for d0, d1 in dims:
            node = self.call(torch.transpose, (node, d0, d1))
        view = arg
        while view is not base:  # the full-size views go once nothing reads them
            self.stale_views.append(view)
            view = view.args[0]
        return node

    def drop_stale_views(self) -> None:
        """Erase the transposes of compacted weights that no node reads any more."""
        for view in dict.fromkeys(self.stale_views):  # outermost view first, then what it viewed
            if not view.users:
                self.gm.graph.erase_node(view)

    def compactable(self, arg: Any, splittable: set[fx.Node]) -> int | None:
        """``id`` of the real tensor behind ``arg`` (through transposes) if it may be compacted in place, else None."""
        base, _ = _base_of(arg)
        if not isinstance(base, fx.Node) or base.op != "placeholder":
            # Only Dynamo-lifted parameters: a get_attr tensor was made by an earlier pass (stacked
            # per-expert weights, whose original parameters may be views into it) and is left whole.
            return None
        real = _real_value(self.ctx, self.gm, base)
        if real is None or hasattr(real, _LOCAL_ATTR):
            return None
        if not (real.is_contiguous() and _spans_storage(real) and real.untyped_storage().resizable()):
            return None
        # every reader is a split experts node, or a transposed view read only by such nodes
        for u in base.users:
            if u not in splittable and not (_dim0_view(u) is not None and all(v in splittable for v in u.users)):
                return None
        return id(real)

    def compact(self) -> int:
        """Shrink every scheduled weight to this rank's rows, in place; returns bytes released."""
        released = 0
        for real, rows, key, (layer, name) in self.to_compact.values():
            d = real.detach()
            n = len(rows)
            with torch.no_grad():
                if rows == list(range(rows[0], rows[0] + n)):
                    if rows[0]:
                        d[:n].copy_(d[rows[0] : rows[0] + n])
                else:
                    d[:n] = d[rows].clone()  # gathered first: the rows may overlap their destinations
            before = real.untyped_storage().nbytes()
            real.untyped_storage().resize_(n * d.stride(0) * d.element_size())
            released += before - real.untyped_storage().nbytes()
            setattr(real, _LOCAL_ATTR, key)
            if layer is not None:
                layer.weights[name] = real.detach().narrow(0, 0, n)
        return released

    # ---- the rewrite --------------------------------------------------------------------------

    def anchor(self, node: fx.Node, a: dict) -> torch.Tensor | None:
        """A model weight of ``node``'s layer that outlives this graph (its EPLB state is attached to it)."""
        for name in _WEIGHTS:
            base, _ = _base_of(a[name])
            if isinstance(base, fx.Node) and base.op == "placeholder":
                real = _real_value(self.ctx, self.gm, base)
                if real is not None:
                    return real
        # weights an earlier pass made (fp8 buffers): the model's own weights they came from
        report_index = node.meta.get("moe_fx", {}).get("report_index")
        sources = getattr(self.ctx, "weight_sources", {}).get(report_index)
        if sources and sources[0]:
            ref = sources[0][0]
            real = self.ctx.example_inputs[ref] if isinstance(ref, int) else ref
            return real if isinstance(real, torch.Tensor) else None
        return None

    def eplb_layer(self, node: fx.Node, a: dict, num_experts: int, device: torch.device) -> eplb.EPLBLayer | None:
        """The EPLB state of ``node``'s layer: found again (a recompile) or made; None when it has no anchor."""
        key = _layer_key(node, self.layer_names)
        anchor = self.anchor(node, a)
        if anchor is None:
            log.warning("split_ep: %s gets no EPLB: none of its weights is a model tensor that outlives the graph", key)
            return None
        slots = eplb.slots_per_rank(num_experts, self.world, self.redundant)
        layer = eplb.layer_of(anchor)
        if layer is None:
            layer = eplb.attach_layer(anchor, eplb.EPLBLayer.create(key, self.group_name, num_experts, self.world,
                                                                   slots, device))
        eplb.check_fits(layer, self.group_name, num_experts, self.world, slots)
        return layer

    def map_to_physical(self, ids: fx.Node, num_experts: int, top_k: int, layer: eplb.EPLBLayer,
                        like: fx.Node) -> fx.Node:
        """Logical ids -> physical ids through the layer's map, counting the step's load (no host sync)."""
        log_to_phys = self.buffer("log_to_phys", layer.log_to_phys, like)
        replicas = self.buffer("replicas", layer.replicas, like)
        load = self.buffer("load", layer.load, like)
        c = self.call
        ids_l = c(torch.Tensor.long, (ids,))
        valid = c(torch.logical_and, (c(torch.ge, (ids_l, 0)), c(torch.lt, (ids_l, num_experts))))
        safe = c(torch.where, (valid, ids_l, 0))
        # pair (t, k) is the step's pair number t * K + k; it takes copy number (t * K + k) % replicas[e],
        # which spreads a hot expert's pairs evenly over its copies
        ones = c(torch.ones_like, (ids_l,))
        token = c(torch.sub, (c(torch.cumsum, (ones, 0)), 1))
        slot = c(torch.sub, (c(torch.cumsum, (ones, 1)), 1))
        pos = c(torch.add, (c(torch.mul, (token, top_k)), slot))
        sel = c(torch.remainder, (pos, c(operator.getitem, (replicas, safe))))
        phys = c(operator.getitem, (log_to_phys, (safe, sel)))
        # ids that name no expert stay out of range (-1 stays -1), so the backends treat them as before
        other = c(torch.where, (c(torch.lt, (ids_l, 0)), ids_l, c(torch.add, (ids_l, layer.world * layer.slots - num_experts))))
        counted = c(torch.where, (valid, ids_l, num_experts))
        c(torch.ops.aten.index_add_.default, (load, 0, c(torch.Tensor.reshape, (counted, -1)),
                                              c(torch.ones_like, (c(torch.Tensor.reshape, (counted, -1)),))))
        return c(torch.where, (valid, phys, other))

    def rewrite(self, node: fx.Node, compact: set[int]) -> None:
        """Replace ``node`` by dispatch -> masked_experts -> combine -> remaining rounds (``check`` said it can)."""
        a = _bind_experts(*node.args, **node.kwargs)
        num_experts = self.num_experts(a)
        hidden, ids, weights = a["hidden"], a["topk_ids"], a["topk_weights"]
        hidden_v, ids_v = _value(hidden), _value(ids)
        h = hidden_v.shape[1]
        top_k = int(ids_v.shape[1])
        w13_v = _value(a["w13"])
        w13_dtype = w13_v.dtype if isinstance(w13_v, torch.Tensor) else _real_value(self.ctx, self.gm, a["w13"]).dtype
        use_fp8 = w13_dtype == _FP8 and hidden_v.dtype == torch.bfloat16 and h % _FP8_BLOCK == 0
        n_identity = int(a["identity_experts"])
        on_input = bool(a["weights_on_input"])
        layer = self.eplb_layer(node, a, num_experts, hidden_v.device) if self.eplb else None
        physical = num_experts if layer is None else layer.world * layer.slots
        rows = self.rows_of_rank(num_experts, layer)

        graph = self.gm.graph
        c = self.call
        with graph.inserting_before(node):
            w = {name: self.local_weight(name, a[name], rows, compact, layer) for name in _WEIGHTS}
            routed = ids
            if n_identity:
                # identity (zero-computation) experts: no weights, so no communication; w * x added below
                is_identity = c(torch.logical_and, (c(torch.ge, (ids, num_experts)),
                                                    c(torch.lt, (ids, num_experts + n_identity))))
                routed = c(torch.where, (is_identity, -1, ids))
                identity_w = c(torch.sum, (c(torch.mul, (c(torch.Tensor.float, (weights,)),
                                                          c(torch.Tensor.float, (is_identity,)))), -1),
                               {"keepdim": True})
            if layer is not None:
                routed = self.map_to_physical(routed, num_experts, top_k, layer, hidden)
            send, send_ids, send_w, k_sent = hidden, routed, weights, top_k
            if on_input:
                # each (token, k) pair is its own row w_k * x_t, combined with weight 1 and summed below
                scaled = c(torch.mul, (c(torch.Tensor.unsqueeze, (hidden, 1)),
                                       c(torch.Tensor.to, (c(torch.Tensor.unsqueeze, (weights, -1)), hidden_v.dtype))))
                send = c(torch.Tensor.flatten, (scaled, 0, 1))
                send_ids = c(torch.Tensor.reshape, (routed, (-1, 1)))
                send_w = c(torch.ones_like, (send_ids,), {"dtype": torch.float32})
                k_sent = 1
            tokens = _value(send).shape[0]
            self.counters.append(_token_counter(tokens, self.gm))
            first = self.first_round(send, tokens)
            send0, ids0, w0 = (x if first is None else c(torch.narrow, (x, 0, 0, first)) for x in (send, send_ids, send_w))
            dispatch_args = (physical, self.max_tokens, self.group_name, use_fp8, "auto")
            ticket = c(torch.ops.moe_fx.ep_dispatch_send.default, (send0, ids0, *dispatch_args))
        # The rest goes just before the first reader of the result, and then with the views of the
        # result down to their first other consumer (_sink): independent work the model does in between
        # (shared experts) then runs while the tokens are in flight, between dispatch's send and receive.
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_user = min(node.users, key=order.__getitem__, default=None)
        before = set(graph.nodes)
        with graph.inserting_before(first_user if first_user is not None else node.next):
            disp = c(torch.ops.moe_fx.ep_dispatch_recv.default, (ticket, send0, *dispatch_args))
            parts = [c(operator.getitem, (disp, i)) for i in range(5)]
            expected_m = self.expected_m(tokens, k_sent, physical)
            form = {k: a[k] for k in _FORM_ARGS}
            y = c(torch.ops.moe_fx.masked_experts.default,
                  (parts[0], parts[2], w["w13"], w["w2"], a["activation"], parts[1] if use_fp8 else None,
                   w["w13_scale"], w["w2_scale"], expected_m, a["kernel_choice"]),
                  {"w13_bias": w["w13_bias"], "w2_bias": w["w2_bias"], **form})
            if "moe_fx" in node.meta:  # which region it is (explain reports its kernel)
                y.meta["moe_fx"] = node.meta["moe_fx"]
            common = dispatch_args
            out0 = c(torch.ops.moe_fx.ep_combine.default, (y, ids0, w0, parts[3], parts[4], *common))
            out = c(torch.ops.moe_fx.ep_remaining_rounds.default,
                    (out0, send, send_ids, send_w, w["w13"], w["w2"], *common),
                    {"activation": a["activation"], "w13_scale": w["w13_scale"], "w2_scale": w["w2_scale"],
                     "w13_bias": w["w13_bias"], "w2_bias": w["w2_bias"], **form, "expected_m": expected_m,
                     "experts_kernel_choice": a["kernel_choice"]})
            if on_input:
                per_slot = c(torch.Tensor.view, (out, (-1, top_k, h)))
                out = c(torch.Tensor.to, (c(torch.sum, (c(torch.Tensor.float, (per_slot,)), 1)), hidden_v.dtype))
            if n_identity:
                extra = c(torch.mul, (c(torch.Tensor.float, (hidden,)), identity_w))
                total = c(torch.add, (c(torch.Tensor.float, (out,)), extra))
                out = c(torch.Tensor.to, (total, hidden_v.dtype))
        heads = [n for n in graph.nodes if n not in before]
        out.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        _sink(heads)

    def first_round(self, send: fx.Node, tokens: Any) -> Any:
        """Round 0's token count: None when it is all of them (no narrowing), else an int or a SymInt node."""
        if isinstance(tokens, int):
            return None if tokens <= self.max_tokens else self.max_tokens
        size = self.call(torch.ops.aten.sym_size.int, (send, 0))
        return self.call(torch.sym_min, (size, self.max_tokens))

    def expected_m(self, tokens: Any, top_k: int, num_experts: int) -> int:
        """Uniform-load rows per local expert (DESIGN.md): ``ceil(T_total * K / E)``, to 16, in ``[16, M]``."""
        m = self.max_tokens * self.world
        t = min(tokens, self.max_tokens) if isinstance(tokens, int) else self.max_tokens
        est = math.ceil(t * self.world * top_k / num_experts)
        return max(16, min(m, -(-est // 16) * 16))


#: Pure ops that only re-view or cast a tensor: the combine is moved with them to their first other consumer.
_VIEW_OPS = frozenset(
    {"view", "reshape", "unsqueeze", "squeeze", "flatten", "contiguous", "view_as", "reshape_as", "to", "type"}
)


def _sink(heads: list[fx.Node]) -> None:
    """Move ``heads`` (the combine and what follows it, the last one the result) and the view/cast nodes
    that follow the result down to their first other consumer.

    Models usually re-view the experts' result at once (``.view(*orig_shape)``) and add the shared
    experts after; placing the combine (and those views) just before the add leaves the shared-expert
    work between dispatch and combine, where it can overlap the exchange.
    """
    out = heads[-1]
    chain, frontier = list(heads), [out]
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
        a = _bind_experts(*node.args, **node.kwargs)
        for name in _WEIGHTS:
            if isinstance(a[name], fx.Node):
                key = rw.compactable(a[name], splittable)
                if key is not None:
                    compact.add(key)
    for node in nodes:
        if node in splittable:
            rw.rewrite(node, compact)
    rw.drop_stale_views()
    released = rw.compact()
    if splittable:
        gm.graph.lint()
        gm.recompile()
        ctx.call_checks.append(_StepAgreement(group_name, rw.max_tokens, rw.counters))
        interval = int(getattr(config, "eplb_interval", 0))
        if rw.eplb and interval:
            ctx.call_checks.insert(0, eplb.IntervalTrigger(group_name, interval))
    log.info(
        "split_ep: %d experts node(s) split over %d ranks (rank %d); %.1f MiB of other ranks' experts released",
        len(splittable),
        world,
        rank,
        released / 2**20,
    )
    return len(splittable)
