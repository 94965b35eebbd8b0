"""Graph side of moe_fx: find MoE regions in Dynamo's FX graph and rewrite them into moe_fx ops.

Pipeline (ordered in :mod:`moe_fx.passes.manager`): ``rewrite_moe_regions`` (find_experts ->
extract_region -> read_form (the structure proves the form) -> verify_region (the numerical check,
:mod:`~moe_fx.passes.check_numerics`, confirms it) -> rewrite), ``quantize_experts`` (``MoEConfig(quantize="fp8")``),
``split_ep`` (expert parallelism). Never imports a kernel; :mod:`moe_fx.ops` is the contract.
"""
