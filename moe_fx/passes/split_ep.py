"""``split_ep``: under expert parallelism, split each ``moe_fx::experts`` node into dispatch -> experts -> combine.

Runs after the MoE regions have been rewritten into ``torch.ops.moe_fx.experts`` nodes. When
``ctx.config.ep_group`` is set and the group has more than one rank, each experts node becomes::

    recv = moe_fx.ep_dispatch(hidden, topk_ids, E, max_tokens_per_rank, group_name, use_fp8)
    y    = moe_fx.masked_experts(recv[0], recv[2], w13_local, w2_local, activation, x_scale, ...)
    out  = moe_fx.ep_combine(y, topk_ids, topk_weights, recv[3], recv[4], E, max_tokens_per_rank, group_name)

Dispatch and the experts are placed where the experts node was, the combine just before the first
user of its output, so work in between (a DeepSeek block's shared experts) sits between the
communication ops in the graph. ``use_fp8`` is set when the expert weights are fp8 and activations
bf16 (the experts then consume DeepEP's fp8 tokens and scales directly).

Invariants kept (moe_fx/passes/manager.py): every new node gets a fake value (``example_value`` and
``val``) computed by the ops' fake implementations under the graph's own fake mode; no graph input is
mutated; nothing it cannot handle is changed. ``E % world_size != 0`` is a ``ValueError`` here, at
compile time.

Local weights and what "frees the rest" means: the rank's ``E / world`` experts are copied out of
the real weights (``ctx.real_value``) and registered on ``gm`` as buffers read by ``get_attr`` nodes.
The full weights are then freed by resizing their storage to zero bytes, the way FSDP frees
unsharded parameters: the model's ``Parameter`` objects keep their shape, stride, dtype and device,
so Dynamo's guards still pass and no recompile happens, and the compiled graph receives them as
(unused) inputs without reading them. Consequences, on purpose: the eager model can no longer run
after compilation under EP (its expert weights have no data; reading them is invalid), exactly as
with a sharded checkpoint. The local copy is remembered on the full tensor (``_moe_fx_ep_local``),
so a recompile of the same model reuses it instead of reading freed memory; other passes must not
read values of tensors for which :func:`ep_weights_freed` is true. Weights that share their storage
with other tensors, or that the graph still uses elsewhere, are not freed. A weight that is computed
in the graph (no real value) is narrowed in the graph instead (a view; nothing freed).
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from moe_fx.ops.ep import ep_group_name, resolve_ep_group

__all__ = ["ep_weights_freed", "split_ep"]

log = logging.getLogger("moe_fx.passes")

_EXPERTS = torch.ops.moe_fx.experts.default
#: Dynamo records a direct call as the overload packet; rewrites produce the default overload.
_EXPERTS_TARGETS = (torch.ops.moe_fx.experts.default, torch.ops.moe_fx.experts)
_ARG_NAMES = [a.name for a in _EXPERTS._schema.arguments]
_ARG_DEFAULTS = {
    a.name: a.default_value for a in _EXPERTS._schema.arguments if a.has_default_value()
}
_LOCAL_ATTR = "_moe_fx_ep_local"
_FP8 = torch.float8_e4m3fn


def ep_weights_freed(t: torch.Tensor) -> bool:
    """True if ``split_ep`` freed ``t``'s storage (its values must not be read any more)."""
    return hasattr(t, _LOCAL_ATTR) and t.untyped_storage().size() == 0


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
        self.to_free: list[tuple[fx.Node, torch.Tensor]] = []
        self.counter = 0

    def fake(self, t: torch.Tensor) -> Any:
        return None if self.fake_mode is None else self.fake_mode.from_tensor(t, static_shapes=True)

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.gm.graph.call_function(target, args, kwargs or {})
        if self.fake_mode is not None:
            fargs = torch.fx.node.map_arg(args, _value)
            fkwargs = torch.fx.node.map_arg(kwargs or {}, _value)
            with self.fake_mode:
                _set_val(node, target(*fargs, **fkwargs))
        return node

    def local_weight(self, arg: Any, num_experts: int) -> fx.Node | None:
        """A node for this rank's slice ``[rank*E_local, (rank+1)*E_local)`` of weight (or scale) ``arg``."""
        if arg is None:
            return None
        e_local = num_experts // self.world
        lo = self.rank * e_local
        real = _real_value(self.ctx, self.gm, arg)
        if real is None:
            # Computed in the graph: narrow it there (a view; nothing can be freed).
            return self.call(torch.narrow, (arg, 0, lo, e_local))
        cached = getattr(real, _LOCAL_ATTR, None)
        key = (self.group_name, self.world, self.rank)
        if cached is not None and cached[0] == key:
            local = cached[1]
        elif real.untyped_storage().size() == 0:
            raise ValueError(
                f"moe_fx.split_ep: the expert weight behind {arg.name} was freed by an earlier expert-parallel "
                f"compilation with another group/rank ({cached[0] if cached else 'unknown'}); "
                f"recompile from a freshly loaded model"
            )
        else:
            local = real.detach()[lo : lo + e_local].clone(memory_format=torch.contiguous_format)
            setattr(real, _LOCAL_ATTR, (key, local))
        name = f"_moe_fx_ep_w{self.counter}"
        self.counter += 1
        while hasattr(self.gm, name):
            name += "_"
        self.gm.register_buffer(name, local, persistent=False)
        node = self.gm.graph.get_attr(name)
        fv = self.fake(local)
        if fv is not None:
            _set_val(node, fv)
        self.to_free.append((arg, real))
        return node

    def free(self) -> list[str]:
        """Free the full weights no node reads any more; returns the names of those freed."""
        freed = []
        for node, real in self.to_free:
            if node.users or not _spans_storage(real) or real.untyped_storage().size() == 0:
                continue
            if node.op == "get_attr":
                target = str(node.target)
                self.gm.graph.erase_node(node)
                if not any(n.op == "get_attr" and n.target == target for n in self.gm.graph.nodes):
                    owner, _, attr = target.rpartition(".")
                    mod = self.gm.get_submodule(owner) if owner else self.gm
                    if hasattr(mod, attr):
                        delattr(mod, attr)
            real.untyped_storage().resize_(0)
            freed.append(node.name)
        return freed

    def rewrite(self, node: fx.Node) -> str | None:
        """Split one experts node; returns None when done, else why it was left alone."""
        a = _bound_args(node)
        w13_v = _value(a["w13"])
        real_w13 = _real_value(self.ctx, self.gm, a["w13"])
        shape_src = w13_v if isinstance(w13_v, torch.Tensor) else real_w13
        if shape_src is None:
            return "no value known for w13 (cannot tell the number of experts)"
        num_experts = int(shape_src.shape[0])
        if num_experts % self.world:
            raise ValueError(
                f"moe_fx.split_ep: {num_experts} experts cannot be split evenly over {self.world} ranks "
                f"(node {node.name}); expert parallelism needs E % world_size == 0"
            )
        hidden, ids, weights = a["hidden"], a["topk_ids"], a["topk_weights"]
        ids_v = _value(ids)
        top_k = int(ids_v.shape[1]) if isinstance(ids_v, torch.Tensor) else None
        if a["weights_on_input"] and top_k != 1:
            return f"weights_on_input with top-k {top_k}: each copy of a token has its own input; only top-1 is split"
        hidden_v = _value(hidden)
        w_dtype = shape_src.dtype
        use_fp8 = w_dtype == _FP8 and isinstance(hidden_v, torch.Tensor) and hidden_v.dtype == torch.bfloat16

        graph = self.gm.graph
        with graph.inserting_before(node):
            w13 = self.local_weight(a["w13"], num_experts)
            w2 = self.local_weight(a["w2"], num_experts)
            w13_scale = self.local_weight(a["w13_scale"], num_experts)
            w2_scale = self.local_weight(a["w2_scale"], num_experts)
            send, combine_weights = hidden, weights
            if a["weights_on_input"]:
                # Top-1 with the weight on the input: scale before sending, combine with weight 1.
                scale = self.call(torch.Tensor.to, (weights, _value(hidden).dtype)) if hidden_v is not None else weights
                send = self.call(torch.mul, (hidden, scale))
                combine_weights = self.call(torch.ones_like, (weights,))
            disp = self.call(
                torch.ops.moe_fx.ep_dispatch.default,
                (send, ids, num_experts, self.max_tokens, self.group_name, use_fp8, "auto"),
            )
            parts = [self.call(operator.getitem, (disp, i)) for i in range(5)]
            y = self.call(
                torch.ops.moe_fx.masked_experts.default,
                (parts[0], parts[2], w13, w2, a["activation"], parts[1] if use_fp8 else None, w13_scale, w2_scale,
                 self.expected_m(hidden_v, top_k, num_experts), a["kernel"]),
            )
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_user = min(node.users, key=order.__getitem__, default=None)
        with graph.inserting_before(first_user if first_user is not None else node.next):
            out = self.call(
                torch.ops.moe_fx.ep_combine.default,
                (y, ids, combine_weights, parts[3], parts[4], num_experts, self.max_tokens, self.group_name, use_fp8,
                 "auto"),
            )
        out.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        return None

    def expected_m(self, hidden_v: Any, top_k: int | None, num_experts: int) -> int:
        """Uniform-load rows per local expert (DESIGN.md): ``ceil(T_total * K / E)``, to 16, in ``[16, M]``."""
        m = self.max_tokens * self.world
        t = hidden_v.shape[0] if isinstance(hidden_v, torch.Tensor) else None
        t = t if isinstance(t, int) else self.max_tokens
        est = math.ceil(t * self.world * (top_k or 1) / num_experts)
        return max(16, min(m, -(-est // 16) * 16))


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
    count = 0
    for node in nodes:
        why = rw.rewrite(node)
        if why is None:
            count += 1
        else:
            log.info("split_ep: left %s local: %s", node.name, why)
    freed = rw.free()
    if count:
        gm.graph.lint()
        gm.recompile()
    log.info(
        "split_ep: %d experts node(s) split over %d ranks (rank %d); full weights freed: %s",
        count, world, rank, ", ".join(freed) or "none",
    )
    return count
