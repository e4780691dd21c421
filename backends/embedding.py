"""Sentence embeddings on any tensor runtime: tokenize, run the encoder, pool, normalize.

`EmbeddingAdapter` wraps the tensor backend of a deployment whose config has `embedding:` (ONNX
Runtime or OpenVINO) and adds `Capability.EMBED`. Inputs are tokenized with the encoder's own
`tokenizer.json` (special tokens and truncation as the tokenizer defines them), padded to a bucket
length (a power of two, at most `max_length`) so that concurrent calls of similar lengths share
one runtime batch in the dynamic batcher, run through the wrapped backend's `infer`, then pooled
over the real tokens (`mean`) or taken at the first token (`cls`), and scaled to unit length.
"""

from __future__ import annotations

import pathlib

import numpy as np

from backends.base import (
    V2_TO_NUMPY,
    Backend,
    BatchObserver,
    Capability,
    EmbedRequest,
    ModelMetadata,
    Tensor,
    TensorRequest,
    TensorResponse,
    as_tensor,
)
from backends.errors import BackendInternalError, InvalidInput
from backends.lazy import require
from backends.spec import EmbeddingSpec

#: the shortest padded length: tiny inputs still share batches
MIN_BUCKET = 8


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

    def prepare_embedding(
        self, inputs: list[str] | list[list[int]], request_id: str, dimensions: int | None = None
    ) -> EmbedRequest:
        if self._tokenizer is None:
            raise RuntimeError("prepare_embedding() before load()")
        width = self._width()
        if dimensions is not None and not 1 <= dimensions <= width:
            raise InvalidInput(f"`dimensions` is {dimensions}; this model's embeddings have {width}")
        if not inputs:
            raise InvalidInput("`input` must not be empty")
        if len(inputs) > self.spec.max_inputs:
            raise InvalidInput(f"`input` holds {len(inputs)} items; this model takes at most {self.spec.max_inputs}")
        if all(isinstance(x, str) for x in inputs):
            if any(not x for x in inputs):
                raise InvalidInput("`input` must not contain empty strings")
            ids = [e.ids for e in self._tokenizer.encode_batch(list(inputs))]
        else:
            vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
            ids = []
            for i, item in enumerate(inputs):
                if not item or any(type(t) is not int or not 0 <= t < vocab for t in item):  # type: ignore[union-attr]
                    raise InvalidInput(f"input[{i}]: token ids must be a non-empty list of ids below {vocab}")
                ids.append(list(item)[: self.spec.max_length])  # type: ignore[arg-type]
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
        if self.spec.pooling == "cls":
            vectors = hidden[:, 0, :]
        else:
            weights = mask[:, :, None].astype(np.float32)
            vectors = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)
        if request.dimensions is not None:
            vectors = vectors[:, : request.dimensions]
        if self.spec.normalize:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors.astype(np.float32, copy=False)
