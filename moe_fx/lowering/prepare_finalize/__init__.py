"""Prepare/finalize: getting tokens into the masked layout ``[E, M, H]`` + ``masked_m`` and back.

Each implementation in its own module with its capability check ``supports(problem, caps)`` beside it
(family ``"prepare_finalize"`` of :mod:`moe_fx.lowering.select`):

* :mod:`.local_permute` — one device: the permute / unpermute Triton kernels of ``moe_fx::experts``;
* :mod:`.deepep_ll` — expert parallelism over DeepEP's low-latency kernels;
* :mod:`.torch_dist_fixed` — expert parallelism over ``torch.distributed`` with a fixed-size exchange
  (no host sync, CUDA-graph capturable; NCCL on GPUs, gloo on CPU);
* :mod:`.torch_dist` — expert parallelism over ``torch.distributed`` all-to-all with counts read on the
  host (gloo's default on CPU).

:mod:`.ep` implements ``moe_fx::ep_dispatch`` (and its two halves) / ``ep_combine`` with the last three;
:mod:`.rounds` the steps larger than ``max_tokens_per_rank`` (``ep_agree_step``, ``ep_remaining_rounds``).
"""
