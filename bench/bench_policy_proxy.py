"""Cost of proxying OpenAI chat completions with the tenant policy path: fleetgate vs LiteLLM proxy.

Side by side in one run, in front of one upstream:
  upstream          a tiny OpenAI-compatible server (raw asyncio HTTP/1.1 on uvloop, its own process):
                    `POST /v1/chat/completions` answers a fixed small completion at once, as JSON,
                    or as SSE chunks when the body asks for `"stream": true`;
  fleetgate_sqlite  `fleetgate serve`, a `remote` (openai) deployment in front of the upstream, a tenant
                    whose limits, quotas and per-key limits are too high to refuse: every request takes
                    the full path (key auth, admit, fair queue, proxy, reconcile); state in SQLite;
  fleetgate_sqlite_thread  the same with `?commit=thread` (store groups commit on the store's thread,
                    not on the event loop): the A/B of where SQLite groups commit;
  fleetgate_redis   the same with state in a redis-server started here on a free loopback port;
  fleetgate_no_policy  the same gateway with nothing to enforce (tenant without limits, quotas or key
                    limits, state `memory://`): what the rest of fleetgate's path adds, beside what
                    the policy path adds on top of it;
  bare_proxy        the floor of fleetgate's server stack (bench/floor_servers.py): uvicorn, httptools
                    and uvloop with a plain ASGI app forwarding each body to the upstream with fleetgate's
                    pooled HTTP/1.1 client, no gateway at all: if it adds over 0.3 ms p50 at c=1, the
                    "<= 0.3 ms added" target is beyond the stack, not the policy path;
  litellm           LiteLLM proxy (own virtualenv bench/.venvs/litellm, made on first use), one uvicorn
                    worker, model_list `openai/<name>` with `api_base` = the upstream, master key only
                    (its virtual keys and per-key limits need Postgres through Prisma; see notes).
Load: wrk, a Lua script POSTing one chat body with the bearer key over keep-alive connections, at c=1
(1 thread) and c=16 (2 threads): 1 s warm-up, then `--seconds` with `--latency`. "added p50" = proxy p50
- upstream p50 at the same concurrency in the same round. A round runs every (server, concurrency)
point back to back (server order rotated per round); the JSON has every round, medians over rounds and
per-round ratios fleetgate/LiteLLM and fleetgate_sqlite/fleetgate_sqlite_thread. cpu_ms_per_req: CPU
time of the proxy (and redis-server) per request; upstream_conns_per_req: TCP connections the upstream
accepted per request (0 = pooled keep-alive).

    .venv/bin/python -m bench.bench_policy_proxy [--seconds 5 --rounds 3]
    .venv/bin/python -m bench.bench_policy_proxy --leases --no-litellm --out policy_leases
    .venv/bin/python -m bench.bench_policy_proxy --leases --budget --no-litellm --out policy_leases_budget

Writes bench/results/policy_proxy.json and bench/results/policy_proxy.png (`--out` names them).
`--leases` runs each store under both `state.leases` strategies (the default `leases`, and
`per_request` as `fleetgate_<store>_per_request`, Redis on its own database) in place of the
`?commit=thread` A/B, with ratios of each over the other and over the path with nothing to enforce.
`--budget` gives the policy tenant day and month budgets in USD too (never refusing) and the
deployment a price, so every policy request also reserves its worst case in money and settles its cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from bench import floor_servers
from bench.bench_gateway import RESULTS, start_gateway
from bench.peer_venvs import VENVS, PeerInstallError, ensure_peer_venv
from bench.servers import ROOT

MODEL = "bench-model"
MASTER_KEY = "sk-bench-master"
LITELLM_VENV = VENVS / "litellm"
CONCURRENCY = {1: 1, 16: 2}  # connections -> wrk threads
BODY = json.dumps({"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hi."}]})
TEXT = "Hello from the bench upstream."
USAGE = {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}
HEAD = {"id": "chatcmpl-bench", "created": 1700000000, "model": MODEL}
#: the tenant `bench` of the policy path (YAML under `tenants:`): request, token and concurrency
#: limits, day and month quotas and per-key limits all on, each too high ever to refuse, so every
#: request takes the whole path (bench_hot_routes and bench_hot_path_inprocess use it too)
POLICY_TENANT_YAML = """  bench:
    limits: {requests_per_minute: 10000000, tokens_per_minute: 1000000000, max_concurrency: 100000}
    quotas: {tokens_per_day: 1000000000000, tokens_per_month: 1000000000000,
             requests_per_day: 1000000000000, requests_per_month: 1000000000000}
    key_limits: {requests_per_minute: 10000000, tokens_per_minute: 1000000000}
