"""How big a numerical probe of an experts computation is and which routing it uses.

Every region the graph pass rewrites and every module a capture step captures is run on random inputs and
compared with the op's reference (:mod:`moe_fx.verify.check_numerics`; callers: the graph pass's
:func:`moe_fx.passes.recognize.verify_region.probe_region` and :mod:`moe_fx.capture.hit_loops`). This module
decides the probe's shape:

* **size**: the region's own token count T when one run costs at most ``verify_max_flops`` (or under
  ``verify="always"``); otherwise a *reduced* problem of a few tokens. A reduced probe runs the same
  region subgraph at a smaller T: symbolic token counts (``dynamic=True``, automatic dynamic
  recompiles) are evaluated at the new T exactly; a static graph has T baked in as integer literals
  (``view(T, K, H)``, ``arange(T * K)``), which are replaced by the new T
  (:mod:`moe_fx.passes.recognize.probe_resize`, graph side). When that is not sound, no
  reduced probe is made and the region is left untouched with the reason: T equals another size of
  the region (a literal could not be told apart), or the region holds literals that may be functions
  of T (a capacity ``int(1.25 * T * K / E)``: at a smaller T it would not act as at T). A symbolic
  size that is not a constant multiple of T is refused the same way.
* **routing**: top-k ids with distinct experts per token (as top-k gives). The first runs give every
  expert at least one token between them (every expert weight is exercised; with few tokens, decode
  with T * K < E, as many runs as that takes); two more runs send most tokens to a few experts
  (uneven loads). Input scales, weight sets and the comparison are :mod:`~moe_fx.verify.check_numerics`'s.

Nothing here reads a graph or runs the computation: sizes and routing only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "ProbePlan",
    "coverage_runs",
    "plan_probe",
    "probe_routing",
    "token_hint",
    "tokens_text",
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


def tokens_text(num_tokens: object) -> str:
    """``"5"``, ``"symbolic (traced at 5)"`` or ``"data-dependent"``: a token count T for reports."""
    if not isinstance(num_tokens, torch.SymInt):
        return str(num_tokens)
    hint = token_hint(num_tokens)
    return "data-dependent" if hint is None else f"symbolic (traced at {hint})"


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
