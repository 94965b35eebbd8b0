"""Implementations of the ``moe_fx::experts`` op on devices (kernels only; selection lives in ``lowering.select``)."""