"""


#: `--budget`: tenant `bench`'s budgets, too high ever to refuse, and a price on the deployment, so
#: that every request of the policy tenant also reserves its worst case in USD and settles its cost
BUDGET_YAML = "    budget: {usd_per_day: 1000000000, usd_per_month: 1000000000}\n"
PRICING_YAML = "     pricing: {input_usd_per_mtok: 0.15, output_usd_per_mtok: 0.60},\n"


def _gateway_yaml(tenant_yaml: str, pricing: bool = False) -> str:
    """The gateway's config as a `str.format` template (port, state, upstream, model to fill), with
    `tenant_yaml` as tenant `bench`'s entry under `tenants:` (`pricing`: the deployment priced)."""
    return (
        """
server: {{port: {port}, log_level: warning}}
state: {{url: "{state}"}}
tenants:
"""
        + tenant_yaml.replace("{", "{{").replace("}", "}}")
        + """deployments:
  upstream:
    {{backend: remote, protocol: openai, url: "http://127.0.0.1:{upstream}", model_name: {model},
"""
        + (PRICING_YAML.replace("{", "{{").replace("}", "}}") if pricing else "")
        + """     queue: {{max_concurrency: 64}}}}
models:
  {model}: {{routes: [{{deployment: upstream}}]}}
"""
    )


GATEWAY_YAML = _gateway_yaml(POLICY_TENANT_YAML)
#: the same gateway with nothing to enforce: tenant `bench` without limits, quotas or key limits (run
#: with state in memory). Beside the others it splits what fleetgate adds into the policy path's
#: share and the rest's (key auth, routing, fair queue, proxying, the call record and metrics).
OPEN_GATEWAY_YAML = _gateway_yaml("  bench: {}\n")
LITELLM_YAML = """
model_list:
  - model_name: {model}
    litellm_params: {{model: openai/{model}, api_base: "http://127.0.0.1:{upstream}/v1", api_key: sk-up}}
general_settings: {{master_key: {key}}}
"""


# --- the upstream (this file run as `--upstream PORT`) ---------------------------------------------


def _http(body: bytes, content_type: str) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _canned() -> tuple[bytes, bytes]:
    """The completion as JSON, and as SSE chunks (text, finish, usage, [DONE]): whole HTTP responses."""
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": TEXT}}
    delta = {"index": 0, "delta": {"role": "assistant", "content": TEXT}, "finish_reason": None}
    finish = {"index": 0, "delta": {}, "finish_reason": "stop"}
    chunks = [{"choices": [delta]}, {"choices": [finish]}, {"choices": [], "usage": USAGE}]
    events = [json.dumps(HEAD | {"object": "chat.completion.chunk"} | c) for c in chunks] + ["[DONE]"]
    whole = HEAD | {"object": "chat.completion", "choices": [choice], "usage": USAGE}
    return (
        _http(json.dumps(whole).encode(), "application/json"),
        _http("".join(f"data: {e}\n\n" for e in events).encode(), "text/event-stream"),
    )


class _Upstream(asyncio.Protocol):
    """Keep-alive HTTP/1.1 with Content-Length bodies; `GET /stats` answers the connections accepted."""

    JSON, SSE = _canned()
    connections = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""
        _Upstream.connections += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            m = re.search(rb"content-length:\s*(\d+)", self.buf[:end], re.IGNORECASE)
            stop = end + 4 + (int(m.group(1)) if m else 0)
            if len(self.buf) < stop:
                return
            head, body, self.buf = self.buf[:end], self.buf[end + 4 : stop], self.buf[stop:]
            if head.startswith(b"GET /stats"):
                self.transport.write(_http(str(self.connections).encode(), "text/plain"))
            else:
                self.transport.write(self.SSE if b'"stream":true' in body.replace(b" ", b"") else self.JSON)


def serve_upstream(port: int) -> None:
    import uvloop

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Upstream, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


