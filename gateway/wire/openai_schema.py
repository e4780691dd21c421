"""OpenAI request bodies, decoded with msgspec, and their translation to GenerateRequest.

Unknown fields are tolerated (clients send many optional ones). Known fields are never silently
dropped: those the gateway cannot honour for any backend (best_of, echo) are refused here with a 400
naming them; `logprobs` / `top_logprobs` are served by the own engine and asked of a remote upstream;
fields that only some backends honour (penalties, logit_bias, response_format, min_tokens, tools,
tool_choice, parallel_tool_calls, vLLM's structured_outputs and guided_*) travel in
`GenerateRequest.extra` to a remote OpenAI upstream as sent; the own engine applies the penalties,
logit_bias and min_tokens (SamplingParams), the output constraint (`SamplingParams.structured`,
see `openai_structured`) and the tools (`GenerateRequest.tools`, `tool_choice`,
`parallel_tool_calls`), and refuses the others with a 400 naming them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends.base import ChatMessage, GenerateRequest, SamplingParams
from backends.errors import InvalidInput
from backends.runtime.json_errors import JSON_DECODE_ERRORS, describe_decode_error
from gateway.wire.openai_structured import GUIDED_FIELDS, structured_output

DEFAULT_MAX_TOKENS = 256
#: choices one request may ask for (`n`): each is a generation of its own, admitted together
MAX_CHOICES = 16
#: far above any context window: a bound so that reservations stay ordinary integers
MAX_TOKENS_LIMIT = 2**31 - 1


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # extensions shared with vLLM
    top_k: int | None = None
    ignore_eos: bool = False
    # honoured by some backends only (see the module docstring): forwarded or refused, never dropped
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    min_tokens: int | None = None
    # vLLM's output constraints (`openai_structured`); shapes checked there, with clear messages
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


#: fields forwarded to backends that honour them (`GenerateRequest.extra`), with their neutral value
_FORWARDED = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "min_tokens": 0,
    "structured_outputs": None,
    **dict.fromkeys(GUIDED_FIELDS),
}


def _forwarded(body: _Common) -> dict[str, Any]:
    """The forwarded fields the client set to anything but their neutral value."""
    out = {}
    for name, neutral in _FORWARDED.items():
        value = getattr(body, name)
        if value is not None and value != neutral:
            out[name] = value
    return out


class CompletionBody(_Common, kw_only=True):
    #: a string, a list of one string, token ids, or a list of one list of token ids; the element
    #: types are checked in `completion_request` (msgspec cannot decode a union of list types)
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


class ToolFunction(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: ToolFunction


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: ToolChoiceFunction


class ChatPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageBody(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ChatPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    #: kept as sent (forwarded verbatim), checked against `Tool` / `ToolChoice` in `_tool_fields`
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


completion_decoder = msgspec.json.Decoder(CompletionBody)
chat_decoder = msgspec.json.Decoder(ChatBody)


def decode(body: bytes, decoder: msgspec.json.Decoder) -> Any:
    try:
        return decoder.decode(body)
    except JSON_DECODE_ERRORS as exc:  # ValidationError is a DecodeError
        raise InvalidInput(describe_decode_error(exc)) from None


def _sampling(body: _Common, max_tokens: int | None, logprobs: bool) -> SamplingParams:
    if not 1 <= body.n <= MAX_CHOICES:
        raise InvalidInput(f"`n` must be in 1..{MAX_CHOICES}")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 <= temperature <= 2.0:
        raise InvalidInput("`temperature` must be between 0 and 2")
    if not 0.0 < top_p <= 1.0:
        raise InvalidInput("`top_p` must be in (0, 1]")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidInput("`max_tokens` must be >= 1")
    if body.top_k is not None and body.top_k < 0:
        raise InvalidInput("`top_k` must be >= 0")
    if body.seed is not None and not -(2**63) <= body.seed < 2**63:
        raise InvalidInput("`seed` must be a 64-bit signed integer")
    if max_tokens is not None and max_tokens > MAX_TOKENS_LIMIT:
        raise InvalidInput(f"`max_tokens` must be <= {MAX_TOKENS_LIMIT}")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4:
        raise InvalidInput("`stop` takes at most 4 sequences")
    return SamplingParams(
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        temperature=temperature,
        top_p=top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=[s for s in stop if s],
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        model_defaults=frozenset(
            name for name in ("temperature", "top_p", "top_k") if getattr(body, name) is None
        ),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_token_biases(body.logit_bias),
        min_tokens=body.min_tokens or 0,
        structured=structured_output(
            body.response_format,
            body.structured_outputs,
            {name: getattr(body, name) for name in GUIDED_FIELDS},
        ),
    )


def _token_biases(raw: dict[str, float] | None) -> dict[int, float]:
    """`logit_bias` as token ids: its keys are JSON strings of non-negative integers."""
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        if not key.isdigit():
            raise InvalidInput(f"`logit_bias` keys must be token ids, got {key!r}")
        out[int(key)] = float(bias)
    return out


def _is_token_id(x: object) -> bool:
    """A plain non-negative int (JSON 7.0 decodes as a float, true as a bool: both refused)."""
    return type(x) is int and x >= 0


def completion_request(body: CompletionBody, request_id: str) -> GenerateRequest:
    if body.best_of not in (None, 1):
        raise InvalidInput("`best_of` must be 1")
    if body.echo:
        raise InvalidInput("`echo` is not supported")
    prompt: str | None = None
    token_ids: list[int] | None = None
    p = body.prompt
    if isinstance(p, str):
        prompt = p
    elif p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise InvalidInput("`prompt` may hold one prompt per request")
        prompt = p[0]  # type: ignore[assignment]
    elif p and all(_is_token_id(x) for x in p):
        token_ids = list(p)
    elif p and len(p) == 1 and isinstance(p[0], list):
        if not p[0] or not all(_is_token_id(x) for x in p[0]):
            raise InvalidInput("`prompt` token ids must be non-negative integers")
        token_ids = list(p[0])
    elif p and all(isinstance(x, list) for x in p):
        raise InvalidInput("`prompt` may hold one prompt per request")
    else:
        raise InvalidInput(
            "`prompt` must be a string, a list of one string, a list of token ids (integers), "
            "or a list of one list of token ids"
        )
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise InvalidInput("`logprobs` must be in 0..5 (the alternatives to list per token)")
    sampling = _sampling(body, body.max_tokens, body.logprobs is not None)
    return GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=token_ids,
        sampling=msgspec.structs.replace(sampling, top_logprobs=body.logprobs or 0),
        extra=_forwarded(body),
    )


def _content(message: ChatMessageBody, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise InvalidInput(f"messages[{index}]: only text content parts are supported")
        texts.append(part.text)
    return "".join(texts)


def _checked(value: Any, kind: type, where: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"`{where}`: {exc}") from None


def _tool_fields(body: ChatBody) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls, checked, for `GenerateRequest.extra` (a remote
    upstream receives them as sent) and its `tools` fields (an own engine serves them)."""
    if body.tools is not None and not body.tools:
        raise InvalidInput("`tools` must not be empty (leave it out)")
    tools = [_checked(t, Tool, f"tools[{i}]") for i, t in enumerate(body.tools or ())]
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidInput(f"`tools[{i}].type` must be 'function', got {tool.type!r}")
    names = {t.function.name for t in tools}
    choice = body.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise InvalidInput("`tool_choice` must be 'none', 'auto', 'required' or a function to call")
    if choice not in (None, "none") and not names:
        raise InvalidInput("`tool_choice` needs `tools`")
    if isinstance(choice, dict):
        wanted = _checked(choice, ToolChoice, "tool_choice").function.name
        if wanted not in names:
            raise InvalidInput(f"`tool_choice` names {wanted!r}, which is not in `tools`")
    out: dict[str, Any] = {}
    if body.tools:
        out["tools"] = body.tools
        if choice is not None:
            out["tool_choice"] = choice
        if body.parallel_tool_calls is not None:
            out["parallel_tool_calls"] = body.parallel_tool_calls
    return out


