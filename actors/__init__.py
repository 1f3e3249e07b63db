"""kvactor's actors, the microkernel that runs them, and the application built from them.

Every engine process imports this package before torch and before it starts a thread, so
this is where the process-wide settings are made:
- oneDNN's (and PyTorch's ideep) primitive caches are bounded, as they otherwise keep one
  compiled primitive per distinct matmul shape (every prefill length and batch size a
  server meets, up to 1024 of them), and the runner's memory grows for hours under a mixed
  load. An explicit setting in the environment wins.
- glibc malloc keeps freed large blocks (`kernels.host_memory`), so the tensors a step
  allocates afresh every time (the logits above all) stop page-faulting on every step.
- Where torch is told to dispatch at AVX2 or below (`ATEN_CPU_CAPABILITY=avx2`, or
  `default`), the libraries that choose their own instructions are told too: oneDNN
  (`ONEDNN_MAX_CPU_ISA`) and fbgemm, whose fp16 product the fp32 model's linears use
  (`FBGEMM_ENABLE_INSTRUCTIONS`); kvactor's own kernel follows torch (`kernels.cpu`). So
  that one variable serves on an AVX-512 CPU as an AVX2-only CPU would. An explicit
  setting of either wins.
"""

import os

from kernels.host_memory import keep_freed_memory

os.environ.setdefault("LRU_CACHE_CAPACITY", "64")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
keep_freed_memory()
if os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() in ("avx2", "default"):
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    os.environ.setdefault("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
