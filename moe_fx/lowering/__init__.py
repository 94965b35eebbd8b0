"""Kernel side of moe_fx: picks and runs kernels for the moe_fx ops at run time.

Never looks at a graph. Importing it registers the device implementations of the ops.
"""

from moe_fx.lowering import register  # noqa: F401
