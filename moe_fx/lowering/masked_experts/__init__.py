"""Masked experts: GEMM1 -> activation -> GEMM2 on the masked layout ``[E, M, *]`` + ``masked_m``.

One pipeline (:mod:`.pipeline`), several GEMM implementations, each in its own module with its
capability check ``supports(problem, caps) -> (ok, reason)`` beside it:

* :mod:`.deepgemm` — DeepGEMM's masked grouped GEMMs (Hopper, 128-aligned shapes, bf16 or fp8);
* :mod:`.triton` — moe_fx's own Triton GEMMs (any shape; bf16/fp16/fp32 or fp8);
* :mod:`.reference` — the torch reference of the ops (any device; the only choice without Triton).

:mod:`moe_fx.lowering.select` picks one (family ``"experts"``).
"""
