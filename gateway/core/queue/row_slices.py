"""Large tensor requests as row slices (`queue.split_rows`): each slice takes its own turn in the
fair queue, so a quiet tenant waits behind one slice of a flood request, not the whole of it."""

from __future__ import annotations

import numpy as np

from backends.base import ModelMetadata, Tensor, TensorRequest, TensorResponse

#: queue priority of a request's later slices: above any caller's (-100..100), so that within its
#: own tenant a started request is finished first (tenants are still ordered by the policy)
CONTINUING_PRIORITY = 1_000


def row_slices(
    request: TensorRequest, split_rows: int | None, meta: ModelMetadata
) -> list[TensorRequest] | None:
    """`request` cut into slices of at most `split_rows` rows, or None when it is not to be cut:
    splitting is off, the request is small enough, or the model is not batched along dimension 0
    in every input and output (its rows might not be independent)."""
    rows = request.batch_rows
    if split_rows is None or rows <= split_rows:
        return None
    if not all(s.shape and s.shape[0] == -1 for s in (*meta.inputs, *meta.outputs)):
        return None
    if not all(t.shape and t.shape[0] == rows for t in request.inputs):
        return None
    slices = []
    for start in range(0, rows, split_rows):
        stop = min(rows, start + split_rows)
        inputs = [
            Tensor(
                name=t.name, datatype=t.datatype, shape=(stop - start, *t.shape[1:]), data=t.data[start:stop]
            )
            for t in request.inputs
        ]
        slices.append(
            TensorRequest(
                id=request.id, inputs=inputs, outputs=request.outputs, parameters=request.parameters
            )
        )
    return slices


def join_row_slices(request_id: str, parts: list[TensorResponse]) -> TensorResponse:
    """The slices' answers as one: every output joined along dimension 0, in slice order."""
    first = parts[0]
    by_name = [{t.name: t for t in p.outputs} for p in parts]
    outputs = []
    for out in first.outputs:
        data = np.concatenate([np.asarray(named[out.name].data) for named in by_name], axis=0)
        outputs.append(Tensor(name=out.name, datatype=out.datatype, shape=tuple(data.shape), data=data))
    return TensorResponse(id=request_id, outputs=outputs, parameters=first.parameters)
