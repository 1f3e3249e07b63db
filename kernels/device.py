"""Where the model runs, and with which attention backend, chosen at start and logged.

`model.device = "auto"` is CUDA when torch sees a GPU, else the CPU (whose behaviour is
unchanged: the torch reference attention, the CPU dtype rules of `kernels.cpu`).
`model.attention = "auto"` is "torch" on the CPU and, on CUDA, "flashinfer" when it is
installed (the `gpu` extra), else the Triton kernels. Asking for something this machine
cannot run fails the start with the reason; nothing here imports a GPU package.
"""

from __future__ import annotations

import importlib.util

import torch

GPU_BACKENDS = ("flashinfer", "triton")


def choose_device(requested: str = "auto") -> tuple[str, str]:
    """("cpu" | "cuda", why)."""
    has_cuda = torch.cuda.is_available()
    if requested == "auto":
        if has_cuda:
            return "cuda", f"auto: CUDA is available ({torch.cuda.get_device_name(0)})"
        return "cpu", "auto: no CUDA device"
    if requested == "cuda" and not has_cuda:
        raise ValueError("model.device = cuda, but torch sees no CUDA device here")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"model.device must be auto, cpu or cuda, got {requested!r}")
    return requested, "set in the config"


def choose_attention(
    requested: str, device: str, dtype: torch.dtype = torch.bfloat16
) -> tuple[str, str]:
    """The attention backend's name for `device` and the model's `dtype`, and why."""
    if requested == "auto":
        if device == "cpu":
            return "torch", "auto: the torch reference on the CPU"
        if dtype == torch.float32:  # FlashInfer has no fp32 kernels
            return "triton", "auto: float32 on CUDA, the Triton kernels"
        if importlib.util.find_spec("flashinfer") is not None:
            return "flashinfer", "auto: flashinfer is installed"
        return "triton", "auto: flashinfer is not installed; the Triton kernels"
    if requested in GPU_BACKENDS and device == "cpu":
        raise ValueError(f"model.attention = {requested} needs model.device = cuda (or auto)")
    if requested == "flashinfer" and dtype == torch.float32:
        raise ValueError("model.attention = flashinfer runs bf16/fp16 models; use triton for fp32")
    return requested, "set in the config"