def upstream_connections(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /stats HTTP/1.1\r\nHost: upstream\r\n\r\n")
        return int(s.recv(4096).split(b"\r\n\r\n", 1)[1]) - 1  # not counting this probe


# --- starting and stopping the servers -------------------------------------------------------------


@dataclass
class Server:
    name: str
    port: int
    key: str
    pids: list[int] = field(default_factory=list)  # processes whose CPU time counts for this server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def wait_until(
    ok: Callable[[], bool], proc: subprocess.Popen[bytes] | None, what: str, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], group: bool = False) -> None:
    """SIGTERM (to its whole process group when `group`), SIGKILL after 15 s."""
    send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    if proc.poll() is None:
        send(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()


def start_redis(work: Path, stack: ExitStack) -> tuple[str, int]:
    port, pidfile = free_port(), work / "redis.pid"
    subprocess.run(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--daemonize", "yes", "--pidfile", str(pidfile), "--dir", str(work)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    wait_until(lambda: pidfile.exists() and port_open(port), None, "redis-server", 10)
    pid = int(pidfile.read_text())
    stack.callback(os.kill, pid, signal.SIGTERM)
    return f"redis://127.0.0.1:{port}/0", pid


def start_litellm(work: Path, upstream: int, stack: ExitStack) -> Server:
    """LiteLLM proxy from its own virtualenv (its pins must not touch the project's), made on first use."""
    try:
        ensure_peer_venv("litellm", ["litellm[proxy]"])
    except PeerInstallError as exc:
        sys.exit(str(exc))
    config, port, log = work / "litellm.yaml", free_port(), work / "litellm.log"
    config.write_text(LITELLM_YAML.format(model=MODEL, upstream=upstream, key=MASTER_KEY))
    # a local cost map (no fetch at start-up); LITELLM_LOG=ERROR also turns off uvicorn's access log
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    args = ["--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    proc = subprocess.Popen(
        [str(LITELLM_VENV / "bin" / "litellm"), *args], env=env, cwd=work, start_new_session=True,
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    stack.callback(stop, proc, True)

    try:  # uvicorn listens once the app's start-up is done
        wait_until(lambda: port_open(port), proc, "litellm", 180)
    except RuntimeError:
        raise RuntimeError(f"litellm did not start: {log.read_text()[-2000:]}") from None
    return Server("litellm", port, MASTER_KEY, [proc.pid])


def _suffix(strategy: str, both: bool) -> str:
    return "_per_request" if both and strategy == "per_request" else ""


def start_bare_proxy(work: Path, upstream: int, stack: ExitStack) -> Server:
    """bench/floor_servers.py's bare proxy in front of the upstream: the server stack's own floor."""
    args = ["proxy", "--upstream", f"http://127.0.0.1:{upstream}"]
    port, pid = floor_servers.start(args, work / "bare-proxy.log", stack)
    return Server("bare_proxy", port, "none", [pid])


def check_answer(server: Server) -> None:
    """One request through `server` must come back 200 with the upstream's text."""
    import httpx

    r = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/chat/completions", content=BODY, timeout=30,
        headers={"Authorization": f"Bearer {server.key}", "Content-Type": "application/json"},
    )  # fmt: skip
    if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] != TEXT:
        raise RuntimeError(f"{server.name} answered {r.status_code}: {r.text[:300]}")


def start_all(
    work: Path, stack: ExitStack, notes: list[str], leases: bool = False, litellm: bool = True, budget: bool = False
) -> list[Server]:
    policy_yaml = _gateway_yaml(POLICY_TENANT_YAML + BUDGET_YAML, pricing=True) if budget else GATEWAY_YAML
    open_yaml = _gateway_yaml("  bench: {}\n", pricing=True) if budget else OPEN_GATEWAY_YAML
    up_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_policy_proxy", "--upstream", str(up_port)], cwd=ROOT
    )
    stack.callback(stop, upstream)
    wait_until(lambda: port_open(up_port), upstream, "upstream", 10)
    servers = [Server("upstream", up_port, "none", [upstream.pid]), start_bare_proxy(work, up_port, stack)]
    # --leases: each store under both strategies (state.leases), per_request named with its suffix
    strategies = ["leases", "per_request"] if leases else ["leases"]
    stores = [(f"fleetgate_sqlite{_suffix(st, leases)}", f"sqlite:///{work / f'state-{st}.db'}", [], policy_yaml, st)
              for st in strategies]  # fmt: skip
    if not leases:
        url = f"sqlite:///{work / 'state-thread.db'}?commit=thread"
        stores.append(("fleetgate_sqlite_thread", url, [], policy_yaml, "leases"))
    if shutil.which("redis-server"):
        url, redis_pid = start_redis(work, stack)
        stores += [(f"fleetgate_redis{_suffix(st, leases)}", url.replace("/0", f"/{i}"), [redis_pid], policy_yaml, st)
                   for i, st in enumerate(strategies)]  # fmt: skip
    else:
        notes.append("fleetgate_redis skipped: redis-server not on PATH")
    stores.append(("fleetgate_no_policy", "memory://", [], open_yaml, "leases"))
    for name, url, extra, yaml, strategy in stores:
        fill = dict(state=url, upstream=up_port, model=MODEL)
        yaml = yaml.replace('state: {{url: "{state}"}}', f'state: {{{{url: "{{state}}", leases: {{{{strategy: {strategy}}}}}}}}}')
        proc, port, key = start_gateway(work, lambda p, fill=fill, yaml=yaml: yaml.format(port=p, **fill))
        stack.callback(stop, proc)
        servers.append(Server(name, port, key, [proc.pid, *extra]))
    try:
        if litellm:
            servers.append(start_litellm(work, up_port, stack))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        notes.append(f"litellm skipped: {exc}")
    for s in servers:
        check_answer(s)
    return servers


