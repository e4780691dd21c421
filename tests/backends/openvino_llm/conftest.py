"""Fixtures: tiny random-weight Llama and Qwen2 folders (as the torch_llm tests write them) and their
OpenVINO exports made by `export_llm`, once per session."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("openvino_genai")
pytest.importorskip("transformers")

from backends.demo_models.tiny_llama import write_tiny_llama  # noqa: E402
from backends.openvino_llm.export import export_llm  # noqa: E402


@pytest.fixture(scope="session")
def llama_src(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Llama with GQA (4 query heads, 2 KV heads)."""
    return write_tiny_llama(
        tmp_path_factory.mktemp("ov-llama"), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        init_std=0.05, seed=1,
    )  # fmt: skip


@pytest.fixture(scope="session")
def qwen2_src(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Qwen2-style: biases on q/k/v, tied embeddings, one KV head."""
    return write_tiny_llama(
        tmp_path_factory.mktemp("ov-qwen2"), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
        architecture="qwen2", tie_word_embeddings=True, init_std=0.05, seed=2,
    )  # fmt: skip


@pytest.fixture(scope="session")
def llama_ov(llama_src: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("ov-llama-export")
    export_llm(llama_src, out, "fp32")
    return out


@pytest.fixture(scope="session")
def qwen2_ov(qwen2_src: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("ov-qwen2-export")
    export_llm(qwen2_src, out, "fp32")
    return out
