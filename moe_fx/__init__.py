"""moe_fx: rewrite the MoE blocks that torch.compile traces into fast moe_fx custom ops.

Public API::

    model = torch.compile(model, backend="moe_fx")     # or
    model = moe_fx.compile(model, config=moe_fx.MoEConfig(...))
    print(moe_fx.explain(model, *example_inputs))
    moe_fx.rebalance_experts()                         # expert parallelism with MoEConfig(eplb=True)
"""

from moe_fx import ops  # noqa: F401  (registers the custom ops)
from moe_fx import lowering  # noqa: F401  (registers their device implementations)
from moe_fx._version import __version__
from moe_fx.config import MoEConfig

__all__ = ["MoEConfig", "__version__", "compile", "explain", "rebalance_experts"]


def _backend_from_checkout(gm, example_inputs, **compile_kwargs):
    """``backend="moe_fx"`` where moe_fx is importable but not installed (see :func:`_register_backend_name`)."""
    from moe_fx.backend import moe_fx_backend

    return moe_fx_backend(gm, example_inputs, **compile_kwargs)


def _register_backend_name() -> None:
    """Register ``backend="moe_fx"`` when no installed entry point provides it (a source checkout on
    ``PYTHONPATH``). Installed, Dynamo loads the entry point itself; registering here as well would
    make its lookup fail on a duplicate name."""
    from importlib.metadata import entry_points

    if any(ep.name == "moe_fx" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends.registry import register_backend

    try:
        register_backend(compiler_fn=_backend_from_checkout, name="moe_fx")
    except AssertionError:  # registered already in this process
        pass


_register_backend_name()


def __getattr__(name: str):
    # compile/explain pull in the backend and Inductor; load them on first use.
    if name == "compile":
        from moe_fx.api import compile

        return compile
    if name == "explain":
        from moe_fx.api import explain

        return explain
    if name == "rebalance_experts":
        from moe_fx.passes.eplb import rebalance

        return rebalance
    raise AttributeError(f"module 'moe_fx' has no attribute {name!r}")
