"""zeroplus.kernels: pure tensor functions, each beside its plain-torch reference twin and tested against it
(``tests/kernels/``). They hold no state, issue no collective and import nothing of zeroplus; the mechanisms
above drive them.

``bf16_split``: the bf16/fp32 shared-storage split and merge (shared-storage master weights).
``cross_entropy``: a linear head's cross-entropy by tiles of rows and vocabulary slices (tiled loss).
``cross_entropy_rows``: cross-entropy over given logits by blocks of rows, the logits kept (the lean loss).
``attention_blocks``: attention by blocks merged with the online softmax (ring attention).
``npu_adam_w``: the CPU twin of the NPU's AdamW kernel (virtual host memory for optimizer states).
``native_adam``: Adam/AdamW over bf16 moments in one pass on the CPU (``adam_stored.c``, built once per machine),
its twin torch's fused kernel, checked bit for bit when it is loaded.
``swiglu``, ``rms_norm``, ``rotary``, ``grouped_gemm``: the model families' fused operators (``zeroplus.fused_ops``);
``replay``: their gradients, by running the reference again under autograd.

See note: pure kernels (docs/design-notes.md).
"""
