"""Tiny models and fixtures for tests, the demo and the benchmarks (nothing is downloaded; weights are random).

* :mod:`.models` — tiny transformers models (Mixtral, Qwen3-MoE, DeepSeek-V3) and hand-written MoE blocks;
* :mod:`.fp8` — a tiny model whose experts are transformers' fine-grained FP8 modules;
* :mod:`.families` — a tiny model of any transformers text MoE family, and user-written blocks of every
  expert form the pass recognises.
"""
