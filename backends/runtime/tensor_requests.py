"""What every tensor runtime adapter does the same way around its own `run`: check, batch, wrap.

ONNX Runtime, OpenVINO and TF Serving differ only in how one batch of arrays is run; validating a
request against the metadata, choosing the dynamic batcher or a direct run, wrapping the outputs, and
building warm-up inputs are shared here so the three cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

from backends.base import V2_TO_NUMPY, ModelMetadata, Tensor, TensorRequest, TensorResponse, TensorSpec
from backends.runtime.batcher import Arrays, DynamicBatcher
from backends.runtime.validation import validate_request

#: one run of the runtime: input arrays, the outputs asked for (None: all) -> output arrays
RunArrays = Callable[[Arrays, tuple[str, ...] | None], Awaitable[Arrays]]


def zeros_for(spec: TensorSpec) -> np.ndarray:
    """A zero tensor matching a spec, with dynamic dimensions set to 1 (for warm-up)."""
    shape = tuple(1 if d == -1 else d for d in spec.shape)
    if spec.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, V2_TO_NUMPY[spec.datatype])


def zero_inputs(meta: ModelMetadata) -> Arrays:
    """One row of zeros for every input of a model: what warm-up runs."""
    return {spec.name: zeros_for(spec) for spec in meta.inputs}


async def serve_tensor_request(
    request: TensorRequest, meta: ModelMetadata, batcher: DynamicBatcher | None, run: RunArrays
) -> TensorResponse:
    """Validate `request` against `meta`, run it (through `batcher` when there is one), wrap the outputs.

    Raises:
        InvalidInput: the request does not match the model's inputs (before any runtime sees it).
    """
    arrays = validate_request(request, meta)
    outputs = tuple(request.outputs) if request.outputs is not None else None
    result = await (batcher.submit(arrays, outputs) if batcher is not None else run(arrays, outputs))
    return TensorResponse(id=request.id, outputs=[Tensor.from_array(n, a) for n, a in result.items()])
