"""Sentence embeddings on any tensor runtime: tokenize, run the encoder, pool, normalize.

`EmbeddingAdapter` wraps the tensor backend of a deployment whose config has `embedding:` (ONNX
Runtime or OpenVINO) and adds `Capability.EMBED`. Inputs are tokenized with the encoder's own
`tokenizer.json` (special tokens and truncation as the tokenizer defines them), padded to a bucket
length (a power of two, at most `max_length`) so that concurrent calls of similar lengths share
one runtime batch in the dynamic batcher, run through the wrapped backend's `infer`, then pooled
over the real tokens (`mean`) or taken at the first token (`cls`), and scaled to unit length.

A call is checked before any tokenizing (`check_embedding`): at most `max_inputs` inputs, and no
text longer than `max_length * MAX_BYTES_PER_TOKEN` UTF-8 bytes (more than `max_length` tokens
can need: the tokenizer would read it all only to cut it at `max_length`). The same check gives
the cost that admission reserves (`estimate_tokens`), so a refused call is never tokenized; the
tokenizing itself (`tokenize_embedding`) runs in a worker thread past a few KiB of text.
"""

from __future__ import annotations

import asyncio
import pathlib

import numpy as np

from backends.base import (
    BYTES_PER_TOKEN,
    V2_TO_NUMPY,
    Backend,
    BatchObserver,
    Capability,
    EmbedRequest,
    ModelMetadata,
    Tensor,
    TensorRequest,
    TensorResponse,
    as_embedding,
    as_tensor,
)
from backends.errors import BackendInternalError, InvalidInput
from backends.runtime.lazy import require
from backends.spec import EmbeddingSpec

#: the shortest padded length: tiny inputs still share batches
MIN_BUCKET = 8
#: UTF-8 bytes one token may take at most, as this gateway bounds an input: `max_length` tokens
#: of any text (English averages ~4 bytes a token, CJK ~3, a WordPiece [UNK] word up to 100
#: characters) fit in `max_length * 32` bytes; a longer input is refused before tokenizing
MAX_BYTES_PER_TOKEN = 32
#: texts of a call up to this many bytes in all are tokenized on the event loop (a thread hop
#: costs more); longer ones in a worker thread, so that no call stalls the others
INLINE_TOKENIZE_BYTES = 16_384
#: hidden states up to this size are pooled on the event loop; larger ones in a worker thread
INLINE_POOL_BYTES = 1 << 20


def bucket_length(longest: int, max_length: int) -> int:
    """The padded length for a batch whose longest input has `longest` tokens."""
    length = MIN_BUCKET
    while length < longest:
        length *= 2
    return min(length, max_length)


