"""Whether an NVIDIA GPU is usable here, asked of the CUDA driver itself (no framework imported).

ONNX Runtime's GPU build lists the CUDA and TensorRT providers on every machine; asked for them where
no GPU or driver exists it prints a multi-line load error and runs on the CPU. Asking the driver
first lets the adapter skip those providers and say so in one log line of its own.
"""

from __future__ import annotations

import ctypes
import functools

#: the CUDA driver library's names (Linux, Windows); it ships with the GPU driver, not with CUDA
_DRIVER_LIBRARIES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


@functools.cache
def cuda_device_count() -> int:
    """NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES applies): 0 without a driver or GPU.

    Uses the driver API's `cuInit` and `cuDeviceGetCount` (public, stable since CUDA 2). Called in
    the process that serves (a deployment's load), never before a fork.
    """
    for name in _DRIVER_LIBRARIES:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0  # a driver without a usable GPU (or one hidden by CUDA_VISIBLE_DEVICES)
        return count.value
    return 0
