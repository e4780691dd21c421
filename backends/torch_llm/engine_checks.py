"""What a request must satisfy before it joins the engine (torch-free, shared by backend and engine).

A request that passes these checks cannot fail a step on its own inputs: token ids are plain ints
inside the vocabulary (a float or a bool would reach the embedding or the detokeniser) and the seed
fits a torch generator.
"""

from __future__ import annotations

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
