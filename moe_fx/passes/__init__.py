"""Graph side of moe_fx: find MoE regions in Dynamo's FX graph and rewrite them into moe_fx ops.

Pipeline (ordered in :mod:`moe_fx.passes.manager`): ``rewrite_moe_regions`` (find_experts ->
extract_region -> verify_region -> rewrite), ``quantize_experts`` (``MoEConfig(quantize="fp8")``),
``split_ep`` (expert parallelism). Never imports a kernel; :mod:`moe_fx.ops` is the contract.
"""
