"""Model folders as Hugging Face writes them today: the chat template in `chat_template.jinja`
(transformers 5's `save_pretrained`), end-of-sequence ids in `generation_config.json`, and chat
templates rendered exactly as Hugging Face renders them (tojson, strftime_now, loop controls,
raise_exception)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from backends.demo_models.tiny_llama import write_tiny_llama, write_tokenizer
from backends.torch_llm.model.config import ModelConfig
from backends.torch_llm.tokenizer import TextTokenizer

#: three templates in the styles of the three families (written for these tests): a dated system
#: header with `continue`, ChatML with a `tojson` header line, and [INST] turns that must alternate
TEMPLATES = {
    "llama": (
        "{{ bos_token }}{% set today = strftime_now('%d %b %Y') %}"
        "<|start_header_id|>system<|end_header_id|>\n\nToday: {{ today }}<|eot_id|>"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "qwen2": (
        "<|im_start|>meta\n{{ {'first': messages[0].content, 'turns': messages | length} | tojson }}<|im_end|>\n"
        "{% for m in messages %}{% if loop.index > 8 %}{% break %}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('conversation roles must alternate user/assistant') }}{% endif %}"
        "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}
CHAT = [
    {"role": "user", "content": 'héllo 你好 🙂 "quoted" <b>'},
    {"role": "assistant", "content": "salut"},
    {"role": "user", "content": "  and again  "},
]


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, vocab_size=512, seed=3)
    return folder


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_templates_saved_by_transformers_render_as_transformers_renders_them(
    base_tokenizer: Path, tmp_path: Path, family: str
) -> None:
    hf = AutoTokenizer.from_pretrained(base_tokenizer)
    hf.chat_template = TEMPLATES[family]
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()  # where transformers 5 writes it
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ours = TextTokenizer(tmp_path)
    expected = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ours.decode(ours.apply_chat_template(CHAT), skip_special_tokens=False) == hf.decode(
        hf(expected, add_special_tokens=False)["input_ids"], skip_special_tokens=False
    )
    assert ours.apply_chat_template(CHAT) == hf(expected, add_special_tokens=False)["input_ids"]


def test_a_template_refusal_is_a_clear_error(base_tokenizer: Path, tmp_path: Path) -> None:
    hf = AutoTokenizer.from_pretrained(base_tokenizer)
    hf.chat_template = TEMPLATES["mistral"]
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="must alternate"):
        TextTokenizer(tmp_path).apply_chat_template([{"role": "assistant", "content": "first"}])


def test_generation_config_eos_ids_end_generation(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "m")
    before = ModelConfig.from_folder(folder).eos_token_ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [before[0], 7]}))
    after = ModelConfig.from_folder(folder).eos_token_ids
    assert 7 not in before and after == (*before, 7)


async def test_generation_config_sampling_defaults_fill_what_the_request_leaves_unset(tmp_path: Path) -> None:
    """generation_config.json's temperature applies when a request omits it (as vLLM does), never
    over a value the request sets."""
    from backends.base import GenerateRequest, SamplingParams
    from backends.spec import DeploymentSpec
    from backends.torch_llm.backend import create, with_model_defaults

    folder = write_tiny_llama(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    backend = create("llm", DeploymentSpec(backend="torch_llm", model=str(folder), device="cpu"))
    await backend.load()
    try:

        async def text(rid: str, sampling: SamplingParams) -> str:
            request = GenerateRequest(request_id=rid, prompt="hello there", sampling=sampling)
            return "".join([e.text async for e in backend.generate(request)])

        unset = frozenset({"temperature", "top_p", "top_k"})
        left_to_model = [
            await text(f"d{i}", SamplingParams(max_tokens=12, ignore_eos=True, model_defaults=unset))
            for i in range(3)
        ]
        assert len(set(left_to_model)) == 1  # the model's default (greedy) applied: the same text each time
        greedy = await text("g", SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
        assert left_to_model[0] == greedy
        explicit = [
            await text(f"e{i}", SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=i))
            for i in range(3)
        ]
        assert len(set(explicit)) > 1  # a temperature the request sets is kept
    finally:
        await backend.close()
    chosen = with_model_defaults(
        SamplingParams(temperature=0.7, model_defaults=frozenset({"top_k"})), {"temperature": 0.0, "top_k": 5}
    )
    assert chosen.temperature == 0.7 and chosen.top_k == 5


def _save_family(family: str, tokenizer_dir: Path, out: Path, template: str) -> Path:
    """A random-weight model of `family` as the installed transformers' `save_pretrained` writes it
    (config.json, model.safetensors, generation_config.json), beside its tokenizer and chat template
    (chat_template.jinja)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf_tok.chat_template = template
    config = AutoConfig.for_model(
        family, vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=family == "qwen2",
    )  # fmt: skip
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init, so greedy paths differ per model
            p.normal_(0, 0.08) if p.dim() > 1 else None
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    return out


def _hf_greedy(folder: Path, messages: list[dict[str, str]], max_new: int) -> tuple[list[int], list[int]]:
    """The prompt ids and greedy output ids Hugging Face gives for `messages` on the saved folder."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, top_k=None, top_p=None)
    return list(ids), out[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_folders_saved_by_transformers_chat_through_the_gateway_as_hugging_face_generates(
    base_tokenizer: Path, tmp_path: Path, family: str
) -> None:
    """Llama, Qwen2 and Mistral folders written by `save_pretrained`: the gateway reads the chat
    template from chat_template.jinja and the end-of-sequence ids from generation_config.json, and
    its greedy chat answer is Hugging Face's `generate` on the same folder: the same prompt token
    count, the same number of output tokens ending on the same stop id, the same text."""
    from openai import OpenAI
    from transformers import GenerationConfig

    from gateway.config import parse_config
    from gateway.http.app import create_app
    from tests.conftest import create_key
    from tests.servers import serve_app

    folder = _save_family(family, base_tokenizer, tmp_path / family, TEMPLATES[family])
    assert (folder / "chat_template.jinja").exists() and (folder / "generation_config.json").exists()
    messages = [{"role": "user", "content": "hello there, how are you"}]
    _, free_run = _hf_greedy(folder, messages, 16)
    # make the 5th greedy token an end of sequence through generation_config.json alone
    stop_id = free_run[4]
    generation = GenerationConfig.from_pretrained(folder)
    generation.eos_token_id = [generation.eos_token_id, stop_id]
    generation.save_pretrained(folder)
    prompt_ids, expected = _hf_greedy(folder, messages, 16)
    assert expected[-1] == stop_id and len(expected) <= 5

    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  llm: {{backend: torch_llm, model: {folder}, device: cpu}}
models:
  m: {{routes: [{{deployment: llm}}]}}
""",
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "acme"), max_retries=0)
        answer = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
    tok = AutoTokenizer.from_pretrained(folder)
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == len(expected)
    # the stopping token is an ordinary one here, so its text stays, as in HF's decode of the output
    assert answer.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
