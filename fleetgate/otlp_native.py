"""The C span encoder (`otlp_native.c`), compiled at first use with the system's C compiler.

Encoding was the largest part of tracing's cost in a serving gateway (about 60 % of it at c=16,
`bench/bench_tracing.py`): the Python encoder takes ~5 us a span on this project's 2-core CPU, the C
one well under one, for the same bytes (the tests compare them). The library is built once per
source version and Python version into `$XDG_CACHE_HOME/fleetgate` (`~/.cache/fleetgate`), written
under a temporary name and renamed, so workers starting together do not read half a file; a cached
file that does not load is built again.

`load()` returns the module, or None when there is no compiler, the build fails, or
`FLEETGATE_OTLP_NATIVE=0` turns it off; the reason is logged once and the Python encoder serves.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import structlog

log = structlog.get_logger("fleetgate.tracing")

SOURCE = Path(__file__).with_name("otlp_native.c")
#: included by SOURCE (one translation unit): the span type (`Span`, `child`) tracing.py uses
INCLUDED = (Path(__file__).with_name("span_native.h"),)
_BUILD_TIMEOUT_S = 120


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fleetgate"


@functools.cache
def load() -> ModuleType | None:
    """The compiled encoder module, or None (logged) when it cannot be had."""
    if os.environ.get("FLEETGATE_OTLP_NATIVE", "1") == "0":
        log.info("otlp_native_encoder_off", reason="FLEETGATE_OTLP_NATIVE=0")
        return None
    try:
        return _build_and_import()
    except Exception as exc:  # noqa: BLE001 - no compiler, a build error: the Python encoder serves
        log.warning("otlp_native_encoder_unavailable", reason=str(exc)[:500])
        return None


def library_path() -> tuple[str, Path]:
    """The module's name and its library's path for this source, Python and platform."""
    source = SOURCE.read_bytes() + b"".join(path.read_bytes() for path in INCLUDED)
    key = hashlib.sha256(source + sys.version.encode() + sysconfig.get_platform().encode()).hexdigest()[:12]
    name = f"fleetgate_otlp_{key}"
    return name, cache_dir() / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def _build_and_import() -> ModuleType:
    name, library = library_path()
    if not library.is_file():
        _compile(name, library)
        return _import(name, library)
    try:
        return _import(name, library)
    except (ImportError, OSError):  # a cached file that does not load (cut short, other libc): rebuild
        _compile(name, library)
        return _import(name, library)


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(name: str, library: Path) -> None:
    found = shutil.which("cc") or shutil.which("gcc")
    compiler = shlex.split(os.environ["CC"]) if os.environ.get("CC") else [found] if found else None
    if not compiler:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    library.parent.mkdir(parents=True, exist_ok=True)
    include = sysconfig.get_paths()["include"]
    with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so.tmp", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        command = [
            *compiler, "-O2", "-shared", "-fPIC", "-I", include,
            f'-DMODULE_NAME="{name}"', f"-DMODULE_SYMBOL={name}",
            str(SOURCE), "-o", str(partial),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed: {done.stderr.strip()[-400:]}")
        partial.chmod(0o755)  # the temporary file was created 0600: others sharing the cache load it too
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
