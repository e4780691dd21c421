"""The backend contract: one suite, run over every backend the gateway can serve from.

Each case builds a real backend on a real runtime (ONNX Runtime, OpenVINO, the TF Serving test
server, a remote Open Inference Protocol upstream, a remote OpenAI upstream, the torch_llm engine,
OpenVINO GenAI's pipeline) and checks what the gateway relies on, whatever the backend:

- `create` is cheap (nothing loaded, not ready); `load` + `warmup` make it ready;
- it declares its capabilities and satisfies the protocol of each (`TensorBackend`,
  `GenerativeBackend`), with its optional features declared as attributes;
- `metadata()` names a platform and the device it runs on;
- it serves (`infer` / `generate`) and answers concurrent callers each with their own answer;
- bad input is refused with a `BackendError` of status 400, never a crash, and the backend still
  serves afterwards;
- `close()` makes it not ready, and closing twice is harmless.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from backends.base import (
    Backend,
    Capability,
    GenerateRequest,
    GenerativeBackend,
    SamplingParams,
    Tensor,
    TensorBackend,
    TensorRequest,
    as_generative,
    as_tensor,
)
from backends.errors import BackendError
from backends.registry import create_backend
from backends.spec import DeploymentSpec
from tests.conftest import create_key
from tests.servers import serve_app

CASES = ["onnxruntime", "openvino", "tfserving", "remote_v2", "remote_openai", "torch_llm", "openvino_llm"]


@dataclass
class Case:
    spec: DeploymentSpec
    #: a valid input row batch for tensor backends (2 rows)
    rows: np.ndarray | None = None


@pytest.fixture(scope="module")
def v2_upstream(digits_onnx: Path) -> Iterator[tuple[str, str]]:
    """A fleetgate serving the digits model over the Open Inference Protocol; (url, tenant key)."""
    from gateway.config import parse_config
    from gateway.http.app import create_app

    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{up: {{}}}}
deployments: {{ort: {{backend: onnxruntime, model: {digits_onnx}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
""",
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as url:
        yield url, create_key(url, "up")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from backends.demo_models.tiny_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("contract") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_llama_ov(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Llama exported for OpenVINO GenAI (`fleetgate export-llm`)."""
    pytest.importorskip("openvino_genai")
    from backends.openvino_llm.export import export_llm

    out = tmp_path_factory.mktemp("contract") / "tiny-llama-ov"
    export_llm(tiny_llama, out, "fp32")
    return out


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest, digits, monkeypatch: pytest.MonkeyPatch) -> Case:  # noqa: ANN001
    kind = request.param
    rows = np.asarray(digits.x_test[:2], np.float32)
    if kind == "onnxruntime":
        return Case(
            DeploymentSpec(backend="onnxruntime", model=str(request.getfixturevalue("digits_onnx"))), rows
        )
    if kind == "openvino":
        return Case(DeploymentSpec(backend="openvino", model=str(request.getfixturevalue("digits_ir"))), rows)
    if kind == "tfserving":
        target = request.getfixturevalue("tfs_server").target
        return Case(DeploymentSpec(backend="tfserving", target=target, model_name="digits"), rows)
    if kind == "remote_v2":
        url, key = request.getfixturevalue("v2_upstream")
        monkeypatch.setenv("CONTRACT_UPSTREAM_KEY", key)
        spec = DeploymentSpec(
            backend="remote",
            url=url,
            protocol="kserve_v2",
            model_name="digits",
            api_key_env="CONTRACT_UPSTREAM_KEY",
        )
        return Case(spec, rows)
    if kind == "remote_openai":
        url = request.getfixturevalue("upstream_url")
        spec = DeploymentSpec(
            backend="remote", url=url, protocol="openai", model_name="tiny", api_key_env="TEST_UPSTREAM_KEY"
        )
        return Case(spec)
    if kind == "openvino_llm":
        model = request.getfixturevalue("tiny_llama_ov")
        return Case(DeploymentSpec(backend="openvino_llm", model=str(model), options={"num_kv_blocks": 64}))
    model = request.getfixturevalue("tiny_llama")
    return Case(
        DeploymentSpec(backend="torch_llm", model=str(model), device="cpu", options={"max_num_seqs": 4})
    )


@pytest.fixture
async def loaded(case: Case) -> AsyncIterator[tuple[Backend, Case]]:
    backend = create_backend("contract", case.spec)
    assert not backend.ready  # create() loads nothing
    await backend.load()
    await backend.warmup()
    try:
        yield backend, case
    finally:
        await backend.close()


def _tensor_request(backend: Backend, rows: np.ndarray, rid: str) -> TensorRequest:
    name = backend.metadata().inputs[0].name
    return TensorRequest(id=rid, inputs=[Tensor.from_array(name, rows)])


def _generate_request(rid: str, prompt: str | None = "hello there", max_tokens: int = 4) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt=prompt, sampling=sampling)


async def _generated_text(backend: GenerativeBackend, request: GenerateRequest) -> tuple[str, str | None]:
    text, finish = "", None
    async for event in backend.generate(request):
        text += event.text
        finish = event.finish_reason or finish
    return text, finish


async def test_lifecycle_capabilities_and_metadata(loaded: tuple[Backend, Case]) -> None:
    backend, _ = loaded
    assert backend.ready
    assert isinstance(backend, Backend)
    assert backend.capabilities and backend.capabilities <= set(Capability)
    if Capability.TENSOR in backend.capabilities:
        assert isinstance(backend, TensorBackend)
        assert as_tensor(backend) is backend
    if Capability.GENERATE in backend.capabilities:
        assert isinstance(backend, GenerativeBackend)
        generative = as_generative(backend)
        assert isinstance(generative.counts_prompt_tokens, bool)
        assert generative.capacity is None or callable(generative.capacity)
    meta = backend.metadata()
    assert meta.platform and meta.device
    if Capability.TENSOR in backend.capabilities:
        assert meta.inputs and meta.outputs


async def test_serves_concurrent_callers_each_their_own_answer(loaded: tuple[Backend, Case]) -> None:
    backend, case = loaded
    if Capability.TENSOR in backend.capabilities:
        assert case.rows is not None
        tensors = as_tensor(backend)
        alone = await tensors.infer(_tensor_request(backend, case.rows, "alone"))
        expected = {t.name: t.data for t in alone.outputs}
        assert all(np.asarray(v).shape[0] == 2 for v in expected.values())
        answers = await asyncio.gather(
            *(tensors.infer(_tensor_request(backend, case.rows, f"r{i}")) for i in range(8))
        )
        for answer in answers:
            got = {t.name: t.data for t in answer.outputs}
            for name, value in expected.items():
                np.testing.assert_allclose(
                    np.asarray(got[name], np.float64), np.asarray(value, np.float64), atol=1e-5
                )
    else:
        generative = as_generative(backend)
        counted = await generative.count_prompt_tokens(_generate_request("count"))
        assert counted >= 1
        alone = await _generated_text(generative, _generate_request("alone"))
        assert alone[1] in ("stop", "length") and alone[0]
        answers = await asyncio.gather(
            *(_generated_text(generative, _generate_request(f"g{i}")) for i in range(4))
        )
        assert all(answer == alone for answer in answers)  # greedy: the same prompt, the same text


async def test_bad_input_is_a_400_and_the_backend_still_serves(loaded: tuple[Backend, Case]) -> None:
    backend, case = loaded
    if Capability.TENSOR in backend.capabilities:
        assert case.rows is not None
        tensors = as_tensor(backend)
        wrong_name = TensorRequest(id="bad", inputs=[Tensor.from_array("no_such_input", case.rows)])
        wrong_width = _tensor_request(backend, np.zeros((2, 3), np.float32), "narrow")
        for bad in (wrong_name, wrong_width):
            with pytest.raises(BackendError) as info:
                await tensors.infer(bad)
            assert info.value.status == 400, info.value
        assert (await tensors.infer(_tensor_request(backend, case.rows, "after"))).outputs
    else:
        generative = as_generative(backend)
        bad = GenerateRequest(request_id="bad", sampling=SamplingParams(max_tokens=-5))
        with pytest.raises(BackendError) as info:
            await _generated_text(generative, bad)
        assert info.value.status == 400, info.value
        assert (await _generated_text(generative, _generate_request("after")))[0]


async def test_close_makes_it_not_ready_and_is_idempotent(case: Case) -> None:
    backend = create_backend("contract", case.spec)
    await backend.load()
    await backend.warmup()
    assert backend.ready
    await backend.close()
    assert not backend.ready
    await backend.close()


def test_every_registered_backend_is_in_the_suite() -> None:
    from backends.registry import ADAPTERS

    covered: set[str] = {kind.split("_v2")[0].split("_openai")[0] for kind in CASES}
    assert set(ADAPTERS) <= covered, set(ADAPTERS) - covered
