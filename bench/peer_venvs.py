"""Peers' own virtualenvs under bench/.venvs/<name>, made on first use (their pins never touch the
project's environment).

`ensure_peer_venv(name, *steps, remove=...)`: each step is one `pip install` of a list of
requirements, or a tuple of such lists tried in order until one installs (e.g. the project's exact
ONNX Runtime version first, any version where no wheel of it exists); `remove` is uninstalled at the
end (a package the peer brings but that breaks it here). The venv is made anew unless an earlier
install of the same steps finished: the `.installed` mark holds them, so a changed pin rebuilds it.
pip's output goes to bench/.venvs/<name>-install.log; a failed step raises `PeerInstallError` naming
the log (a bench with several peers skips that one; one with a single peer stops with it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

VENVS = Path(__file__).resolve().parent / ".venvs"

Requirements = Sequence[str]


class PeerInstallError(RuntimeError):
    """A peer's virtualenv could not be made; the message names what failed and the log."""


def ensure_peer_venv(
    name: str, *steps: Requirements | tuple[Requirements, ...], remove: Sequence[str] = ()
) -> Path:
    """bench/.venvs/<name> with `steps` installed (see the module docstring); returns its path."""
    venv = VENVS / name
    mark = venv / ".installed"
    spec = json.dumps({"steps": steps, "remove": remove})
    if mark.exists() and mark.read_text() == spec:
        return venv
    VENVS.mkdir(parents=True, exist_ok=True)
    log = VENVS / f"{name}-install.log"
    sys.stderr.write(f"installing {name} into {venv} (a few minutes; log: {log})\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    with log.open("wb") as out:

        def run(command: list[str]) -> bool:
            return subprocess.run(command, stdout=out, stderr=out).returncode == 0

        # --clear: a half-built or older venv is made anew, not patched
        if not (
            run(["python3", "-m", "venv", "--clear", str(venv)]) and run([*pip, "install", "-q", "-U", "pip"])
        ):
            raise PeerInstallError(f"could not make the {name} virtualenv; see {log}")
        for step in steps:
            choices = step if isinstance(step, tuple) else (step,)
            if not any(run([*pip, "install", "-q", *requirements]) for requirements in choices):
                raise PeerInstallError(
                    f"could not install {' or '.join(map(' '.join, choices))} for {name}; see {log}"
                )
        if remove and not run([*pip, "uninstall", "-q", "-y", *remove]):
            raise PeerInstallError(f"could not remove {' '.join(remove)} from {name}; see {log}")
    mark.write_text(spec)
    return venv
