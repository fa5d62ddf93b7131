"""Checks and launch helpers shared by the Triton wrappers (imports triton; not imported by `kernels`)."""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from triton.runtime.interpreter import InterpretedFunction

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def dot_precision(dtype: torch.dtype) -> str | None:
    """tl.dot input_precision: "ieee" makes fp32 dots exact (the default would be TF32 on Ampere+);
    16-bit inputs keep Triton's default (None)."""
    return "ieee" if dtype == torch.float32 else None


def check_launchable(kernel, *tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; CPU tensors only when the kernel was built by the interpreter."""
    device = tensors[0].device
    for t in tensors:
        assert t.device == device, f"all tensors must be on one device: {t.device} vs {device}"
    if device.type == "cpu":
        assert isinstance(kernel, InterpretedFunction), (
            "Triton kernels need CUDA tensors; CPU tensors work only with TRITON_INTERPRET=1 set before "
            "the kernels module is imported (use kernels.reference on CPU)"
        )
    else:
        assert device.type == "cuda", f"unsupported device {device}"
    return device


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """k_cache, v_cache: (num_blocks, block_size, KVH, D), same shape and dtype, unit head_dim stride."""
    assert k_cache.dim() == 4, f"k_cache must be (num_blocks, block_size, KVH, D), got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    assert k_cache.dtype == v_cache.dtype, f"k_cache {k_cache.dtype} != v_cache {v_cache.dtype}"
    assert k_cache.dtype in SUPPORTED_DTYPES, f"unsupported cache dtype {k_cache.dtype}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need a unit stride on head_dim"
    return tuple(k_cache.shape)  # type: ignore[return-value]


def device_guard(device: torch.device):
    """Launch on the tensors' GPU (Triton launches on the current CUDA device)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
