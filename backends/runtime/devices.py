"""Which `device:` values each backend takes: one question, answered by each backend's own rules."""

from __future__ import annotations

from backends.openvino.options import device_problem as openvino_device_problem
from backends.spec import onnx_device_problem
from backends.torch_llm.options import device_problem as torch_device_problem


def device_problem(backend: str, device: str) -> str | None:
    """Why `device` is not a device of `backend` (naming the valid ones), or None when it is.

    The rules live with each backend's options; `tfserving` and `remote` run elsewhere, so their
    `device` is a free label of the upstream's hardware and any value goes.
    """
    if backend == "torch_llm":
        return torch_device_problem(device)
    if backend == "openvino":
        return openvino_device_problem(device)
    if backend == "openvino_llm":
        from backends.openvino_llm.options import device_problem as openvino_llm_device_problem

        return openvino_llm_device_problem(device)
    if backend == "onnxruntime":
        return onnx_device_problem(device)
    return None
