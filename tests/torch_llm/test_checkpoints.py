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
from backends.torch_llm.model_config import ModelConfig
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
