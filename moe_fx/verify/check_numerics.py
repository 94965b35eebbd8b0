"""The numerical check behind every rewrite and capture: the second line, after the structural proof.

:mod:`~moe_fx.passes.recognize.read_form` proves from the graph which computation a region is; this module confirms it by running the
region (the graph pass, :mod:`~moe_fx.passes.recognize.verify_region`) or the captured module's forward (:mod:`~moe_fx.capture.hit_loops`)
and comparing it with :func:`~moe_fx.ops.experts_reference` for the one reading the structure gave. It is what
checks the routing plumbing (which row meets which expert weight), which the structure does not model. What
makes it hard to fool:

* **float32**: the caller runs the candidate in float32 (a low-precision region is upcast), so the bound is
  tight (:data:`TOLERANCE`) instead of one that bf16 rounding needs;
* **per token**: each token's error is divided by ``sum_k |w_k| * ||expert_k(x)||``, which cannot cancel, and
  the worst token decides (one global norm dilutes an expert that is off); the report names the expert whose
  tokens are worst;
* **weights**: the real ones and random ones of the same shapes (:func:`random_weight`), so weights of the
  moment (zeros before a ``load_state_dict``) prove nothing wrong;
* **routing**: ids that reach every expert, uneven loads (:func:`~moe_fx.verify.probe_plan.probe_routing`),
  routing weights of both signs (:func:`signed_weights`: weights on the input and on the output differ);
* **inputs**: scales 1 and 4 and one past the clamp bound of the form (:func:`clamp_scale`), the only
  threshold a form that the structure accepts has;
* **tokens**: the caller adds cases at a token count well above the traced one for symbolic shapes
  (:func:`large_tokens`);
* **ids out of range**: where nothing bounds the ids to ``[0, E)``, the caller adds cases with ``-1`` and ``E``
  in some slots (:func:`out_of_range_cases`): the op skips those slots, and so must the candidate (a gather
  ``w13[ids]`` reads expert ``E - 1`` for ``-1``); a candidate that raises on them gives no answer there to
  contradict, and that case is not counted.

Standalone: it knows tensors and the op's reference, not graphs or modules.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from moe_fx.ops import ExpertActivation, experts_reference

__all__ = [
    "TOLERANCE",
    "NumericsResult",
    "OpWeights",
    "ProbeCase",
    "Semantics",
    "check_cases",
    "clamp_scale",
    "exact_float32",
    "large_tokens",
    "make_cases",
    "out_of_range_cases",
    "random_weight",
    "signed_weights",
]

#: Largest per-token error (see the module docstring) of a float32 run; float64 runs get a smaller one.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
#: Input scales of the runs, in turn (a second scale catches a region that is not homogeneous).
SCALES = (1.0, 4.0)
#: The clamp run drives the first product's outputs to about this many times the clamp bound.
CLAMP_REACH = 3.0
#: A random weight larger than this (bytes) is built as overlapping windows of one buffer (:func:`random_weight`).
WINDOWED_BYTES = 256 << 20


@dataclass(frozen=True)
class Semantics:
    """What the candidate must equal: ``moe_fx::experts`` with these arguments (read by :mod:`~moe_fx.passes.recognize.read_form`)."""

    spec: ExpertActivation
    weights_on_input: bool
    identity_experts: int = 0


@dataclass(frozen=True)
class OpWeights:
    """The op's weight arguments for one weight set: ``w13 [E, N1, H]``, ``w2 [E, H, I]``, optional biases, and
    for fp8 weights their fp32 128x128 block scales (the reference dequantises one expert at a time)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class ProbeCase:
    """One run: float tokens ``[T, H]``, top-k ids ``[T, K]``, routing weights ``[T, K]`` (both signs)."""

    weights: str  # the weight set: "real" or "random"
    hidden: torch.Tensor
    ids: torch.Tensor
    routing: torch.Tensor
    scale: float
    sentinel: int | None = None  # an id outside [0, E) some slots hold (:func:`out_of_range_cases`)

    def describe(self) -> str:
        """``"random weights, T=64, scale 4"`` (``", id -1 in some slots"``)."""
        ids = "" if self.sentinel is None else f", id {self.sentinel} in some slots"
        return f"{self.weights} weights, T={self.hidden.shape[0]}, scale {self.scale:g}{ids}"


