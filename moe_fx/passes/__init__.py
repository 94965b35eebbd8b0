"""Graph side of moe_fx: find MoE regions in Dynamo's FX graph and rewrite them into moe_fx ops.

What a pass may assume and must keep: ``moe_fx/passes/README.md``. The rooms:

* the passes, in the order of :data:`moe_fx.passes.manager.PASSES`: :mod:`.rewrite_moe`
  (``rewrite_moe_regions``: recognise -> prove -> confirm -> rewrite), :mod:`.quantize_experts`
  (``MoEConfig(quantize="fp8")``), :mod:`.split_ep` (expert parallelism, with :mod:`.eplb`'s placement);
* :mod:`.recognize` — the recognisers and guards they use (find_experts, extract_region, read_form,
  verify_region, near_misses, autocast_guard): they read a graph and return a value or a reason;
* infrastructure: :mod:`.manager` (the pass list and the loop), :mod:`.context` (``PassContext``),
  :mod:`.graph_utils`, :mod:`.report` (``RegionReport``), :mod:`.expert_storage` (weights kept in step).

Never imports a kernel (:mod:`moe_fx.lowering`) or module capture (:mod:`moe_fx.capture`); :mod:`moe_fx.ops` is
the contract, :mod:`moe_fx.verify` the numerical check.
"""
