"""Compare a shadow's answer with the primary's: tensors by numeric difference, text by agreement.

Tensors: outputs are matched by name. Any output missing on either side, or with another shape,
makes the pair a shape mismatch (no differences are reported for it). Otherwise the differences
are taken over every numeric output, element by element:
    abs = |shadow - primary|,  rel = abs / max(|primary|, REL_FLOOR)
and the pair reports the maximum of each. Non-numeric outputs (BYTES) are compared for equality
only: a difference there also counts as a mismatch.

Text: exact match of the whole completion, and agreement = positions where both sides hold the same
unit / the longer side's length (1.0 for two empty answers). The unit is the token id when both sides
carry token ids, else whitespace-separated words (remote OpenAI upstreams send no token ids).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from backends.base import Tensor

#: floor of |primary| in the relative difference, so outputs near zero do not explode it
REL_FLOOR = 1e-6


class TensorDiff(msgspec.Struct, frozen=True, kw_only=True):
    #: an output is missing on one side or has another shape (or non-numeric contents differ)
    mismatch: bool
    max_abs: float = 0.0
    max_rel: float = 0.0


class TextDiff(msgspec.Struct, frozen=True, kw_only=True):
    exact: bool
    #: fraction of positions where both answers hold the same unit
    agreement: float
    #: "tokens" or "words"
    unit: str


def compare_tensors(primary: Sequence[Tensor], shadow: Sequence[Tensor]) -> TensorDiff:
    """Differences between two sets of outputs (see the module docstring)."""
    theirs = {t.name: t for t in shadow}
    if set(theirs) != {t.name for t in primary}:
        return TensorDiff(mismatch=True)
    max_abs = max_rel = 0.0
    for mine in primary:
        a, b = np.asarray(mine.data), np.asarray(theirs[mine.name].data)
        if a.shape != b.shape:
            return TensorDiff(mismatch=True)
        if a.dtype.kind not in "biuf" or b.dtype.kind not in "biuf":
            if not np.array_equal(a, b):
                return TensorDiff(mismatch=True)
            continue
        if a.size == 0:
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        diff = np.abs(b64 - a64)
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / np.maximum(np.abs(a64), REL_FLOOR)).max()))
    return TensorDiff(mismatch=False, max_abs=max_abs, max_rel=max_rel)


def compare_text(
    primary: str,
    shadow: str,
    primary_ids: Sequence[int] | None = None,
    shadow_ids: Sequence[int] | None = None,
) -> TextDiff:
    """Exact match and positional agreement of two completions (see the module docstring)."""
    if primary_ids and shadow_ids:
        left: Sequence[object] = primary_ids
        right: Sequence[object] = shadow_ids
        unit = "tokens"
    else:
        left, right, unit = primary.split(), shadow.split(), "words"
    longest = max(len(left), len(right))
    same = sum(x == y for x, y in zip(left, right, strict=False))
    agreement = 1.0 if longest == 0 else same / longest
    return TextDiff(exact=primary == shadow, agreement=agreement, unit=unit)