# --- load with wrk ---------------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of each process, from /proc."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def parse_wrk(out: str) -> dict[str, float]:
    unit_ms = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}
    lat = {
        q: float(v) * unit_ms[u]
        for q, v, u in re.findall(r"^\s+(50|99)(?:\.0+)?%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
    }
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),  # type: ignore[union-attr]
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50_ms": lat["50"],
        "p99_ms": lat["99"],
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": sum(int(g) for g in sock.groups()) if sock else 0,
    }


def run_wrk(server: Server, conns: int, seconds: float, work: Path, upstream: int) -> dict[str, float]:
    script = work / f"wrk-{server.name}.lua"
    script.write_text(
        f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY)}\nwrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {server.key}"\n'
    )
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    cmd = ["wrk", f"-t{CONCURRENCY[conns]}", f"-c{conns}", "--timeout", "10s", "-s", str(script), url]
    subprocess.run([*cmd, "-d1s"], check=True, capture_output=True)  # warm-up
    cpu0, conn0 = cpu_seconds(server.pids), upstream_connections(upstream)
    r = parse_wrk(subprocess.run([*cmd, f"-d{seconds:g}s", "--latency"], check=True, capture_output=True, text=True).stdout)  # fmt: skip
    n = max(r["requests"], 1)
    r["cpu_ms_per_req"] = (cpu_seconds(server.pids) - cpu0) * 1e3 / n
    r["upstream_conns_per_req"] = (upstream_connections(upstream) - 1 - conn0) / n  # -1: the first probe
    return r


def run_round(work: Path, servers: list[Server], index: int, seconds: float) -> dict[str, dict[str, dict]]:
    shift = index % len(servers)
    up = servers[0].port
    points = {
        s.name: {f"c{c}": run_wrk(s, c, seconds, work, up) for c in CONCURRENCY}
        for s in servers[shift:] + servers[:shift]
    }
    for name, per_c in points.items():
        for c, r in per_c.items():
            r["added_p50_ms"] = r["p50_ms"] - points["upstream"][c]["p50_ms"]
            print(f"round {index} {name:16s} {c:3s} rps={r['rps']:8.1f} p50={r['p50_ms']:7.3f}ms "
                  f"added={r['added_p50_ms']:7.3f}ms p99={r['p99_ms']:7.2f}ms non2xx={r['non_2xx']}", flush=True)  # fmt: skip
    return points


# --- report ----------------------------------------------------------------------------------------


def summarize(rounds: list[dict[str, dict[str, dict]]]) -> tuple[dict, dict]:
    """Medians over rounds (error counts: totals) and per-round ratios: each fleetgate over LiteLLM, and
    the default SQLite commit over `?commit=thread`."""
    medians = {
        name: {c: {k: statistics.median(r[name][c][k] for r in rounds) for k in first} for c, first in per_c.items()}
        for name, per_c in rounds[0].items()
    }  # fmt: skip
    for name, per_c in medians.items():
        for c, m in per_c.items():
            m["non_2xx"] = sum(r[name][c]["non_2xx"] for r in rounds)
            m["socket_errors"] = sum(r[name][c]["socket_errors"] for r in rounds)
    ratios: dict[str, dict] = {}
    pairs = [(n, "litellm") for n in rounds[0] if n.startswith("fleetgate")] if "litellm" in rounds[0] else []
    if "fleetgate_sqlite_thread" in rounds[0]:  # where SQLite groups commit: the default over ?commit=thread
        pairs.append(("fleetgate_sqlite", "fleetgate_sqlite_thread"))
    if "bare_proxy" in rounds[0]:  # each fleetgate over the bare server stack's floor
        pairs += [(n, "bare_proxy") for n in rounds[0] if n.startswith("fleetgate")]
    for n in [n for n in rounds[0] if n.endswith("_per_request")]:  # leases over per request, same store
        pairs.append((n.removesuffix("_per_request"), n))
    if "fleetgate_no_policy" in rounds[0]:  # each policy gateway over the path with nothing to enforce
        pairs += [(n, "fleetgate_no_policy") for n in rounds[0] if n.startswith("fleetgate_") and n != "fleetgate_no_policy"]
    for name, base in pairs:
        for c in rounds[0][name]:
            for metric in ("rps", "added_p50_ms", "cpu_ms_per_req"):
                per_round = [r[name][c][metric] / r[base][c][metric] for r in rounds]
                key = f"{name}_over_{base.removeprefix('fleetgate_sqlite_')}_{metric}_{c}"
                ratios[key] = {
                    "per_round": [round(x, 3) for x in per_round],
                    "median": round(statistics.median(per_round), 3),
                }
    return medians, ratios


