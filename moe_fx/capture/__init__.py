"""Module capture: what must happen to a model's modules before Dynamo traces it (no graph code).

Some experts modules cannot reach the graph pass as one traceable region: a loop over the experts a batch
hits breaks the graph (:mod:`.hit_loops`), and transformers' fine-grained FP8 experts load kernels or loop
in ways Dynamo cannot trace (:mod:`.fp8_modules`). A capture step recognises such a module, proves what it
computes, and gives it a forward that calls ``moe_fx::experts`` on views of its own parameters; Dynamo then
traces one op. The steps run in the order of :data:`moe_fx.capture.steps.STEPS` (data, printable), applied by
``moe_fx.compile`` and ``moe_fx.explain`` and released by explain.

* :mod:`.steps` — the ordered list of steps, :func:`~.steps.capture_modules` / :func:`~.steps.release_modules`;
* :mod:`.patch` — how a step patches a module (an instance forward) and releases it;
* :mod:`.hit_loops`, :mod:`.fp8_modules` — the two steps;
* :mod:`.record_forward` — a module's forward recorded as an FX graph, so that the graph pass's structural
  reader (:mod:`moe_fx.passes.recognize.read_form`) proves it the way it proves a region;
* :mod:`.inventory` — every MoE layer of a model, so that explain names those nothing recognised.

Dependencies go one way: capture may import :mod:`moe_fx.passes` (the reader, the report type) and
:mod:`moe_fx.verify` (the numerical check); neither imports capture.
"""
