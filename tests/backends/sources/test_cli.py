"""`fleetgate pull`, `fleetgate cache ls|rm` and `check-config` on model addresses, run as a user
runs them; a pull killed midway (SIGKILL) resumes where it stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.serve.cli import main
from tests.backends.sources.stores import Store

WEIGHTS = os.urandom(1_500_000)


def _repo(store: Store, tmp_path: Path) -> None:
    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.onnx").write_bytes(WEIGHTS)
    store.add_repo("acme/m", folder)


def _config(tmp_path: Path, model: str, **storage: str) -> Path:
    extra = "".join(f", {k}: {v}" for k, v in storage.items())
    path = tmp_path / "fleet.yaml"
    path.write_text(
        f'storage: {{cache_dir: "{tmp_path / "cache"}"{extra}}}\n'
        f'deployments: {{m: {{backend: onnxruntime, model: "{model}"}}}}\n'
        "models: {m: {routes: [{deployment: m}]}}\n"
    )
    return path


def test_pull_then_ls_then_rm(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _repo(store, tmp_path)
    config = _config(tmp_path, "hf://acme/m/model.onnx")
    assert main(["pull", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith(f"hf://acme/m/model.onnx -> {tmp_path / 'cache' / 'snapshots'}")
    assert out.splitlines()[0].endswith(f"/model.onnx ({store.repos['acme/m'].commit})")  # the commit served
    # not a terminal: periodic lines, one when each file starts and ends
    assert "fleetgate pull: fetching hf://acme/m/model.onnx model.onnx: 0.0 of 1.5 MB (0%)" in err
    assert "fleetgate pull: done hf://acme/m/model.onnx model.onnx: 1.5 of 1.5 MB (100%)" in err
    assert main(["pull", "--config", str(config)]) == 0 and store.served.file_gets == 1
    capsys.readouterr()
    assert main(["cache", "ls", "--config", str(config)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith("hf://acme/m/model.onnx\t") and "1 files\t1.5 MB" in listed[0]
    assert listed[-1].startswith("1 cached models, 1.5 MB in")
    assert main(["cache", "rm", "--dir", str(tmp_path / "cache"), "hf://acme/nope"]) == 2
    assert "cache rm: not in" in capsys.readouterr().err
    assert main(["cache", "rm", "--dir", str(tmp_path / "cache"), "hf://acme/m/model.onnx"]) == 0
    assert capsys.readouterr().out == "removed 1 cached models, 1.5 MB freed\n"
    assert not list((tmp_path / "cache" / "blobs").iterdir())


def test_check_config_resolves_without_downloading(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _repo(store, tmp_path)
    # a check that passes builds the app: in a process of its own, as the other check-config tests
    # do (building it in process under capsys once openvino is imported closes pytest's stderr)
    command = [sys.executable, "-m", "gateway.serve.cli", "check-config", str(_config(tmp_path, "hf://acme/m/model.onnx"))]
    done = subprocess.run(command, env={**os.environ, "HF_ENDPOINT": store.url}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    commit = store.repos["acme/m"].commit
    assert f"hf://acme/m/model.onnx -> {commit} (1 files, 1.5 MB)" in done.stdout
    assert store.served.file_gets == 0
    for model, message in (
        ("hf://acme/absent", "repository acme/absent not found at"),
        ("hf://acme/m@v2", "revision v2 not found in acme/m"),
        ("acme/m", "model file acme/m does not exist; for the Hugging Face repository write hf://acme/m"),
        ("models/m.onnx", "does not exist - at"),  # a missing file, not a repository: no hint
    ):
        assert main(["check-config", str(_config(tmp_path, model))]) == 2
        # one line (stderr may also hold log lines of HTTP clients other tests turned on)
        [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fleetgate:")]
        assert message in line and line.endswith("- at `$.deployments.m.model`"), line


def test_offline_check_config_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(_config(tmp_path, "hf://acme/m", offline="true"))]) == 2
    err = capsys.readouterr().err
    assert "hf://acme/m is not in the model cache" in err and "fleetgate pull --config CFG" in err


def test_a_pull_killed_midway_resumes(store: Store, tmp_path: Path) -> None:
    _repo(store, tmp_path)
    store.served.pace_s = 0.02  # ~3 MB/s: the 1.5 MB file takes about half a second
    config = _config(tmp_path, "hf://acme/m/model.onnx")
    env = {**os.environ, "HF_ENDPOINT": store.url}
    pull = [sys.executable, "-m", "gateway.serve.cli", "pull", "--config", str(config)]
    first = subprocess.Popen(pull, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts = tmp_path / "cache" / "partial"
    deadline = time.monotonic() + 60
    while not (parts.is_dir() and any(p.stat().st_size > 200_000 for p in parts.iterdir())):
        assert time.monotonic() < deadline and first.poll() is None, "the pull ended before it could be killed"
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    kept = sum(p.stat().st_size for p in parts.iterdir())
    assert 0 < kept < len(WEIGHTS)
    assert not (tmp_path / "cache" / "manifests").exists() or not list((tmp_path / "cache" / "manifests").iterdir())
    store.served.pace_s = 0.0
    second = subprocess.run(pull, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "fleetgate pull: resuming hf://acme/m/model.onnx model.onnx" in second.stderr
    snapshot = Path(second.stdout.split(" -> ")[1].split("\n")[0].rsplit(" (", 1)[0])  # "-> PATH (REVISION)"
    assert snapshot.read_bytes() == WEIGHTS
    # the second pull asked for the rest only (the killed one may have sent a little more than it kept)
    assert store.served.file_bytes < 2 * len(WEIGHTS) - kept + 200_000
