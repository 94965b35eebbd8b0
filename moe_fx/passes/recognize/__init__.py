"""Recognisers and guards of the graph pass: what an MoE region is, read from the graph, before anything is rewritten.

In the order :func:`moe_fx.passes.rewrite_moe.rewrite_moe_regions` uses them:

* :mod:`.find_experts` — the anchors: stacked ``[E, N1, H]`` / ``[E, H, I]`` weights or E per-expert linears;
* :mod:`.near_misses` — a report for a ``ModuleList`` of experts no anchor group claimed;
* :mod:`.extract_region` — the region from routing results to the combined output (and :func:`sparse_support`
  for Llama 4's dense scores);
* :mod:`.autocast_guard` — refuses a region whose products autocast recasts;
* :mod:`.read_form` — the structural proof: every op of the region accounted for by one form of the op;
* :mod:`.verify_region` — the numerical confirmation (the region's subgraph on :mod:`moe_fx.verify`'s cases),
  with :mod:`.probe_resize` making a static subgraph run at a reduced token count.

Each reads the graph and returns a value or a reason; none changes the graph.
"""
