"""How big a numerical probe of an experts region is, which routing it uses, and how it is resized.

Every region the pass rewrites is run on random inputs and compared with the op's reference
(:func:`moe_fx.passes.verify_region.probe_region`, :mod:`moe_fx.passes.check_numerics`). This module decides the
probe's shape:

* **size**: the region's own token count T when one run costs at most ``verify_max_flops`` (or under
  ``verify="always"``); otherwise a *reduced* problem of a few tokens. A reduced probe runs the same
  region subgraph at a smaller T: symbolic token counts (``dynamic=True``, automatic dynamic
  recompiles) are evaluated at the new T exactly; a static graph has T baked in as integer literals
  (``view(T, K, H)``, ``arange(T * K)``), which are replaced by the new T. When that is not sound, no
  reduced probe is made and the region is left untouched with the reason: T equals another size of
  the region (a literal could not be told apart), or the region holds literals that may be functions
  of T (a capacity ``int(1.25 * T * K / E)``: at a smaller T it would not act as at T). A symbolic
  size that is not a constant multiple of T is refused the same way.
* **routing**: top-k ids with distinct experts per token (as top-k gives). The first runs give every
  expert at least one token between them (every expert weight is exercised; with few tokens, decode
  with T * K < E, as many runs as that takes); two more runs send most tokens to a few experts
  (uneven loads). Input scales, weight sets and the comparison are :mod:`~moe_fx.passes.check_numerics`'s.

Nothing here reads a graph beyond the region's subgraph; nothing runs the region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from moe_fx.passes.graph_utils import op_name

__all__ = [
    "ProbePlan",
    "coverage_runs",
    "plan_probe",
    "probe_routing",
    "resize_literals",
    "symbolic_value",
    "token_hint",
    "unexplained_literals",
]

#: Token count of a reduced probe when the budget allows more: enough for uneven loads, still cheap.
REDUCED_TOKENS = 32
#: Runs after the covering ones whose routing sends most tokens to a few experts (capacity limits,
#: per-expert buffers and other load-dependent code must show there).
SKEWED_RUNS = 2


@dataclass(frozen=True)
class ProbePlan:
    """The shape of one region's numerical check.

    Attributes:
        tokens: T of every probe run.
        runs: how many runs (each with its own routing and input scale); at least 2.
        traced_tokens: the T the region was traced with (its hint), or None when unknown (data-dependent).
        flops: estimated flops of all runs of the region together.
    """

    tokens: int
    runs: int
    traced_tokens: int | None
    flops: float

    @property
    def reduced(self) -> bool:
        """True when the probe runs the region at another T than it was traced with."""
        return self.tokens != self.traced_tokens

    def describe(self) -> str:
        """``"T=14 x3"`` or ``"reduced T=32 of 2048 x3"`` (tokens per run, runs) for reports."""
        runs = f"x{self.runs}"
        if not self.reduced:
            return f"T={self.tokens} {runs}"
        of = "data-dependent T" if self.traced_tokens is None else str(self.traced_tokens)
        return f"reduced T={self.tokens} of {of} {runs}"


def token_hint(value: object) -> int | None:
    """The concrete value of a token count (an int or a backed SymInt), or None if data-dependent."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return None if hint is None else int(hint)
    return int(value)  # type: ignore[call-overload]


