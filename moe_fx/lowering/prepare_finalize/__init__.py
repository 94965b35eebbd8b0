"""Prepare/finalize: getting tokens into the masked layout ``[E, M, H]`` + ``masked_m`` and back.

Each implementation in its own module with its capability check ``supports(problem, caps)`` beside it
(family ``"prepare_finalize"`` of :mod:`moe_fx.lowering.select`):

* :mod:`.local_permute` — one device: the permute / unpermute Triton kernels of ``moe_fx::experts``;
* :mod:`.torch_dist` — expert parallelism over ``torch.distributed`` all-to-all (gloo, NCCL);
* :mod:`.deepep_ll` — expert parallelism over DeepEP's low-latency kernels.

:mod:`.ep` implements the ``moe_fx::ep_dispatch`` / ``ep_combine`` ops with the last two.
"""
