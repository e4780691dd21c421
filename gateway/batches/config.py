"""The `batches:` section of the config (OpenAI Batch API)."""

from __future__ import annotations

import math

from backends.spec import SpecBase


class BatchesConfig(SpecBase):
    """Where batch files live and how batch jobs run.

    Attributes:
        files_dir: directory of uploaded files and of jobs' output and error files (relative paths
            are resolved against the config file's directory). Metadata lives in the state store.
        max_file_bytes: largest accepted upload (a larger one is refused with 413 as soon as it
            passes this; uploads are written to disk as they arrive, never held whole in memory).
        max_tenant_bytes: bytes of files one tenant may store at once (uploads, and the output and
            error files of its jobs, which are counted but never refused); an upload that would
            pass it is refused with 429 (413 when the file alone is larger), naming the quota and
            what is used. Deleting a file frees its bytes.
        max_lines: most requests in one input file (OpenAI: 50 000).
        concurrency: lines of one job run at once (each also waits in the fair queue's background
            class, which bounds what batch work reaches a deployment).
        poll_interval_s: how often the runner looks for jobs to start or resume, and a running job
            for a cancel request.
        claim_ttl_s: a job is run by one gateway process, which holds a claim on it that lapses this
            long after the process dies; another process (or this one restarted) then resumes it.
        max_retries: times a line is retried after a transient refusal (429 rate limit, 503, 504)
            before its error is recorded (a refusal because this gateway drains is never recorded:
            the job pauses and resumes).
        max_running_jobs: jobs one gateway process runs at once (each keeps its parsed input in
            memory); the others wait for a free turn, or for another replica.
    """

    files_dir: str = "./var/files"
    max_file_bytes: int = 200 * 1024 * 1024
    max_tenant_bytes: int = 2 * 1024 * 1024 * 1024
    max_lines: int = 50_000
    concurrency: int = 8
    poll_interval_s: float = 1.0
    claim_ttl_s: float = 30.0
    max_retries: int = 5
    max_running_jobs: int = 4

    def __post_init__(self) -> None:
        sizes = (self.max_file_bytes, self.max_tenant_bytes, self.max_lines, self.concurrency, self.max_running_jobs)
        if min(sizes) < 1:
            raise ValueError(
                "max_file_bytes, max_tenant_bytes, max_lines, concurrency and max_running_jobs must be >= 1"
            )
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        for name in ("poll_interval_s", "claim_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0")
