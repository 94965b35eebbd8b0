import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Inductor's FX graph cache keys a graph by its code, not by the schemas of the custom ops it calls:
# a graph that calls torch.ops.moe_fx.* with default arguments, compiled under an older op schema (an
# earlier commit, another checkout on the same machine), is replayed with the old defaults. The moe_fx
# backend salts the key with its source hash; plain backend="inductor" tests cannot, so every test
# session compiles into its own cache.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="moe_fx_tests_inductor_")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
atexit.register(shutil.rmtree, _INDUCTOR_CACHE, ignore_errors=True)

import pytest
import torch

# tests/helpers.py is imported as a plain module by the test files.
sys.path.insert(0, str(Path(__file__).parent))


class _Sm90Driver:
    """Triton's driver as an H200 would show it, for the compile-side analysis only (nothing launches)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cuda", 0)

    def get_current_device(self):
        return 0


@pytest.fixture
def sm90(monkeypatch):
    from triton.runtime import driver

    monkeypatch.setattr(driver, "_active", _Sm90Driver())