@dataclass
class NumericsResult:
    """The outcome of :func:`check_cases`: the largest per-token error, and why it failed."""

    ok: bool
    error: float
    reason: str = ""
    worst_expert: int | None = None


@contextlib.contextmanager
def exact_float32(single_thread: bool = False) -> Iterator[None]:
    """float32 products computed in float32, as the tight bound assumes: no TF32, no ambient autocast (a region
    whose products autocast would recast is refused before any probe; see :mod:`~moe_fx.passes.recognize.autocast_guard`).

    ``single_thread``: one CPU thread meanwhile. A probe's tensors are tiny; intra-op threads only add fork-join
    latency, which on a loaded machine costs milliseconds per op (measured: 0.3 s of probe per layer with two
    threads, 20 ms with one, on a shared 2-core machine).
    """
    old = torch.get_float32_matmul_precision()
    cuda = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn.allow_tf32
    threads = torch.get_num_threads()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if single_thread:
        torch.set_num_threads(1)
    try:
        with contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        torch.set_float32_matmul_precision(old)
        torch.backends.cuda.matmul.allow_tf32 = cuda
        torch.backends.cudnn.allow_tf32 = cudnn
        if single_thread:
            torch.set_num_threads(threads)


def large_tokens(num_experts: int, top_k: int) -> int:
    """A token count well above decode sizes for a symbolic T: ``max(64, 4E/K)``, where every expert has
    several tokens (capacities and other load-dependent code show there)."""
    return max(64, math.ceil(4 * num_experts / max(top_k, 1)))


