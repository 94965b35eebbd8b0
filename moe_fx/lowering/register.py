"""Registers device kernels for the moe_fx ops; the CPU (and any unregistered device) runs the reference."""
