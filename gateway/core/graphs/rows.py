"""Rows of a graph request: which rows each step covers, conditions, and joining cascade outputs.

A per-row cascade runs its conditional step on some rows of the request only. Every tensor of a
running graph is kept with the rows it covers (`rows`: sorted indices into the request's rows, or
None for all of them); a step reads the rows all its sources (and its condition) cover, and a
graph output listing several sources takes, row by row, the first source that covers the row.
Rows are dimension 0 of every tensor; a request whose tensors are not batched that way can still
use whole-request conditions (`per_row: false`), which never cut a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backends.errors import BackendInternalError
from router.graphs import StepCondition


class GraphMisconfigured(BackendInternalError):
    """The graph's steps do not fit together on this request (a config fault, never the caller's):
    outputs of different shapes joined, a per-row condition on a tensor that is not per row."""

    code = "graph_misconfigured"


Rows = np.ndarray | None

_REDUCE = {"max": np.max, "min": np.min, "mean": np.mean, "sum": np.sum}


@dataclass(frozen=True, slots=True)
class Value:
    """A tensor of a running graph and the request rows it covers (None: all of them)."""

    array: np.ndarray
    rows: Rows = None


def common_rows(values: Sequence[Value]) -> Rows:
    """The rows every value covers (None: all)."""
    rows: Rows = None
    for value in values:
        if value.rows is not None:
            rows = value.rows if rows is None else np.intersect1d(rows, value.rows, assume_unique=True)
    return rows


def take(value: Value, rows: Rows, what: str) -> np.ndarray:
    """`value`'s array restricted to `rows` (a subset of the rows it covers)."""
    if rows is None or (value.rows is not None and len(value.rows) == len(rows)):
        return value.array
    index = rows if value.rows is None else np.searchsorted(value.rows, rows)
    if value.array.ndim == 0 or value.array.shape[0] <= int(index[-1]):
        raise GraphMisconfigured(
            f"{what}: a per-row condition cuts tensors along dimension 0, and this one has "
            f"{value.array.shape[0] if value.array.ndim else 0} rows"
        )
    return value.array[index]


def condition_rows(condition: StepCondition, value: Value) -> Rows | bool:
    """Where `condition` holds on `value`: the rows (per-row conditions), or whether it holds at all.

    Returns rows (None: all rows) for a per-row condition; True or False for a whole-request one.
    """
    try:
        array = np.asarray(value.array, dtype=np.float64)
    except (TypeError, ValueError):
        raise GraphMisconfigured(f"condition on {condition.tensor!r}: its values are not numbers") from None
    per_row = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(-1, 1)
    scores = _REDUCE[condition.reduce](per_row, axis=1)
    holds = np.ones(len(scores), dtype=bool)
    if condition.below is not None:
        holds &= scores < condition.below
    if condition.at_least is not None:
        holds &= scores >= condition.at_least
    if not condition.per_row:
        return bool(holds.any())
    if holds.all():
        return value.rows
    index = np.flatnonzero(holds)
    return index if value.rows is None else value.rows[index]


def first_covering(name: str, values: Sequence[Value]) -> np.ndarray:
    """A graph output listing several sources: per row, the first source (in order) that covers it.

    `values` are the sources that ran, in order of preference; the last covers every row (the
    config check makes sure the last listed source always runs).
    """
    *preferred, base = values
    if base.rows is not None:
        raise GraphMisconfigured(f"output {name!r}: no source covers every row")
    out = base.array
    copied = False
    for value in reversed(preferred):
        if value.rows is None:
            out, copied = value.array, False
            continue
        if value.array.shape[1:] != out.shape[1:]:
            raise GraphMisconfigured(
                f"output {name!r}: its sources have shapes {list(value.array.shape)} and {list(out.shape)}"
            )
        if not copied:
            out, copied = out.copy(), True
        out[value.rows] = value.array.astype(out.dtype, copy=False)
    return out