def signed_weights(tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Routing weights ``[T, K]`` with magnitudes in ``[0.1, 1]`` and random signs: with positive weights
    only, ``relu(w * x) = w * relu(x)`` and weights on the input could pass for weights on the output."""
    magnitude = torch.rand(tokens, top_k, generator=gen) * 0.9 + 0.1
    sign = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.5, -1.0, 1.0)
    return magnitude * sign


def random_weight(shape: Sequence[int], fan_in: int, gen: torch.Generator, *, device: torch.device | str = "cpu",
                  windowed_bytes: int = WINDOWED_BYTES, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random tensor of ``shape`` with standard deviation ``1 / sqrt(fan_in)``, in ``dtype`` (float32; fp8
    weights get float8_e4m3fn values, which their block scales then scale).

    A 3-D ``[E, A, B]`` tensor of more than ``windowed_bytes`` (in float32) is made of overlapping windows of one
    buffer (expert ``e + 1`` is expert ``e`` shifted by one row and one column): every expert differs from the
    others, at the memory of one expert; read-only, as the probe uses it.

    The values are drawn on ``device`` by a generator of its own, seeded from ``gen`` (one draw of ``gen``): the
    same ``gen`` state gives the same tensor. A compile probes every MoE layer on random weights of its shapes
    (tens to hundreds of MB a layer at real sizes); drawing them with the host's generator and copying them
    over cost host time at every layer of every compiled graph.
    """
    std = 1.0 / math.sqrt(max(fan_in, 1))
    device = torch.device(device)
    local = _device_generator(device, gen)
    numel = math.prod(shape)
    if len(shape) == 3 and numel * 4 > windowed_bytes and shape[0] > 1:
        e, a, b = shape
        step = b + 1
        buf = torch.randn(a * b + (e - 1) * step, generator=local, device=local.device).mul_(std)
        return buf.to(device=device, dtype=dtype).as_strided((e, a, b), (step, b, 1))
    return torch.randn(*shape, generator=local, device=local.device).mul_(std).to(device=device, dtype=dtype)


def _device_generator(device: torch.device, gen: torch.Generator) -> torch.Generator:
    """A generator on ``device`` (on the CPU for a device without one) seeded by one draw of ``gen``."""
    seed = int(torch.randint(0, 2**62, (), generator=gen))
    try:
        local = torch.Generator(device=device)
    except RuntimeError:  # a device type without generators (meta, or a backend that has none): draw on the CPU
        local = torch.Generator()
    return local.manual_seed(seed)


def clamp_scale(w13: torch.Tensor, limit: float | None) -> float | None:
    """An input scale at which the first product of ``w13 [E, N1, H]`` reaches ~3x ``limit`` (None: no limit).

    For unit-variance tokens each output of the first product has standard deviation = its row's norm; probes
    at ordinary scales may never reach a clamp (GPT-OSS clamps at 7), and an unreached clamp looks like none.
    """
    if limit is None:
        return None
    rows = w13[:8].float() if w13.shape[0] > 8 else w13.float()
    norm = rows.pow(2).sum(-1).mean().sqrt().item()
    return CLAMP_REACH * limit / norm if norm > 0 else None


def make_cases(
    routing: Sequence[torch.Tensor], hidden_size: int, weight_sets: dict[str, float | None], gen: torch.Generator,
    *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
) -> list[ProbeCase]:
    """Cases for each weight set (name -> its clamp scale, None without a clamp): one per routing of
    ``routing`` (ids ``[T, K]``; scales alternating between 1 and 4), plus one at the clamp scale."""
    out = []
    for name, clamp in weight_sets.items():
        plan = [(ids, SCALES[r % len(SCALES)]) for r, ids in enumerate(routing)]
        if clamp is not None and routing:
            plan.append((routing[-1], clamp))
        for ids, scale in plan:
            t, k = ids.shape
            hidden = (torch.randn(t, hidden_size, generator=gen) * scale).to(device=device, dtype=dtype)
            weights = signed_weights(t, k, gen).to(device=device, dtype=dtype)
            out.append(ProbeCase(name, hidden, ids.to(device), weights, scale))
    return out


def out_of_range_cases(cases: Sequence[ProbeCase], num_ids: int, gen: torch.Generator) -> list[ProbeCase]:
    """Copies of the first case of each weight set with ids ``-1`` ("no expert") and ``num_ids`` (one past the
    last expert) in the first slot of every other token: the ids a model writes for a dropped slot or a skip
    expert, which the op skips."""
    out = []
    for name in dict.fromkeys(c.weights for c in cases):
        base = next(c for c in cases if c.weights == name)
        rows = torch.randperm(base.ids.shape[0], generator=gen)[: (base.ids.shape[0] + 1) // 2].to(base.ids.device)
        for sentinel in (-1, num_ids):
            ids = base.ids.clone()
            ids[rows, 0] = sentinel
            out.append(replace(base, ids=ids, sentinel=sentinel))
    return out


def _want(case: ProbeCase, op: OpWeights, sem: Semantics) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference output ``[T, H]`` and each token's error scale ``sum_k |w_k| * ||expert_k(x)||``.

    Every (token, slot) is run as a token of its own through :func:`experts_reference` (one call), so the
    per-slot expert outputs are the reference's own."""
    t, k = case.ids.shape
    flat_hidden = case.hidden.repeat_interleave(k, dim=0)
    flat_ids = case.ids.reshape(-1, 1)
    w = case.routing.reshape(-1, 1)
    s = sem.spec
    slots = experts_reference(
        flat_hidden, flat_ids, w if sem.weights_on_input else torch.ones_like(w), op.w13, op.w2, s.name,
        sem.weights_on_input, op.w13_scale, op.w2_scale, w13_bias=op.w13_bias, w2_bias=op.w2_bias, gated=s.gated,
        gate_up_layout=s.gate_up_layout, alpha=s.alpha, limit=s.limit, up_offset=s.up_offset,
        identity_experts=sem.identity_experts,
    ).to(case.hidden.dtype).view(t, k, case.hidden.shape[-1])  # fmt: skip (T may be 0)
    if not sem.weights_on_input:
        slots = slots * case.routing.unsqueeze(-1)
    return slots.sum(1), slots.norm(dim=-1).sum(1)


def _case_errors(got: torch.Tensor, case: ProbeCase, op: OpWeights, sem: Semantics) -> torch.Tensor:
    """Each token's error ``||got_t - want_t|| / sum_k |w_k| ||expert_k(x_t)||`` (float64; nan stays nan)."""
    want, scale = _want(case, op, sem)
    diff = (got.double() - want.double()).norm(dim=-1)
    return diff / scale.double().clamp_min(1e-30)


def _worst_expert(errors: list[tuple[torch.Tensor, torch.Tensor]], tol: float) -> tuple[int, float] | None:
    """The expert whose tokens have the largest median error (it is off on all of them), if above ``tol``."""
    per: dict[int, list[torch.Tensor]] = {}
    for err, ids in errors:
        for e in ids.unique().tolist():
            per.setdefault(int(e), []).append(err[(ids == e).any(dim=1)])
    medians = {e: torch.cat(v).nan_to_num(math.inf).median().item() for e, v in per.items()}
    if not medians:
        return None
    e, m = max(medians.items(), key=lambda kv: kv[1])
    return (e, m) if m > tol else None


#: Below this many flops per case a CPU probe runs on one thread (:func:`exact_float32`).
SINGLE_THREAD_FLOPS = 5e7


def _small_on_cpu(cases: Sequence[ProbeCase], op_weights: Callable[[str], OpWeights]) -> bool:
    if not cases or cases[0].hidden.device.type != "cpu":
        return False
    op = op_weights(cases[0].weights)
    per_row = 2 * (op.w13[0].numel() + op.w2[0].numel())
    return max(c.ids.numel() for c in cases) * per_row < SINGLE_THREAD_FLOPS


def check_cases(
    run: Callable[[ProbeCase], torch.Tensor | str], op_weights: Callable[[str], OpWeights], sem: Semantics,
    cases: Sequence[ProbeCase], where: str = "",
) -> NumericsResult:
    """Run ``run`` on every case and compare it with the reference for ``sem`` (see the module docstring).

    ``run(case)`` returns the candidate's ``[T, H]`` output for the case, or a string saying why it could not
    run; ``op_weights(name)`` the op's weights of a weight set. ``where`` (e.g. ``" (T=14 x3)"``) goes into the
    reasons.
    """
    worst, worst_case = 0.0, None
    errors: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    with torch.no_grad(), exact_float32(single_thread=_small_on_cpu(cases, op_weights)):
        for case in cases:
            got = run(case)
            if isinstance(got, str) and case.sentinel is not None:
                continue  # the candidate raises on ids outside [0, E): it has no answer there to contradict
            if isinstance(got, str):
                return NumericsResult(False, math.nan, f"the candidate failed on probe inputs{where}: {got}")
            if got.shape != case.hidden.shape:
                return NumericsResult(False, math.nan, f"the candidate returned {list(got.shape)} for probe tokens "
                                                       f"{list(case.hidden.shape)}{where}")
            err = _case_errors(got, case, op_weights(case.weights), sem)
            errors.setdefault(case.weights, []).append((err, case.ids))
            top = err.nan_to_num(math.inf).max().item() if err.numel() else 0.0
            if top > worst or (worst_case is None and not top <= worst):
                worst, worst_case = top, case
    tol = TOLERANCE.get(cases[0].hidden.dtype, TOLERANCE[torch.float32]) if cases else TOLERANCE[torch.float32]
    if worst <= tol:
        return NumericsResult(True, worst)
    found = _worst_expert(errors[worst_case.weights], tol)
    expert = f"; expert {found[0]} is off on its tokens (median error {found[1]:.1e})" if found else ""
    if worst_case.sentinel is not None:
        expert = (f"; the region does not skip id {worst_case.sentinel} as moe_fx::experts does (an id outside "
                  "[0, E) names no expert), and nothing in the graph keeps the ids in range")
    return NumericsResult(
        False, worst,
        f"numerical check failed{where}: a token's error {worst:.2e} > {tol:.0e} ({worst_case.describe()}){expert}",
        None if found is None else found[0],
    )
