"""zeroplus.kernels: pure tensor functions with plain-torch reference twins.

Empty until the memory-techniques issue adds the bf16/fp32 shared-storage split and merge here.
The optimizer steps use torch's fused kernels today (``zeroplus/optim/build.py``).
"""
