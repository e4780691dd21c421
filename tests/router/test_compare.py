"""Shadow comparison: tensor differences, shape mismatches, text agreement."""

from __future__ import annotations

import numpy as np
import pytest

from backends.base import Tensor
from router.compare import compare_tensors, compare_text


def _t(name: str, data: object) -> Tensor:
    return Tensor.from_array(name, np.asarray(data))


def test_tensor_differences():
    primary = [_t("p", np.array([[0.5, 0.25]], np.float32)), _t("label", np.array([1]))]
    shadow = [_t("label", np.array([1])), _t("p", np.array([[0.51, 0.25]], np.float32))]
    diff = compare_tensors(primary, shadow)
    assert not diff.mismatch
    assert diff.max_abs == pytest.approx(0.01, abs=1e-6)
    assert diff.max_rel == pytest.approx(0.02, abs=1e-5)
    assert compare_tensors(primary, primary).max_abs == 0.0


@pytest.mark.parametrize(
    "shadow",
    [
        [_t("p", np.zeros((2, 2), np.float32)), _t("label", np.array([1]))],  # shape
        [_t("p", np.zeros((1, 2), np.float32))],  # missing output
        [_t("p", np.zeros((1, 2), np.float32)), _t("label", np.array([1])), _t("x", [1])],  # extra
    ],
)
def test_mismatched_outputs(shadow):
    primary = [_t("p", np.zeros((1, 2), np.float32)), _t("label", np.array([1]))]
    assert compare_tensors(primary, shadow).mismatch


def test_bytes_outputs_compare_for_equality():
    a = [_t("s", np.array([b"x", b"y"], dtype=object))]
    assert not compare_tensors(a, a).mismatch
    assert compare_tensors(a, [_t("s", np.array([b"x", b"z"], dtype=object))]).mismatch


def test_text_agreement_by_words_and_tokens():
    same = compare_text("d c b a", "d c b a")
    assert same.exact and same.agreement == 1.0 and same.unit == "words"
    diff = compare_text("d c b a", "d c b X")
    assert not diff.exact and diff.agreement == 0.75
    shorter = compare_text("d c b a", "d c")
    assert shorter.agreement == 0.5
    tokens = compare_text("ab", "ac", [1, 2], [1, 3])
    assert tokens.unit == "tokens" and tokens.agreement == 0.5
    assert compare_text("", "").agreement == 1.0
