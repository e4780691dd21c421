"""A request's sampling fields as OpenVINO GenAI's GenerationConfig, and what it cannot honour.

Everything the pipeline cannot do is refused before admission with a 400 naming the field, never
dropped: `logit_bias`, `top_logprobs` (the pipeline reports only the chosen token's logprob),
tools and LoRA adapters.
"""

from __future__ import annotations

import json
import re
from typing import Any

from backends.base import GenerateRequest, SamplingParams, StructuredOutput
from backends.errors import InvalidInput
from backends.runtime.sampling_checks import check_sampling_ranges
from backends.torch_llm.structured.schema import GrammarError, check_schema, strict_formats

#: OpenAI/vLLM fields (`GenerateRequest.extra`) the pipeline applies through SamplingParams
_HONOURED = frozenset({"presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"})
#: the fields structured outputs arrive in (the gateway maps them to `SamplingParams.structured`)
_STRUCTURED = frozenset(
    {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
)
#: the largest seed the pipeline's generator takes (size_t, kept to 63 bits like OpenAI's clients)
_MAX_SEED = (1 << 63) - 1


def check_request(request: GenerateRequest) -> None:
    """Refuse, naming it, a field this backend does not serve (before admission: it costs nothing).

    Raises:
        InvalidInput: the field and why.
    """
    honoured = _HONOURED | (_STRUCTURED if request.sampling.structured is not None else frozenset())
    unsupported = sorted(set(request.extra) - honoured)
    if request.tools or request.tool_choice not in (None, "none"):
        unsupported.append("tools")
    if unsupported:
        names = ", ".join(f"`{name}`" for name in dict.fromkeys(unsupported))
        raise InvalidInput(f"{names} not supported by the openvino_llm backend; leave them out")
    if request.adapter is not None:
        raise InvalidInput("LoRA adapters are not served by the openvino_llm backend")
    p = request.sampling
    if p.logit_bias:
        raise InvalidInput("`logit_bias` not supported by the openvino_llm backend; leave it out")
    if p.top_logprobs:
        raise InvalidInput(
            "`top_logprobs` not supported by the openvino_llm backend (it reports the chosen token's "
            "logprob only); leave it out or set it to 0"
        )
    if p.structured is not None:
        structured_config(p.structured)  # a schema or regex it cannot take is refused now


def check_sampling(p: SamplingParams) -> None:
    """Range checks (the pipeline's own `validate` answers in C++ terms; these name the field)."""
    check_sampling_ranges(p)
    if p.seed is not None and not 0 <= p.seed <= _MAX_SEED:
        raise InvalidInput(f"seed must be in 0..{_MAX_SEED}")


def generation_config(base: Any, p: SamplingParams, eos_ids: set[int]) -> Any:
    """A copy of the pipeline's default GenerationConfig (`base`) set from `p`.

    Stop strings are not handed over: the backend's detokenizer cuts the text before them (the
    same holdback as the own engine) and stops the sequence.
    """
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    eos = getattr(base, "eos_token_id", -1)  # the pipeline's default, from generation_config.json
    if isinstance(eos, int) and eos >= 0:
        config.set_eos_token_id(eos)
    config.max_new_tokens = p.max_tokens
    config.min_new_tokens = p.min_tokens
    config.ignore_eos = p.ignore_eos
    config.num_return_sequences = 1
    if eos_ids:
        config.stop_token_ids = set(eos_ids) | set(p.stop_token_ids)
    elif p.stop_token_ids:
        config.stop_token_ids = set(p.stop_token_ids)
    config.do_sample = p.temperature > 0.0
    if config.do_sample:
        config.temperature = p.temperature
        config.top_p = p.top_p
        config.top_k = p.top_k if p.top_k > 0 else 0
        if p.seed is not None:
            config.rng_seed = p.seed
    config.presence_penalty = p.presence_penalty
    config.frequency_penalty = p.frequency_penalty
    config.repetition_penalty = p.repetition_penalty
    config.logprobs = 1 if p.logprobs else 0
    if p.structured is not None:
        config.structured_output_config = structured_config(p.structured)
    return config


def structured_config(s: StructuredOutput) -> Any:
    """The pipeline's StructuredOutputConfig for one constraint (xgrammar inside the pipeline).

    Raises:
        InvalidInput: a schema keyword the grammar would not enforce, or a regex Python cannot read
            (checked here, so a bad one is a 400 before admission, not an error mid-stream).
    """
    import openvino_genai as ov_genai

    if s.json_schema is not None:
        try:
            schema = json.loads(s.json_schema)
            check_schema(schema)
        except GrammarError as exc:
            raise InvalidInput(f"response_format: {exc}") from None
        return ov_genai.StructuredOutputConfig(json_schema=json.dumps(strict_formats(schema)))
    if s.json_object:
        return ov_genai.StructuredOutputConfig(json_schema=json.dumps({"type": "object"}))
    if s.regex is not None:
        try:
            re.compile(s.regex)
        except re.error as exc:
            raise InvalidInput(f"guided_regex: {exc}") from None
        return ov_genai.StructuredOutputConfig(regex=s.regex)
    if s.choice is not None:
        if not s.choice:
            raise InvalidInput("guided_choice: give at least one choice")
        return ov_genai.StructuredOutputConfig(regex="|".join(f"(?:{re.escape(c)})" for c in s.choice))
    if s.grammar is not None:
        return ov_genai.StructuredOutputConfig(grammar=s.grammar)
    raise InvalidInput("structured output: no constraint given")
