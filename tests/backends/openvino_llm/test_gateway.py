"""`backend: openvino_llm` through the running gateway with the `openai` SDK: greedy parity with
Hugging Face `generate`, streams, `n`, abort, limits and quotas, a fallback from torch_llm, the 400s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from backends.errors import BackendUnavailable
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.servers import serve_app

#: prompts of the parity check (the issue's set is 8 x 64 tokens: `test_parity_full`)
PROMPTS = [
    "the model token cache",
    "Hello world, what is the queue?",
    "one two three four five six seven",
    "red green blue cat dog bird tree river city",
    "why would the gateway stream a reply",
    "please thanks yes no",
    "small large memory paged attention layer head",
    "é ü ß 日本 🙂 data time",
]
#: a pipeline small enough for a shared 2-core box
OPTIONS = "{num_kv_blocks: 256, max_num_seqs: 4, threads: 1}"


def _config(ov: Path, torch_src: Path | None = None) -> Any:
    torch_dep = f"  torch: {{backend: torch_llm, model: {torch_src}, device: cpu}}\n" if torch_src else ""
    fallback = (
        "  both: {routes: [{deployment: torch}], fallback: [ov]}\n" if torch_src else ""
    )
    return parse_config(
        f"""
state: {{url: "memory://"}}
tenants:
  acme: {{}}
  tight: {{limits: {{requests_per_minute: 2}}}}
  capped: {{quotas: {{tokens_per_day: 40}}}}
deployments:
  ov: {{backend: openvino_llm, model: {ov}, device: CPU, options: {OPTIONS}}}
{torch_dep}models:
  tiny: {{routes: [{{deployment: ov}}]}}
{fallback}""",
        base_dir=Path("."),
    )


@pytest.fixture(scope="module")
def gateway(llama_ov: Path, llama_src: Path) -> Iterator[tuple[str, Any]]:
    app = create_app(_config(llama_ov, llama_src))
    with serve_app(app, timeout_s=180) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(gateway: tuple[str, Any]) -> OpenAI:
    url, _ = gateway
    return OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "acme"), max_retries=0, timeout=120)


def _hf_greedy(src: Path, prompts: list[str], tokens: int) -> list[list[int]]:
    """Hugging Face `generate` on ids from the folder's tokenizer.json (as the backend tokenizes)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            gen = model.generate(
                ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                attention_mask=torch.ones_like(ids), pad_token_id=0,
            )  # fmt: skip
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def _served_tokens(client: OpenAI, prompts: list[str], tokens: int, model: str = "tiny") -> list[list[str]]:
    """Each prompt's greedy output through the gateway, token by token (the logprobs' tokens)."""
    served = []
    for prompt in prompts:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=tokens, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.usage.completion_tokens == tokens
        served.append(list(out.choices[0].logprobs.tokens))
    return served


def _assert_parity(client: OpenAI, src: Path, prompts: list[str], tokens: int) -> None:
    from backends.torch_llm.tokenizer import TextTokenizer

    tok = TextTokenizer(src)
    expected = _hf_greedy(src, prompts, tokens)
    for prompt, want, got in zip(prompts, expected, _served_tokens(client, prompts, tokens), strict=True):
        want_text = [tok.token_bytes(i).decode("utf-8", "replace") for i in want]
        assert got == want_text, f"prompt {prompt!r}: served {got} != HF {want_text}"


def test_greedy_parity_with_hugging_face(client: OpenAI, llama_src: Path) -> None:
    _assert_parity(client, llama_src, PROMPTS[:3], 24)


@pytest.mark.slow
def test_greedy_parity_full_llama_and_qwen2(client: OpenAI, llama_src: Path, qwen2_src: Path, qwen2_ov: Path) -> None:
    """The issue's target: 8 prompts x 64 tokens, on saved Llama and Qwen2 folders."""
    _assert_parity(client, llama_src, PROMPTS, 64)
    app = create_app(_config(qwen2_ov))
    with serve_app(app, timeout_s=180) as url:
        qwen = OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "acme"), max_retries=0, timeout=120)
        _assert_parity(qwen, qwen2_src, PROMPTS, 64)