def plan_probe(
    traced_tokens: int | None, rows_per_token: int, num_experts: int, top_k: int, hidden: int,
    intermediate: int, budget: float, mode: str,
) -> ProbePlan:
    """Choose the probe for a region of ``traced_tokens`` tokens (see the module docstring).

    ``rows_per_token`` is how many expert rows one token costs (K for routed forms, E for a dense
    form that runs every expert); ``mode`` is ``MoEConfig.verify`` (``"auto"`` or ``"always"``).
    """
    if num_experts <= 0 or top_k <= 0:
        raise ValueError(f"plan_probe needs E > 0 and K > 0, got E={num_experts}, K={top_k}")
    per_token = 6.0 * rows_per_token * hidden * intermediate
    cover = math.ceil(num_experts / min(top_k, num_experts))  # tokens that can reach every expert once
    full_fits = traced_tokens is not None and (mode == "always" or traced_tokens * per_token <= budget)
    if full_fits:
        tokens = max(int(traced_tokens), 0)  # type: ignore[arg-type]
    else:
        fit = int(budget // per_token) if per_token > 0 else REDUCED_TOKENS
        tokens = max(cover, 2, min(fit, max(REDUCED_TOKENS, cover)))
        if traced_tokens is not None and tokens >= traced_tokens:
            tokens = traced_tokens  # as small as the reduced probe would be: probe the region as it is
    runs = coverage_runs(tokens, num_experts, top_k) + SKEWED_RUNS if tokens > 0 else 1
    return ProbePlan(tokens=tokens, runs=runs, traced_tokens=traced_tokens, flops=runs * tokens * per_token)


def coverage_runs(tokens: int, num_experts: int, top_k: int) -> int:
    """Runs of ``tokens`` tokens it takes to give every expert one token (distinct experts per token)."""
    return math.ceil(num_experts / max(tokens * min(top_k, num_experts), 1))


def probe_routing(tokens: int, runs: int, num_experts: int, top_k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Top-k ids ``[tokens, top_k]`` (int64) for each of ``runs`` runs; a token never names an expert
    twice (as top-k gives).

    The first :func:`coverage_runs` runs give every expert at least one token between them (the
    remaining slots: random, mildly skewed); the others are strongly skewed (a few experts take most
    tokens, the rest none), so that uneven loads are always probed.
    """
    if top_k > num_experts:
        raise ValueError(f"probe routing needs K <= E (top-k ids are distinct), got K={top_k}, E={num_experts}")
    slots = tokens * top_k
    covering = min(coverage_runs(tokens, num_experts, top_k), runs)
    order = torch.randperm(num_experts, generator=gen).tolist() * 2
    out = []
    for r in range(runs):
        ids = torch.full((tokens, top_k), -1, dtype=torch.int64)
        if r < covering:
            if slots >= num_experts:  # one run reaches every expert
                chunk = torch.randperm(num_experts, generator=gen).tolist()
            else:  # consecutive windows of one permutation: run r covers the r-th share of the experts
                start = (r * slots) % num_experts
                chunk = order[start : start + slots]
            for j, e in enumerate(chunk):  # covering experts, token-major: distinct within a token
                ids[j // top_k, j % top_k] = e
            skew = 4.0
        else:
            skew = 12.0
        # The other slots: skewed random top-k over the experts the token does not use yet.
        logits = torch.rand(tokens, num_experts, generator=gen)
        logits += skew * torch.linspace(0, 1, num_experts)[torch.randperm(num_experts, generator=gen)]
        taken = ids >= 0
        logits.masked_fill_(torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids.clamp(min=0), taken), -math.inf)
        best_free = logits.topk(top_k, dim=1).indices
        free_rank = (torch.arange(top_k) - taken.sum(1, keepdim=True)).clamp(min=0)  # taken slots are a prefix
        ids = torch.where(taken, ids, best_free.gather(1, free_rank))
        ids = ids.gather(1, torch.rand(tokens, top_k, generator=gen).argsort(dim=1))  # slot order varies
        out.append(ids[torch.randperm(tokens, generator=gen)])
    return out


#: Comparison ops: a literal compared with (a capacity, a threshold) may be a function of T.
_COMPARISONS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "clamp", "clamp_", "clamp_min", "clamp_max"})


def _literals(n: fx.Node) -> list[tuple[object, bool]]:
    """``(literal, is_getitem_index)`` for every int/float literal in ``n``'s arguments."""
    found: list[tuple[object, bool]] = []
    index_arg = n.args[1] if op_name(n) == "getitem" and len(n.args) > 1 else None

    def visit(a: object) -> object:
        if type(a) in (int, float):
            found.append((a, a is index_arg))
        return a

    fx.node.map_aggregate(n.args, visit)
    fx.node.map_aggregate(n.kwargs, visit)
    return found


def unexplained_literals(
    gm: fx.GraphModule, traced: int, top_k: int, num_experts: int, sizes: set[int]
) -> list[str]:
    """Literals of a static region subgraph that may be functions of its token count T.

    A literal is explained when it is T or T*K (resized), a size of the experts (``sizes``: E, K, H,
    I, ...), a small constant (a dim, a chunk count: ``|v| <= 3``), an expert index (``mask[e]``),
    or a float not compared with anything. Anything else (a capacity ``int(1.25 * T * K / E)``, a
    threshold) might change with T, and a probe at another T would not see what it does at T.
    """
    known = {traced, traced * top_k} | sizes
    out = []
    for n in gm.graph.nodes:
        comparison = op_name(n) in _COMPARISONS
        for v, is_index in _literals(n):
            if abs(v) <= 3 or (type(v) is int and (v in known or (is_index and 0 <= v < num_experts))):
                continue
            if type(v) is float and not comparison:
                continue
            out.append(f"{v!r} in {n.name}")
    return out


def resize_literals(gm: fx.GraphModule, traced: int, tokens: int, top_k: int, num_experts: int,
                    sizes: set[int]) -> str | None:
    """Replace the integer literals T and T*K of a static region subgraph by ``tokens`` and ``tokens*K``.

    ``sizes`` are the other sizes the region knows (E, K, H, I, ...). Nothing is changed, and the
    reason is returned, when T or T*K equals one of them (a literal could not be told apart) or when
    the region holds literals that may depend on T (:func:`unexplained_literals`). None on success.
    """
    mapping = {traced: tokens, traced * top_k: tokens * top_k}
    ambiguous = sorted(k for k in mapping if k in sizes | {-1, 0, 1, 2, 3})
    if ambiguous:
        return (f"the traced token count {traced} (T*K = {traced * top_k}) equals another size of the region "
                f"({ambiguous[0]}), so T cannot be told apart in the graph's integer literals")
    odd = unexplained_literals(gm, traced, top_k, num_experts, sizes)
    if odd:
        return f"the region holds literals that may depend on T ({', '.join(odd[:3])})"

    def swap(a: object) -> object:
        return mapping[a] if type(a) is int and a in mapping else a

    for n in gm.graph.nodes:
        n.args = fx.node.map_aggregate(n.args, swap)
        n.kwargs = fx.node.map_aggregate(n.kwargs, swap)
    gm.recompile()
    return None


def symbolic_value(value: torch.SymInt, tokens_expr: object, tokens: int) -> int:
    """The value of a SymInt read by a region when its token count ``tokens_expr`` takes the value ``tokens``.

    Values that do not depend on T's symbols keep their traced value; values that are a constant
    multiple of T scale with it. Anything else raises ``ValueError`` (the probe cannot be resized).
    """
    expr = value.node.expr
    t_expr = sympy.sympify(tokens_expr)
    if not (expr.free_symbols & t_expr.free_symbols):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"no concrete value known for {expr}")
        return int(hint)
    ratio = sympy.simplify(expr / t_expr)
    if not ratio.is_Rational:
        raise ValueError(f"{expr} is not a constant multiple of the token count {t_expr}")
    scaled = ratio * tokens
    if not scaled.is_Integer:
        raise ValueError(f"{expr} is not an integer at T={tokens}")
    return int(scaled)
