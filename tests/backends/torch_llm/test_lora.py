"""Multi-LoRA in the engine: greedy output token-identical to transformers + PEFT, several adapters
and the base in one batch, adapters paged through fewer device slots, unloading without breaking
requests in flight, and clear refusals of adapters that cannot be served."""

from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from backends.base import SamplingParams  # noqa: E402
from backends.demo_models.tiny_llama import write_tiny_llama  # noqa: E402
from backends.torch_llm.lora.weights import inspect_adapter, load_adapter  # noqa: E402
from backends.torch_llm.model.config import ModelConfig  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for, make_prompts  # noqa: E402
from tests.lora_adapters import write_peft_adapter  # noqa: E402

N_TOKENS = 16
GREEDY = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: three adapters unlike each other: every projection; attention only with rsLoRA; MLP only with a
#: per-module alpha
ADAPTERS = {
    "all-r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "qv-r4-rs": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
    "mlp-r16": {"r": 16, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"],
                "alpha_pattern": {"down_proj": 32}},
}  # fmt: skip


@pytest.fixture(scope="module")
def adapter_dirs(
    llama_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_peft_adapter(llama_dir, root / name, seed=i, **cfg)
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(8, seed=11)


def peft_greedy(
    base: pathlib.Path, adapter: pathlib.Path | None, prompts: list[list[int]]
) -> list[list[int]]:
    """Reference: transformers (+ PEFT when `adapter`) generate(do_sample=False), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones(1, len(p)),
                max_new_tokens=N_TOKENS,
                do_sample=False,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def reference(llama_dir, adapter_dirs, prompts) -> dict[str | None, list[list[int]]]:
    ref: dict[str | None, list[list[int]]] = {None: peft_greedy(llama_dir, None, prompts)}
    for name, folder in adapter_dirs.items():
        ref[name] = peft_greedy(llama_dir, folder, prompts)
    return ref


def lora_engine(llama_dir: pathlib.Path, adapter_dirs: dict[str, pathlib.Path], **options: object):  # noqa: ANN201
    engine = engine_for(llama_dir, enable_lora=True, **{"max_lora_rank": 16, **options})
    cfg = ModelConfig.from_folder(llama_dir)
    for name, folder in adapter_dirs.items():
        engine.runner.lora.add(load_adapter(name, folder, cfg, max_rank=16, dtype=torch.float32))
    return engine


def run_mixed(engine, prompts, choose, arrivals=None) -> dict[str, list[int]]:  # noqa: ANN001
    """Every prompt once per choice of adapter (None = base), all in flight together."""
    outputs: dict[str, list[int]] = {}
    jobs = [(f"{a}|{i}", p, a) for i, p in enumerate(prompts) for a in choose]
    arrivals = arrivals or [0] * len(jobs)
    step = 0
    pending = list(range(len(jobs)))
    while pending or engine.has_unfinished:
        while pending and arrivals[pending[0]] <= step:
            rid, prompt, adapter = jobs[pending.pop(0)]
            outputs[rid] = []
            engine.add_request(rid, prompt, GREEDY, adapter=adapter)
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
        step += 1
        assert step < 5_000
    return outputs


def _check(outputs: dict[str, list[int]], reference, prompts) -> None:  # noqa: ANN001
    wrong = [
        rid
        for rid, got in outputs.items()
        if got
        != reference[None if rid.split("|")[0] == "None" else rid.split("|")[0]][int(rid.split("|")[1])]
    ]
    assert not wrong, f"differ from transformers + PEFT: {wrong}"


def test_adapters_change_the_output(reference) -> None:
    # otherwise parity would prove nothing about the LoRA path
    for name in ADAPTERS:
        assert reference[name] != reference[None], name


def test_base_and_every_adapter_in_one_batch_match_peft(llama_dir, adapter_dirs, prompts, reference) -> None:
    engine = lora_engine(llama_dir, adapter_dirs)
    choose = [None, *ADAPTERS]
    outputs = run_mixed(engine, prompts, choose)
    _check(outputs, reference, prompts)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_fewer_slots_than_adapters_pages_them_and_still_matches(
    llama_dir, adapter_dirs, prompts, reference, monkeypatch
) -> None:
    # two device slots for three adapters, chunked prefill beside decodes, staggered arrivals, and
    # the decode rows' adapter matrices gathered 5 rows at a time
    monkeypatch.setattr("backends.torch_llm.lora.layers.GATHER_ROWS", 5)
    engine = lora_engine(
        llama_dir, adapter_dirs, max_loras=2, max_num_batched_tokens=16, max_prefill_tokens_with_decodes=5
    )
    choose = [*ADAPTERS, None]
    arrivals = [i * 3 for i in range(len(prompts) * len(choose))]
    _check(run_mixed(engine, prompts, choose, arrivals), reference, prompts)
    assert engine.runner.lora.num_page_ins > 3, "three adapters through two slots must page"


def test_prefix_cache_never_mixes_adapters(llama_dir, adapter_dirs) -> None:
    engine = lora_engine(llama_dir, adapter_dirs)
    prompt = list(range(6, 60))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for rid, adapter in [("base", None), ("a1", "all-r8"), ("b1", "qv-r4-rs"), ("a2", "all-r8")]:
        before = engine.num_prefix_hits
        engine.add_request(rid, prompt, params, adapter=adapter)
        while engine.has_unfinished:
            engine.step()
        assert engine.num_prefix_hits - before == (48 if rid == "a2" else 0), rid


def test_unloading_lets_requests_in_flight_finish(llama_dir, adapter_dirs, prompts, reference) -> None:
    engine = lora_engine(llama_dir, adapter_dirs)
    pool = engine.runner.lora
    outputs = {str(i): [] for i in range(3)}
    for i in range(3):
        engine.add_request(str(i), prompts[i], GREEDY, adapter="all-r8")
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
    assert pool.remove("all-r8")
    assert "all-r8" not in pool.names()
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("late", prompts[0], GREEDY, adapter="all-r8")
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
    assert [outputs[str(i)] for i in range(3)] == reference["all-r8"][:3]
    assert "all-r8" not in pool._adapters, "the weights go once the last request using them ends"


def test_refusals_name_the_reason(llama_dir, adapter_dirs, tmp_path) -> None:
    cfg = ModelConfig.from_folder(llama_dir)
    with pytest.raises(ValueError, match="max_lora_rank"):
        inspect_adapter("big", adapter_dirs["mlp-r16"], cfg, max_rank=8)
    other_base = write_tiny_llama(
        tmp_path / "other", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2
    )
    foreign = write_peft_adapter(
        other_base, tmp_path / "foreign", seed=5, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    with pytest.raises(ValueError, match="another base"):
        inspect_adapter("foreign", foreign, cfg, max_rank=16)
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        inspect_adapter("dora", dora, cfg, max_rank=16)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        inspect_adapter("empty", tmp_path, cfg, max_rank=16)
    engine = engine_for(llama_dir)  # no LoRA layers at all
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("x", [5, 6, 7], GREEDY, adapter="all-r8")


def test_adapters_run_on_int8_weights(llama_dir, adapter_dirs, prompts) -> None:
    # the low-rank updates stay in float on top of the int8 base projections
    engine = lora_engine(llama_dir, adapter_dirs, quantization="int8")
    layer = engine.runner.model.model.layers[0].self_attn.q_proj
    assert type(layer.base).__name__ == "Int8Linear"
    outputs = run_mixed(engine, prompts[:4], [None, "all-r8"])
    base = [outputs[f"None|{i}"] for i in range(4)]
    adapted = [outputs[f"all-r8|{i}"] for i in range(4)]
    assert base != adapted, "the adapter must still change the int8 model's output"
    assert all(len(o) == N_TOKENS for o in outputs.values())


def _tamper(
    src: pathlib.Path, dst: pathlib.Path, *, config: dict | None = None, rename: dict | None = None
) -> pathlib.Path:
    """A copy of an adapter folder with its config changed or weights renamed / reshaped."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    raw = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    for old, new in (rename or {}).items():
        for key in [k for k in tensors if old in k]:
            value = tensors.pop(key)
            tensors[key.replace(old, new[0])] = value if new[1] is None else new[1](value)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_malformed_adapters_are_refused_with_a_reason(llama_dir, adapter_dirs, tmp_path) -> None:
    cfg = ModelConfig.from_folder(llama_dir)
    src = adapter_dirs["qv-r4-rs"]
    cases = {
        "alpha": (_tamper(src, tmp_path / "a", config={"lora_alpha": None}), "lora_alpha"),
        "pattern": (_tamper(src, tmp_path / "p", config={"alpha_pattern": ["q_proj"]}), "alpha_pattern"),
        "regex": (_tamper(src, tmp_path / "r", config={"alpha_pattern": {"q_proj(": 2}}), "invalid pattern"),
        "part": (
            _tamper(src, tmp_path / "m", rename={"self_attn.q_proj": ("mlp.q_proj", None)}),
            "not a LoRA weight",
        ),
        "rank0": (
            _tamper(src, tmp_path / "z", rename={"q_proj.lora_A": ("q_proj.lora_A", lambda t: t[:0])}),
            "another base",
        ),
    }
    for name, (folder, reason) in cases.items():
        with pytest.raises(ValueError, match=reason):
            inspect_adapter(name, folder, cfg, max_rank=16)


def test_a_name_in_use_is_never_replaced_in_place(llama_dir, adapter_dirs, prompts) -> None:
    engine = lora_engine(llama_dir, adapter_dirs)
    pool, cfg = engine.runner.lora, ModelConfig.from_folder(llama_dir)
    other = load_adapter("all-r8", adapter_dirs["mlp-r16"], cfg, max_rank=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="is loaded"):
        pool.add(other)
    engine.add_request("r", prompts[0], GREEDY, adapter="all-r8")
    engine.step()
    pool.remove("all-r8")
    with pytest.raises(ValueError, match="still serves requests"):
        pool.add(other)  # the old weights still serve "r"
    while engine.has_unfinished:
        engine.step()
    pool.add(other)  # free once its last request ended
    assert "all-r8" in pool.names()
