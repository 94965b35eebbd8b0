import sys
from pathlib import Path

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