def test_stream_equals_whole_answer_and_usage_is_exact(client: OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
        "temperature": 0, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12 == whole.usage.completion_tokens
    # the chat template's prompt, counted by the same tokenizer the model saw
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 3
    assert whole.choices[0].finish_reason == "length"


def test_n_choices_with_seeds_and_stop(client: OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="one two three", n=3, max_tokens=10, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(out.choices) == 3 and out.usage.completion_tokens == 30
    again = client.completions.create(
        model="tiny", prompt="one two three", n=3, max_tokens=10, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    greedy = client.completions.create(
        model="tiny", prompt="one two three", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].text
    stop = greedy[3:5]
    cut = client.completions.create(
        model="tiny", prompt="one two three", max_tokens=10, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == greedy[: greedy.index(stop)]


def test_abort_frees_the_sequence(gateway: tuple[str, Any], client: OpenAI) -> None:
    """A client that leaves mid-stream: its sequence is cancelled and its slot comes back."""
    _, app = gateway
    backend = app.state.core.deployments["ov"].backend
    stream = client.completions.create(
        model="tiny", prompt="a long answer", max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    assert backend.capacity()[0] < 4  # the sequence is running
    stream.close()
    deadline = time.monotonic() + 30
    while backend.capacity()[0] != 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.capacity()[0] == 4  # every slot free again, long before 1500 tokens


def test_unsupported_fields_are_400_naming_them(client: OpenAI) -> None:
    for extra, name in (
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
            )
        assert name in str(err.value)


def test_structured_choice_through_the_pipeline(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "pick"}], max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )  # fmt: skip
    assert out.choices[0].message.content in ("red", "green")


def test_rate_limit_and_quota(gateway: tuple[str, Any]) -> None:
    url, _ = gateway
    tight = OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "tight"), max_retries=0)
    capped = OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "capped"), max_retries=0)
    args: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    tight.completions.create(**args)
    tight.completions.create(**args)
    with pytest.raises(openai.RateLimitError):
        tight.completions.create(**args)
    spend = {**args, "max_tokens": 12, "extra_body": {"ignore_eos": True}}  # about 14 tokens each
    capped.completions.create(**spend)
    capped.completions.create(**spend)
    with pytest.raises(openai.RateLimitError):  # the third does not fit the 40 tokens a day
        capped.completions.create(**spend)


def test_fallback_from_torch_llm_when_it_is_down(gateway: tuple[str, Any], client: OpenAI) -> None:
    url, app = gateway
    torch_backend = app.state.core.deployments["torch"].backend
    args: dict[str, Any] = {"model": "both", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    first = client.completions.with_raw_response.create(**args)
    assert first.headers["x-fleetgate-deployment"].split(";")[0] == "torch"

    async def down(request: Any) -> Any:  # failure injection: the torch_llm engine is gone
        raise BackendUnavailable("injected outage")
        yield  # pragma: no cover  (an async generator, like the real one)

    torch_backend.generate = down
    served = client.completions.with_raw_response.create(**args)
    assert served.headers["x-fleetgate-deployment"].split(";")[0] == "ov"
    assert served.parse().usage.completion_tokens == 4


def test_details_and_metrics(gateway: tuple[str, Any], client: OpenAI) -> None:
    url, app = gateway
    meta = app.state.core.deployments["ov"].backend.metadata()
    assert meta.device == "CPU" and meta.platform == "openvino_genai"
    assert meta.extra["weights"] == "fp32" and meta.extra["precision"] == "f32"
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3, temperature=0)
    metrics = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
    for name in (
        "fleetgate_llm_time_to_first_token_seconds_count",
        "fleetgate_llm_inter_token_latency_seconds_count",
        "fleetgate_llm_kv_cache_usage_perc",
        "fleetgate_llm_num_requests_waiting",
    ):
        assert f'{name}{{deployment="ov"}}' in metrics, name


def test_structured_regex_and_a_schema_keyword_it_cannot_enforce(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "letters"}], max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"regex": "[ab]{3}"}},
    )  # fmt: skip
    content = out.choices[0].message.content
    assert len(content) == 3 and set(content) <= {"a", "b"}
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "json"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )  # fmt: skip
    assert "dependentSchemas" in str(err.value)
