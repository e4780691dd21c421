"""What `make run` and `make test` would do (`make -n`, nothing executed): `make run` installs what
serving needs (no test tools) and builds the engine's kernels before serving, keeps one demo key in
var/demo-key and an admin key in var/admin-key and prints the console's address; `make test` after
`make run` adds only the test tools."""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_n(target: str, venv: pathlib.Path) -> list[str]:
    done = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def pip_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line]


def test_make_run_installs_serving_only_and_builds_kernels_before_serving(tmp_path: pathlib.Path) -> None:
    lines = make_n("run", tmp_path / "venv")
    installs = pip_installs(lines)
    assert any("-e '.[all]'" in line for line in installs), installs
    assert not any("dev" in line for line in installs), installs
    build = next(i for i, line in enumerate(lines) if "fleetgate build-kernels" in line)
    serve = next(i for i, line in enumerate(lines) if "fleetgate serve" in line)
    assert build < serve
    text = "\n".join(lines)
    assert "--secret-file var/demo-key" in text and "var/admin-key" in text and "umask 077" in text
    assert "FLEETGATE_ADMIN_KEY" in text and "/admin/ui" in text and "/metrics" in text


def test_make_test_after_make_run_adds_only_the_test_tools(tmp_path: pathlib.Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    key = hashlib.sha1((ROOT / "pyproject.toml").read_bytes() + (ROOT / "Makefile").read_bytes()).hexdigest()
    (venv / f".installed-{key[:10]}").touch()  # what `make run` left
    installs = pip_installs(make_n("test", venv))
    assert installs == [f"{venv}/bin/python -m pip install -q -e '.[all,dev]'"], installs
    lines = make_n("test", venv)
    assert any("fleetgate build-kernels" in line for line in lines)
    assert not any("load_kernel" in line for line in lines), "kernels are built by the install's command"
