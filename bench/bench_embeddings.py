"""Embeddings per second: through the gateway (`/v1/embeddings`, dynamic batching) vs ONNX Runtime
called directly on batches, the same encoder and the same texts, side by side in interleaved rounds.

- direct: this process tokenizes batches of `--concurrency` texts, runs `session.run` on the padded
  batch and mean-pools: the runtime's batched throughput, with no HTTP, no tenancy, no queue.
- gateway: `--concurrency` clients (one text per request, closed loop, keep-alive HTTP/1.1) against
  `fleetgate serve`, whose dynamic batcher merges concurrent requests into runtime batches.
Target (issue 17): gateway >= 90 % of direct at c=16. The encoder is a random-weight BERT written
by `backends/demo_models/encoder.py` (`--hidden`, 2 layers), inputs of 8-30 words.

Writes bench/results/embeddings.json and .png. Run: `.venv/bin/python -m bench.bench_embeddings`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from bench.bench_gateway import start_gateway

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
WORDS = "the quick brown fox jumps over lazy dog gateway fleet tenant edge cpu model token batch".split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) for _ in range(n)]


def run_direct(encoder, corpus: list[str], batch: int, seconds: float) -> float:  # noqa: ANN001
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from backends.embedding import bucket_length

    tok = Tokenizer.from_file(str(encoder.tokenizer_dir / "tokenizer.json"))
    session = ort.InferenceSession(str(encoder.onnx_path), providers=["CPUExecutionProvider"])
    done, i, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        chunk = [corpus[(i + k) % len(corpus)] for k in range(batch)]
        i += batch
        ids = [e.ids for e in tok.encode_batch(chunk)]
        length = bucket_length(max(map(len, ids)), 512)
        input_ids = np.zeros((batch, length), np.int64)
        mask = np.zeros((batch, length), np.int64)
        for row, seq in enumerate(ids):
            input_ids[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1
        hidden = session.run(
            None, {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": 0 * mask}
        )[0]
        pooled = (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        _ = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        done += batch
    return done / (time.perf_counter() - start)


async def _client(
    port: int, key: str, corpus: list[str], stop: float, counts: list[int], errors: list[int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = random.randrange(len(corpus))
    try:
        while time.perf_counter() < stop:
            body = json.dumps({"model": "enc", "input": corpus[i % len(corpus)]}).encode()
            i += 1
            writer.write(
                f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            if b" 200 " not in head.split(b"\r\n")[0]:
                errors.append(1)
            counts.append(1)
    finally:
        writer.close()


def run_gateway(
    port: int, key: str, corpus: list[str], concurrency: int, seconds: float
) -> tuple[float, int]:
    async def main(duration: float) -> tuple[float, int]:
        counts: list[int] = []
        errors: list[int] = []
        start = time.perf_counter()
        stop = start + duration
        await asyncio.gather(*(_client(port, key, corpus, stop, counts, errors) for _ in range(concurrency)))
        return len(counts) / (time.perf_counter() - start), len(errors)

    asyncio.run(main(0.5))
    return asyncio.run(main(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    from backends.demo_models.encoder import write_tiny_encoder

    corpus = texts(512)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            encoder = write_tiny_encoder(Path(tmp) / "enc", hidden_size=args.hidden)

        def config(port: int) -> str:
            return f"""
server: {{port: {port}, log_level: warning}}
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
deployments:
  enc:
    backend: onnxruntime
    model: {encoder.onnx_path}
    batching: {{max_batch_size: {args.concurrency}, max_delay_ms: 2}}
    queue: {{max_concurrency: {4 * args.concurrency}}}
    embedding: {{tokenizer: {encoder.tokenizer_dir}, max_length: 128}}
models: {{enc: {{routes: [{{deployment: enc}}]}}}}
"""

        proc, port, key = start_gateway(Path(tmp), config)
        try:
            for _ in range(args.rounds):
                direct = run_direct(encoder, corpus, args.concurrency, args.seconds)
                through, errors = run_gateway(port, key, corpus, args.concurrency, args.seconds)
                rounds.append({"direct_per_s": direct, "gateway_per_s": through, "gateway_errors": errors})
                print(json.dumps(rounds[-1]))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    ratio = statistics.median(r["gateway_per_s"] / r["direct_per_s"] for r in rounds)
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": vars(args),
        "median": {
            "direct_per_s": statistics.median(r["direct_per_s"] for r in rounds),
            "gateway_per_s": statistics.median(r["gateway_per_s"] for r in rounds),
            "gateway_over_direct": ratio,
            "meets_target_0_9": ratio >= 0.9,
        },
        "rounds": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "embeddings.json").write_text(json.dumps(out, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["ONNX Runtime direct\n(batches of c)", f"gateway /v1/embeddings\n(c={args.concurrency})"]
    ax.bar(names, [out["median"]["direct_per_s"], out["median"]["gateway_per_s"]], color=["#888", "#2a7"])
    ax.set_ylabel("embeddings / s (median of rounds)")
    ax.set_title(f"embeddings: gateway / direct = {ratio:.2f}")
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, RESULTS / "embeddings.png")
    print(json.dumps(out["median"]))


if __name__ == "__main__":
    main()
