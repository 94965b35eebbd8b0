"""GPU check of the end-to-end slice: the pass on transformers' tiny models on CUDA (bf16), through Inductor.

Run on the GPU machine: ``python bench/gpu_pass_check.py``. Prints one line per (family, impl) with the
match count, the kernel explain picks, and the relative logit error against eager.
"""

from __future__ import annotations

import sys
import time

import torch
import transformers

import moe_fx
from moe_fx.testing.models import HF_FAMILIES, tiny_hf_model


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
    ok = True
    for family in HF_FAMILIES:
        for impl in ("grouped_mm", "batched_mm"):
            torch._dynamo.reset()
            model = tiny_hf_model(family, num_layers=2, experts_implementation=impl, hidden=128, intermediate=128,
                                  dtype=torch.bfloat16).cuda()
            ids = torch.randint(0, 128, (2, 33), device="cuda")
            start = time.perf_counter()
            report = moe_fx.explain(model, ids)
            compiled = moe_fx.compile(model)
            with torch.no_grad():
                want = model(ids).logits.float()
                got = compiled(ids).logits.float()
                torch._dynamo.reset()
                plain = torch.compile(model)(ids).logits.float()  # bf16 noise of Inductor alone
            err = ((got - want).norm() / want.norm()).item()
            noise = ((plain - want).norm() / want.norm()).item()
            kernels = sorted({r.kernel for r in report.matched})
            # bf16 logits of a random model differ between any two implementations; compare with the
            # difference plain torch.compile makes.
            line_ok = len(report.matched) == 2 and err < max(3e-2, 2 * noise)
            ok &= line_ok
            print(f"{family:12s} {impl:10s} matched {len(report.matched)}/{len(report.regions)} kernels={kernels} "
                  f"rel_err={err:.2e} (plain inductor {noise:.2e}) {time.perf_counter() - start:.0f}s "
                  f"{'OK' if line_ok else 'FAIL'}")
            for r in report.regions:
                if not r.matched:
                    print("   not matched:", r.one_line())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
