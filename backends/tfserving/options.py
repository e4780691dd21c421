"""`options:` of a tfserving deployment."""

from __future__ import annotations

from backends.spec import SpecBase


class TFServingOptions(SpecBase):
    """`options:` of a tfserving deployment."""

    #: pin a model version (default: the server's latest); exclusive with `version_label`
    version: int | None = None
    #: a version label such as "stable" or "canary"
    version_label: str | None = None
    #: the SavedModel signature called
    signature_name: str = "serving_default"
    #: largest gRPC message sent or received
    max_message_bytes: int = 64 * 1024 * 1024
    #: gRPC channels (one TCP connection each) requests are spread over
    channels: int = 1
    #: with batching: merged batches sent at the same time (the server runs Predicts in parallel)
    parallel_batches: int = 2

    def __post_init__(self) -> None:
        if self.version is not None and self.version_label is not None:
            raise ValueError("set either version or version_label, not both")
        if self.version is not None and self.version < 1:
            raise ValueError("version must be >= 1")
        if self.channels < 1:
            raise ValueError("channels must be >= 1")
        if self.parallel_batches < 1:
            raise ValueError("parallel_batches must be >= 1")
        if self.max_message_bytes < 4096:
            raise ValueError("max_message_bytes must be >= 4096")
