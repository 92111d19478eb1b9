"""zeroplus.kernels: pure tensor functions, each with a plain-torch reference twin.

``bf16_split``: the bf16/fp32 shared-storage split and merge (shared-storage master weights).
"""
