"""The one verification toolkit: the numerical check behind every rewrite and every capture.

The structure proves what a block computes (:mod:`moe_fx.passes.recognize.read_form`); this room confirms it by
running the block in float32 against the op's reference. It knows tensors and the op's reference, not graphs or
modules, so both callers use it alike: the graph pass (:mod:`moe_fx.passes.recognize.verify_region` runs a
region's subgraph) and the capture steps (:mod:`moe_fx.capture.hit_loops` runs a module's own forward).

* :mod:`.probe_plan` — how big a probe is (tokens, runs, the flops budget) and the routing it draws;
* :mod:`.check_numerics` — the cases (weights real and random, scales, clamp reach, large T), the per-token
  error bound and the verdict.

Imports :mod:`moe_fx.ops` only (never passes, capture or lowering).
"""