def plot(medians: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    conc = list(medians["upstream"])
    width = 0.8 / len(medians)
    for i, (name, per_c) in enumerate(medians.items()):
        xs = [j + i * width for j in range(len(conc))]
        for ax, metric in zip(axes, ("rps", "added_p50_ms"), strict=True):
            if metric == "rps" or name != "upstream":
                bars = ax.bar(xs, [per_c[c][metric] for c in conc], width, label=name, color=f"C{i}")
                ax.bar_label(bars, fmt="%.3g", fontsize=7)
    for ax, title in zip(axes, ("requests/s", "added p50 over the upstream (ms)"), strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(conc))], conc)
        ax.set(title=f"{title} (log scale)", yscale="log")
        ax.legend(fontsize=8)
    fig.suptitle("OpenAI chat completions through the tenant policy path (wrk, medians over rounds)")
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine

    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)  # internal: be the upstream
    parser.add_argument("--leases", action="store_true", help="each store with state.leases leases and per_request")
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out")
    parser.add_argument(
        "--budget", action="store_true", help="the policy tenant with budgets in USD too, the deployment priced"
    )
    parser.add_argument("--out", default="policy_proxy", help="results name under bench/results (.json, .png)")
    args = parser.parse_args()
    if args.upstream:
        return serve_upstream(args.upstream)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the cleanup below runs
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        servers = start_all(Path(tmp), stack, notes, leases=args.leases, litellm=not args.no_litellm, budget=args.budget)
        rounds = [run_round(Path(tmp), servers, i, args.seconds) for i in range(args.rounds)]
    medians, ratios = summarize(rounds)
    notes += [
        "litellm runs with a master key only: its virtual keys and per-key limits need Postgres through "
        "Prisma, and `prisma generate` downloads the Prisma engines from binaries.prisma.sh, which these "
        "machines cannot reach (ENOTFOUND); so litellm does one key compare, no limits, no accounting",
        "both ask the upstream for one JSON completion (the body does not ask for a stream)",
        *(["--budget: tenant bench also has day and month budgets in USD (never refusing) and the deployment "
           "a price, on every fleetgate gateway (fleetgate_no_policy: priced, no budget)"] if args.budget else []),
    ]
    if not args.leases:
        notes.append(
            "fleetgate_sqlite commits each group of store operations on the event loop (the default); "
            "fleetgate_sqlite_thread is the same gateway with `?commit=thread`: groups commit on the store's thread"
        )
    notes += [
        f"{name} opened {m['upstream_conns_per_req']:.2f} new upstream connections per request at {c}"
        for name, per_c in medians.items() for c, m in per_c.items() if m["upstream_conns_per_req"] > 0.1
    ]  # fmt: skip
    dist = next(LITELLM_VENV.glob("lib/python*/site-packages/litellm-*.dist-info"), None)
    report = {
        "benchmark": "bench_policy_proxy",
        "what": (__doc__ or "").split("\n\n")[0],
        "seconds_per_point": args.seconds,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"litellm": dist.name[len("litellm-") : -len(".dist-info")] if dist else None},
        "body": json.loads(BODY),
        "points": medians,
        "ratios": ratios,
        "per_round": rounds,
        "notes": notes,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(medians, RESULTS / f"{args.out}.png")
    print(json.dumps({k: v["median"] for k, v in ratios.items()}, indent=1))


if __name__ == "__main__":
    main()