class EmbeddingAdapter:
    """A tensor backend served as an embedding model (see the module docstring)."""

    def __init__(self, inner: Backend, spec: EmbeddingSpec) -> None:
        self.inner = as_tensor(inner)
        self.spec = spec
        self.name = inner.name
        self.capabilities = inner.capabilities | {Capability.EMBED}
        self._tokenizer = None
        folder = pathlib.Path(spec.tokenizer)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"embedding.tokenizer: no tokenizer.json in {folder}")

    # --- lifecycle and tensors: the wrapped backend's --------------------------------------------

    @property
    def ready(self) -> bool:
        return self.inner.ready and self._tokenizer is not None

    @property
    def batch_observer(self) -> BatchObserver | None:
        return self.inner.batch_observer

    @batch_observer.setter
    def batch_observer(self, observer: BatchObserver | None) -> None:
        self.inner.batch_observer = observer

    async def load(self) -> None:
        tokenizers = require("tokenizers", extra="torch")
        tokenizer = tokenizers.Tokenizer.from_file(str(pathlib.Path(self.spec.tokenizer) / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.enable_truncation(self.spec.max_length)
        await self.inner.load()
        self._check_signature(self.inner.metadata())
        self._tokenizer = tokenizer

    async def warmup(self) -> None:
        await self.inner.warmup()
        await self.embed(self.prepare_embedding(["warm up"], "warmup"))

    async def close(self) -> None:
        self._tokenizer = None
        await self.inner.close()

    def metadata(self) -> ModelMetadata:
        meta = self.inner.metadata()
        extra = {**meta.extra, "embedding": {"pooling": self.spec.pooling, "normalize": self.spec.normalize}}
        return ModelMetadata(
            name=meta.name,
            platform=meta.platform,
            inputs=meta.inputs,
            outputs=meta.outputs,
            device=meta.device,
            versions=meta.versions,
            extra=extra,
        )

    async def infer(self, request: TensorRequest) -> TensorResponse:
        return await self.inner.infer(request)

    # --- embeddings ------------------------------------------------------------------------------

    def _check_signature(self, meta: ModelMetadata) -> None:
        names = {s.name for s in meta.inputs}
        missing = {"input_ids", "attention_mask"} - names
        if missing:
            raise RuntimeError(f"embedding: the model has no input {sorted(missing)} (it has {sorted(names)})")
        outputs = [s.name for s in meta.outputs]
        if self.spec.output is not None and self.spec.output not in outputs:
            raise RuntimeError(f"embedding.output: the model has no output {self.spec.output!r} ({outputs})")

    def check_embedding(self, inputs: list[str] | list[list[int]], dimensions: int | None = None) -> int:
        """Check a call without tokenizing it; returns the bytes of its texts (0 for token ids).

        Raises InvalidInput (400, naming the limit) for an empty call, more than `max_inputs`
        inputs, an empty or too long text, ids outside the vocabulary, or a bad `dimensions`.
        """
        if self._tokenizer is None:
            raise RuntimeError("check_embedding() before load()")
        width = self._width()
        if dimensions is not None and not 1 <= dimensions <= width:
            raise InvalidInput(f"`dimensions` is {dimensions}; this model's embeddings have {width}")
        if not inputs:
            raise InvalidInput("`input` must not be empty")
        if len(inputs) > self.spec.max_inputs:
            raise InvalidInput(f"`input` holds {len(inputs)} items; this model takes at most {self.spec.max_inputs}")
        if not all(isinstance(x, str) for x in inputs):
            vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
            for i, item in enumerate(inputs):
                if not item or any(type(t) is not int or not 0 <= t < vocab for t in item):  # type: ignore[union-attr]
                    raise InvalidInput(f"input[{i}]: token ids must be a non-empty list of ids below {vocab}")
            return 0
        limit = self.spec.max_length * MAX_BYTES_PER_TOKEN
        total = 0
        for i, text in enumerate(inputs):
            if not text:
                raise InvalidInput("`input` must not contain empty strings")
            # characters first: a text of more characters than the limit has more bytes too, and
            # is refused without encoding it
            size = len(text) if len(text) > limit else len(text.encode())  # type: ignore[arg-type]
            if size > limit:
                raise InvalidInput(
                    f"input[{i}] is longer than {limit} bytes: this model reads at most "
                    f"{self.spec.max_length} tokens of an input (max_length), and an input of more than "
                    f"{MAX_BYTES_PER_TOKEN} bytes a token is refused before tokenizing"
                )
            total += size
        return total

    def estimate_tokens(self, inputs: list[str] | list[list[int]]) -> int:
        """The tokens a checked call is expected to cost, for admission before tokenizing: exact for
        token ids, else `BYTES_PER_TOKEN` bytes a token plus the two special tokens an encoder adds,
        at most `max_length` an input. The call is charged what it really used once tokenized."""
        cap = self.spec.max_length
        if not all(isinstance(x, str) for x in inputs):
            return sum(min(len(x), cap) for x in inputs)
        return sum(min(-(-len(x) // BYTES_PER_TOKEN) + 2, cap) for x in inputs)  # type: ignore[arg-type]

    def prepare_embedding(
        self, inputs: list[str] | list[list[int]], request_id: str, dimensions: int | None = None
    ) -> EmbedRequest:
        """Check and tokenize a call on the calling thread (`EmbeddingBackend`'s contract)."""
        self.check_embedding(inputs, dimensions)
        return self._tokenized(inputs, request_id, dimensions)

    async def tokenize_embedding(
        self, inputs: list[str] | list[list[int]], request_id: str, dimensions: int | None, text_bytes: int
    ) -> EmbedRequest:
        """Tokenize a call `check_embedding` passed (`text_bytes`: what it returned); past
        `INLINE_TOKENIZE_BYTES` in a worker thread (the tokenizer releases the GIL), so that the
        event loop keeps serving every other call meanwhile."""
        if text_bytes > INLINE_TOKENIZE_BYTES:
            return await asyncio.to_thread(self._tokenized, inputs, request_id, dimensions)
        return self._tokenized(inputs, request_id, dimensions)

    def _tokenized(
        self, inputs: list[str] | list[list[int]], request_id: str, dimensions: int | None
    ) -> EmbedRequest:
        """The EmbedRequest of a checked call: texts tokenized (truncated by the tokenizer), ids cut."""
        if self._tokenizer is None:
            raise RuntimeError("tokenizing before load()")
        if all(isinstance(x, str) for x in inputs):
            ids = [e.ids for e in self._tokenizer.encode_batch(list(inputs))]
        else:
            ids = [list(item)[: self.spec.max_length] for item in inputs]  # type: ignore[arg-type]
        return EmbedRequest(id=request_id, token_ids=ids, dimensions=dimensions)

    def _width(self) -> int:
        """The size of the model's vectors (the hidden states' last dimension)."""
        meta = self.inner.metadata()
        name = self.spec.output or meta.outputs[0].name
        (spec,) = [s for s in meta.outputs if s.name == name]
        return spec.shape[-1] if spec.shape and spec.shape[-1] > 0 else 1 << 16

    def _tensors(self, request: EmbedRequest) -> tuple[TensorRequest, np.ndarray]:
        meta = self.inner.metadata()
        dtypes = {s.name: V2_TO_NUMPY[s.datatype] for s in meta.inputs}
        length = bucket_length(max(len(ids) for ids in request.token_ids), self.spec.max_length)
        rows = len(request.token_ids)
        input_ids = np.zeros((rows, length), np.int64)
        mask = np.zeros((rows, length), np.int64)
        for row, ids in enumerate(request.token_ids):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        arrays = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in dtypes:
            arrays["token_type_ids"] = np.zeros((rows, length), np.int64)
        tensors = [Tensor.from_array(name, a.astype(dtypes[name], copy=False)) for name, a in arrays.items()]
        output = self.spec.output or meta.outputs[0].name
        return TensorRequest(id=request.id, inputs=tensors, outputs=[output]), mask

    async def embed(self, request: EmbedRequest) -> np.ndarray:
        tensors, mask = self._tensors(request)
        response = await self.inner.infer(tensors)
        hidden = np.asarray(response.outputs[0].data, dtype=np.float32)
        if hidden.ndim != 3 or hidden.shape[:2] != mask.shape:
            raise BackendInternalError(
                f"the encoder answered shape {list(hidden.shape)}; [rows, tokens, dim] was expected"
            )
        if hidden.nbytes > INLINE_POOL_BYTES:  # a large call's pooling would hold the loop
            return await asyncio.to_thread(self._pooled, hidden, mask, request.dimensions)
        return self._pooled(hidden, mask, request.dimensions)

    def _pooled(self, hidden: np.ndarray, mask: np.ndarray, dimensions: int | None) -> np.ndarray:
        """One vector per row of `hidden` [rows, tokens, dim]: pooled, cut to `dimensions`, normalized."""
        if self.spec.pooling == "cls":
            vectors = hidden[:, 0, :]
        else:
            weights = mask.astype(np.float32)
            # [rows, 1, tokens] @ [rows, tokens, dim]: the masked sum without a [rows, tokens, dim] copy
            sums = np.matmul(weights[:, None, :], hidden)[:, 0, :]
            vectors = sums / np.maximum(weights.sum(axis=1, keepdims=True), 1.0)
        if dimensions is not None:
            vectors = vectors[:, :dimensions]
        if self.spec.normalize:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors.astype(np.float32, copy=False)

def as_embedding_adapter(backend: Backend) -> EmbeddingAdapter:
    """`backend` as an embedding deployment (checked and admitted before tokenizing); TypeError
    for a backend that does not declare `EMBED`."""
    embedder = as_embedding(backend)
    if not isinstance(embedder, EmbeddingAdapter):
        raise TypeError(f"backend {backend.name!r} embeds without the checks of an EmbeddingAdapter")
    return embedder
