"""`fleetgate export-llm`: progress on stderr, the answer on stdout, one-line errors; a compressed
export serves and reports its weight format."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backends.base import GenerateRequest, SamplingParams
from backends.openvino_llm.backend import create
from backends.openvino_llm.export import read_manifest
from backends.spec import DeploymentSpec
from gateway.serve.cli import main


def test_missing_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export-llm", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such folder" in err


def test_not_a_model_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export-llm", "--model", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no config.json" in err


def test_a_folder_that_is_not_an_export_is_refused_at_config_time(tmp_path: Path, llama_src: Path) -> None:
    with pytest.raises(ValueError, match="not an OpenVINO LLM export"):
        create("ov", DeploymentSpec(backend="openvino_llm", model=str(llama_src)))
    with pytest.raises(ValueError, match="options.max_num_seqs"):
        create("ov", DeploymentSpec(backend="openvino_llm", model=str(tmp_path), options={"max_num_seqs": "x"}))


def test_int8_export_serves_and_reports_its_weights(
    tmp_path: Path, llama_src: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "int8"
    assert main(["export-llm", "--model", str(llama_src), "--out", str(out), "--weights", "int8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1 and "LlamaForCausalLM, 2 layers, int8 weights" in captured.out
    assert "compressing weights to int8 with NNCF" in captured.err
    manifest = read_manifest(out)
    assert manifest is not None and manifest.weights == "int8" and manifest.architecture == "LlamaForCausalLM"
    assert 'element_type="u8"' in (out / "openvino_model.xml").read_text()

    async def serve() -> tuple[dict[str, object], int]:
        backend = create("ov8", DeploymentSpec(backend="openvino_llm", model=str(out), options={"num_kv_blocks": 64}))
        await backend.load()
        try:
            request = GenerateRequest(
                request_id="r", prompt="the model", sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            )
            events = [e async for e in backend.generate(request)]
            return backend.metadata().extra, events[-1].usage.completion_tokens  # type: ignore[union-attr]
        finally:
            await backend.close()

    extra, tokens = asyncio.run(serve())
    assert extra["weights"] == "int8" and tokens == 6
