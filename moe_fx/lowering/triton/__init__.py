"""moe_fx's own Triton kernels for the masked MoE layout (dispatch, grouped GEMMs, activation, combine).

Import the submodules (``dispatch``, ``grouped_gemm``, ``activation``, ``configs``); importing this
package does not import triton. Kernels run compiled on CUDA tensors and under Triton's interpreter
on CPU tensors (see ``_loader``).
"""
