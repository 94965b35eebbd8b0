"""How a capture step patches a module: an instance ``forward`` bound to the module, and its release.

One mechanism for every step (:mod:`.hit_loops`, :mod:`.fp8_modules`): the class's forward stays as written,
the instance attribute shadows it, and deleting the attribute puts the module back.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn

__all__ = ["patch_forward", "patched_with", "release_patched"]


def patched_with(module: nn.Module, forward: Callable) -> bool:
    """True if ``module``'s instance ``forward`` is ``forward`` bound to it (a capture step patched it)."""
    return getattr(vars(module).get("forward"), "__func__", None) is forward


def patch_forward(module: nn.Module, forward: Callable) -> None:
    """Give ``module`` the forward ``forward(self, ...)`` (shadowing its class's)."""
    module.forward = types.MethodType(forward, module)


def release_patched(model: nn.Module, forward: Callable) -> int:
    """Restore the class forward of every module of ``model`` patched with ``forward``; returns how many."""
    count = 0
    for module in model.modules():
        if patched_with(module, forward):
            del module.forward
            count += 1
    return count
