"""moe_fx: rewrite the MoE blocks that torch.compile traces into fast moe_fx custom ops.

Public API::

    model = torch.compile(model, backend="moe_fx")     # or
    model = moe_fx.compile(model, config=moe_fx.MoEConfig(...))
    print(moe_fx.explain(model, *example_inputs))
"""

from moe_fx import ops  # noqa: F401  (registers the custom ops)
from moe_fx.config import MoEConfig

__version__ = "0.1.0"

__all__ = ["MoEConfig", "__version__", "compile", "explain"]


def __getattr__(name: str):
    # compile/explain pull in the backend and Inductor; load them on first use.
    if name == "compile":
        from moe_fx.api import compile

        return compile
    if name == "explain":
        from moe_fx.api import explain

        return explain
    raise AttributeError(f"module 'moe_fx' has no attribute {name!r}")
