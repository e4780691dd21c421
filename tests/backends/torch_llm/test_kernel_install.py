"""The engine's C++ CPU kernels are built once per install and only loaded while serving: an engine
never compiles (missing kernels fall back with a warning naming `fleetgate build-kernels`), a built
kernel loads in a fresh process without the compiler being called, the library's key covers what
it was built for, and the build reports each kernel without stopping at a failure."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
import structlog

torch = pytest.importorskip("torch")
cpp_extension = pytest.importorskip("torch.utils.cpp_extension")

from backends.base import SamplingParams  # noqa: E402
from backends.torch_llm.kernels import attention_cpu, blocked_linear, build_kernels, cpu_extension, fused_cpu  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for, make_prompts, run_engine  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
LOADERS = ((attention_cpu, "load_kernel"), (fused_cpu, "load_kernels"), (blocked_linear, "load_kernel"))
EVENTS = ("llm_attention_fallback", "llm_fused_ops_fallback", "llm_blocked_linear_fallback")


def _compiling(*_: object, **__: object) -> None:
    raise AssertionError("a kernel was compiled while serving")


@pytest.fixture
def fresh_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel loaders' per-process caches emptied (and emptied again after the test)."""
    for module, name in LOADERS:
        getattr(module, name).cache_clear()
    yield
    for module, name in LOADERS:
        getattr(module, name).cache_clear()


def test_an_engine_never_compiles_and_names_the_build_command(
    llama_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fresh_loaders: None
) -> None:
    # an install whose kernels were never built, on a machine that has a compiler
    monkeypatch.setattr(cpu_extension, "kernels_dir", lambda: tmp_path / "kernels")
    monkeypatch.setattr(cpp_extension, "load_inline", _compiling)
    with structlog.testing.capture_logs() as logs:
        engine = engine_for(llama_dir)
        out = run_engine(engine, make_prompts(2, seed=3), SamplingParams(max_tokens=3, temperature=0.0))
    assert all(len(tokens) == 3 for tokens in out.values())
    assert engine.runner.attention.name == "torch" and engine.runner.model.fused_ops is None
    for event in EVENTS:
        warnings = [e for e in logs if e["event"] == event]
        assert len(warnings) == 1, (event, logs)
        assert "not built for this install" in warnings[0]["reason"], warnings[0]
        assert "fleetgate build-kernels" in warnings[0]["reason"], warnings[0]
    assert not (tmp_path / "kernels").exists(), "serving wrote into the kernel directory"


def test_a_built_kernel_loads_in_a_fresh_process_without_the_compiler() -> None:
    if any(not kernel.library().is_file() for kernel in build_kernels.KERNELS):
        pytest.skip("this install's kernels are not built (`fleetgate build-kernels`; no compiler here?)")
    # the whole engine start-up in a new process whose compiler entry point fails if called
    script = textwrap.dedent(
        """
        import torch.utils.cpp_extension as ext

        def compiling(*a, **k):
            raise AssertionError("compiled while serving")

        ext.load_inline = ext.load = compiling
        from backends.torch_llm.kernels import attention_cpu, blocked_linear, fused_cpu

        assert attention_cpu.load_kernel().paged_decode
        assert fused_cpu.cpu_kernels_or_none(torch.float32) is not None
        assert blocked_linear.kernel_or_none() is not None
        print("loaded")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", "import torch\n" + script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-2000:]


def test_the_library_key_covers_torch_python_cpu_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = attention_cpu.KERNEL
    name = kernel.name()
    assert name.startswith("fleetgate_paged_decode_")
    assert kernel.library().parent == pathlib.Path(sys.prefix) / "share" / "fleetgate" / "kernels"
    other_flags = cpu_extension.CpuKernel(kernel.prefix, kernel.source, kernel.functions, ("-O2",))
    assert other_flags.name() != name
    monkeypatch.setattr(cpu_extension, "cpu_model", lambda: "Another CPU @ 1.0GHz")
    assert kernel.name() != name
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert kernel.name() != name
    monkeypatch.undo()
    monkeypatch.setattr(sys, "version", "3.99.0")
    assert kernel.name() != name
    monkeypatch.undo()
    assert kernel.name() == name


def test_build_all_keeps_what_is_built_and_reports_each_failure(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    present = attention_cpu.KERNEL.library(tmp_path)
    present.write_bytes(b"built before")

    def no_compiler(*_: object, **__: object) -> None:
        raise RuntimeError("Error building extension 'x':\nsome output\nc++: command not found")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    results = build_kernels.build_all(tmp_path)
    assert [(r.prefix, r.outcome) for r in results] == [
        ("fleetgate_paged_decode", "present"),
        ("fleetgate_fused_ops", "failed"),
        ("fleetgate_blocked_linear", "failed"),
    ]
    assert present.read_bytes() == b"built before"
    assert all("c++: command not found" in r.error for r in results[1:])
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".so") == [present.name]
    with pytest.raises(cpu_extension.KernelNotBuilt, match="fleetgate build-kernels"):
        cpu_extension.load_built(fused_cpu.KERNEL, tmp_path)
