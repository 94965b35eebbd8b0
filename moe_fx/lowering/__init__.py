"""Kernel side of moe_fx: implementations of the moe_fx ops, chosen when a graph is compiled.

Never looks at a graph. Importing it registers the device implementations of the ops (cheaply: the
kernel libraries, Triton and DeepGEMM, are imported on first use). Layout:

* :mod:`.problem` — what a choice depends on (plain values), device capabilities, token-count regimes;
* :mod:`.select` — the one selector (:class:`~.select.Choice`) over both families below;
* :mod:`.prepare_finalize` — local permute, DeepEP low-latency, torch.distributed (fixed-size or synced);
* :mod:`.masked_experts` — the GEMM1 -> activation -> GEMM2 pipeline on DeepGEMM, Triton or the reference;
* :mod:`.experts` — the ops lowered onto those; :mod:`.register` — their registration;
* :mod:`.triton` — moe_fx's Triton kernels; :mod:`.layouts`, :mod:`.quant`, :mod:`.weights` — fp8 layouts,
  quantisers and the once-per-model weight packing; :mod:`.settings` — the settings a compiled graph depends on
  (the backend puts their hash in Inductor's cache key).
"""

from moe_fx.lowering import register  # noqa: F401
