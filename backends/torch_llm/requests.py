"""A request on its way into the engine and its answer on the way out (torch-free).

What a request must satisfy: the OpenAI fields this engine honours and the ranges of its sampling
parameters (`check_supported`, `check_sampling`, by the backend on the event loop, so a refusal is a
400 before admission), and what the engine itself checks again before a request joins a step
(`check_prompt_ids`, `check_seed`, `check_token_biases`: a request that passes them cannot fail a
step on its own inputs; token ids are plain ints inside the vocabulary, since a float or a bool would
reach the embedding or the detokeniser, and the seed fits a torch generator). Then its prompt ids
(`prompt_ids`; `tokenize` refuses a prompt too long to fit before tokenizing it and tokenizes long
ones off the event loop; `fingerprint` tells whether ids counted at admission belong to it), its
tokens as OpenAI logprob entries (`token_logprobs`), and the error a stream the engine ended raises
(`failure`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.base import GenerateRequest, SamplingParams, TokenLogprob
from backends.errors import BackendInternalError, BackendUnavailable, InvalidInput
from backends.runtime.sampling_checks import check_sampling_ranges
from backends.tool_parsers.plan import TOOL_FIELDS, shown_tools, template_messages
from backends.torch_llm.structured.compiler import STRUCTURED_FIELDS

if TYPE_CHECKING:
    from backends.torch_llm.tokenizer import TextTokenizer

#: a token holds at most this many characters in any tokenizer we serve (English averages ~4):
#: a longer prompt cannot fit max_model_len, and is refused before tokenizing it
MAX_CHARS_PER_TOKEN = 32
#: prompts up to this many characters are tokenized on the event loop (a thread hop costs more)
INLINE_TOKENIZE_CHARS = 16_384
#: the seeds a request may give: torch generators take 64-bit seeds
SEED_RANGE = (-(2**63), 2**64 - 1)


def check_prompt_ids(ids: list[int], vocab_size: int | None) -> None:
    """Raise ValueError unless `ids` is a non-empty list of ints (not bools) in [0, vocab_size)."""
    if not ids:
        raise ValueError("the prompt is empty")
    limit = vocab_size if vocab_size is not None else 2**63
    for t in ids:
        if type(t) is not int or not 0 <= t < limit:
            raise ValueError(f"prompt token ids must be integers in [0, {limit}); got {t!r}")


def check_seed(seed: int | None) -> None:
    """Raise ValueError unless `seed` is None or an int a torch generator accepts."""
    if seed is not None and (type(seed) is not int or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")


def check_token_biases(biases: dict[int, float], vocab_size: int) -> None:
    """`logit_bias` names token ids of the vocabulary, with finite biases in -100..100.

    Raises:
        ValueError: naming the first bad entry.
    """
    for token, bias in biases.items():
        if type(token) is not int or not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias: token id {token!r} is not in the vocabulary (0..{vocab_size - 1})")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias: the bias of token {token} must be in -100..100")


#: OpenAI fields (`GenerateRequest.extra`) this engine applies through SamplingParams
HONOURED = frozenset(
    {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens"}
)


def check_supported(request: GenerateRequest) -> None:
    """Refuse, naming them, the OpenAI fields this engine does not implement (never drop them)."""
    honoured = HONOURED | (STRUCTURED_FIELDS if request.sampling.structured is not None else frozenset())
    unsupported = sorted(set(request.extra) - honoured - TOOL_FIELDS)
    if unsupported:
        names = ", ".join(f"`{name}`" for name in unsupported)
        raise InvalidInput(f"{names} not supported by this deployment's engine; leave them out")


def check_sampling(p: SamplingParams) -> None:
    """Raise InvalidInput naming the first sampling parameter out of its range."""
    check_sampling_ranges(p)
    try:
        check_seed(p.seed)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def fingerprint(request: GenerateRequest) -> int:
    """Identifies a prompt, so ids counted for one request are never used for another with its id."""
    # all the chat template renders: the messages with their tool context, and the tools shown
    chat = repr((template_messages(request.messages or []), shown_tools(request)))
    return hash((request.prompt, chat, tuple(request.prompt_token_ids or ())))


def prompt_ids(request: GenerateRequest, tokenizer: Callable[[], TextTokenizer], vocab_size: int | None) -> list[int]:
    """The request's prompt as token ids: given ids (checked), a rendered chat or encoded text.

    `tokenizer` is only called when text must be tokenized (given ids need no loaded model)."""
    given = [x is not None for x in (request.prompt, request.prompt_token_ids, request.messages)]
    if sum(given) != 1:
        raise InvalidInput("give exactly one of prompt, prompt_token_ids or messages")
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
        try:
            check_prompt_ids(ids, vocab_size)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
    else:
        tok = tokenizer()
        if request.messages is not None:
            try:
                ids = tok.apply_chat_template(template_messages(request.messages), shown_tools(request))
            except ValueError as exc:
                raise InvalidInput(str(exc)) from None
        else:
            ids = tok.encode(request.prompt or "")
    if not ids:
        raise InvalidInput("the prompt is empty")
    return ids


async def tokenize(
    request: GenerateRequest, tokenizer: Callable[[], TextTokenizer], vocab_size: int | None, max_len: int | None
) -> list[int]:
    """`prompt_ids`, refusing an oversized prompt before any tokenizing, large ones off the loop."""
    text_bytes = len(request.prompt or "") + sum(len(m.content) for m in request.messages or [])
    if max_len is not None and text_bytes > max_len * MAX_CHARS_PER_TOKEN:
        raise InvalidInput(
            f"the prompt has {text_bytes} characters, far more than this deployment's "
            f"max_model_len of {max_len} tokens can hold"
        )
    if text_bytes > INLINE_TOKENIZE_CHARS:  # milliseconds of work: keep the event loop free
        return await asyncio.to_thread(prompt_ids, request, tokenizer, vocab_size)
    return prompt_ids(request, tokenizer, vocab_size)


def token_logprobs(out: Any, tokenizer: Callable[[], TextTokenizer]) -> list[TokenLogprob] | None:
    """An engine output's tokens as OpenAI logprobs entries (text, raw bytes, logprob, alternatives)."""
    if out.logprobs is None:
        return None
    tok = tokenizer()

    def entry(token_id: int, logprob: float) -> TokenLogprob:
        raw = tok.token_bytes(token_id)
        return TokenLogprob(token=raw.decode("utf-8", "replace"), bytes=list(raw), logprob=logprob)

    tops = out.top_logprobs or [[] for _ in out.token_ids]
    entries = []
    for token_id, logprob, top in zip(out.token_ids, out.logprobs, tops, strict=True):
        item = entry(token_id, logprob)
        item.top = [entry(i, lp) for i, lp in top]
        entries.append(item)
    return entries


#: engine finish reasons that are not an answer: the client must see an error, never a normal stop
FAILED = frozenset({"error", "abort"})


def failure(deployment: str, reason: str, detail: str | None) -> Exception:
    """The error a stream ended by the engine raises to its consumer."""
    if reason == "abort":  # the engine is shutting down (a client's own abort has no consumer)
        return BackendUnavailable(f"deployment {deployment!r} stopped before the generation finished")
    return BackendInternalError(
        f"the generation failed on deployment {deployment!r}" + (f": {detail}" if detail else "")
    )