def _message(m: ChatMessageBody, index: int) -> ChatMessage:
    return ChatMessage(
        role=m.role,
        content=_content(m, index),
        tool_calls=m.tool_calls or None,
        tool_call_id=m.tool_call_id,
        name=m.name,
    )


def chat_request(body: ChatBody, request_id: str) -> GenerateRequest:
    tools = _tool_fields(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidInput("`top_logprobs` needs `logprobs: true`")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise InvalidInput("`top_logprobs` must be in 0..20")
    if not body.messages:
        raise InvalidInput("`messages` must not be empty")
    roles = {"system", "user", "assistant", "developer", "tool"}
    for i, m in enumerate(body.messages):
        if m.role not in roles:
            raise InvalidInput(f"messages[{i}].role {m.role!r} is not one of {sorted(roles)}")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    max_tokens = body.max_completion_tokens or body.max_tokens
    sampling = _sampling(body, max_tokens, body.logprobs)
    return GenerateRequest(
        request_id=request_id,
        messages=messages,
        sampling=msgspec.structs.replace(sampling, top_logprobs=body.top_logprobs or 0),
        extra=_forwarded(body) | tools,
        # also read by own engines, which render the tools and parse the calls themselves
        tools=tools.get("tools"),
        tool_choice=tools.get("tool_choice"),
        parallel_tool_calls=tools.get("parallel_tool_calls", True),
    )


class EmbeddingsBody(msgspec.Struct, kw_only=True):
    model: str
    #: a string, a list of strings, a list of token ids, or a list of lists of token ids
    input: str | list[Any]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


embeddings_decoder = msgspec.json.Decoder(EmbeddingsBody)


def embedding_inputs(body: EmbeddingsBody) -> list[str] | list[list[int]]:
    """The inputs of an embeddings body, one entry per vector to return."""
    if body.encoding_format not in ("float", "base64"):
        raise InvalidInput("`encoding_format` must be `float` or `base64`")
    if body.dimensions is not None and body.dimensions < 1:
        raise InvalidInput("`dimensions` must be >= 1")
    value = body.input
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(x, str) for x in value):
        return list(value)
    if value and all(_is_token_id(x) for x in value):
        return [list(value)]
    if value and all(isinstance(x, list) and x and all(_is_token_id(t) for t in x) for x in value):
        return [list(x) for x in value]
    raise InvalidInput(
        "`input` must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
    )
