"""Config files: every mistake is refused with one line naming the path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config
from gateway.http.app import create_app


def _parse(text: str, tmp_path: Path, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return parse_config(text, base_dir=tmp_path, env=env or {})


GOOD = """
deployments:
  a: {{backend: onnxruntime, model: {model}}}
  b: {{backend: onnxruntime, model: {model}}}
models:
  m:
    routes: [{{deployment: a, weight: 90}}, {{deployment: b, weight: 10}}]
"""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"not really onnx")
    return path


def test_good_config_parses_and_resolves_relative_paths(tmp_path, model):
    text = GOOD.format(model="m.onnx") + 'state: {url: "sqlite:///var/x.db"}\n'
    config = _parse(text, tmp_path)
    assert config.deployments["a"].model == str(model)
    assert config.state.url == f"sqlite:///{tmp_path}/var/x.db"
    assert config.server.port == 8000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server: {port: '80'}", "Expected `int`, got `str` - at `$.server.port`"),
        ("server: {prot: 80}", "unknown field `prot` - at `$.server`"),
        ("server: {port: 70000}", "port must be in 0..65535 - at `$.server`"),
        ("state: {url: 'postgres://x'}", "url must start with"),
        ("deployments: {a: {backend: magic}}", "at `$.deployments.a.backend`"),
        (
            "deployments: {a: {backend: onnxruntime, model: nope.onnx}}",
            "does not exist - at `$.deployments.a.model`",
        ),
        (
            "models: {m: {routes: [{deployment: ghost}]}}",
            "unknown deployment 'ghost' - at `$.models.m.routes[0].deployment`",
        ),
        ("tenants: {t: {weight: -1}}", "at `$.tenants.t`"),
        ("tenants: {t: {limits: {requests_per_minute: 0}}}", "requests_per_minute"),
        ("server: [1, 2]", "Expected `object`, got `array` - at `$.server`"),
        ("server: {host: '${NOPE}'}", "environment variable NOPE is not set - at `$.server.host`"),
        ("a: [unclosed", "invalid YAML at line 1"),
        ("- just a list", "the config must be a mapping"),
    ],
)
def test_bad_config_names_the_path(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        _parse(text, tmp_path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


REMOTES = (
    'deployments: {a: {backend: remote, url: "http://x", protocol: kserve_v2},'
    ' c: {backend: remote, url: "http://y", protocol: kserve_v2}}\n'
)
CANARY = (
    "models: {{m: {{routes: [{{deployment: a, weight: 90}}, {{deployment: c, weight: 10, canary: {}}}]}}}}"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "models: {m: {routes: [{deployment: a, weight: .nan}]}}",
            "weight must be a finite number >= 0 - at `$.models.m.routes[0]`",
        ),
        (
            "models: {m: {routes: [{deployment: a, weight: .inf}]}}",
            "weight must be a finite number >= 0 - at `$.models.m.routes[0]`",
        ),
        (
            "models: {m: {routes: [{deployment: a, weight: 0}]}}",
            "no route of the model has a positive weight - at `$.models.m.routes`",
        ),
        (
            "models: {m: {routes: [{deployment: a, weight: 0}, {deployment: c, weight: 100}],"
            " shadow: {deployment: c}}}",
            "no route of the model has a positive weight - at `$.models.m.routes`",
        ),
        (
            CANARY.format("{window_s: .inf}"),
            "window_s must be a finite number > 0 - at `$.models.m.routes[1].canary`",
        ),
        (
            CANARY.format("{window_s: .nan}"),
            "window_s must be a finite number > 0 - at `$.models.m.routes[1].canary`",
        ),
        (
            CANARY.format("{max_latency_ratio: .nan}"),
            "max_latency_ratio must be a finite number > 1 - at `$.models.m.routes[1].canary`",
        ),
        (
            CANARY.format("{max_latency_ratio: .inf}"),
            "max_latency_ratio must be a finite number > 1 - at `$.models.m.routes[1].canary`",
        ),
        (
            CANARY.format("{max_error_rate: .nan}"),
            "max_error_rate must be in 0..1 - at `$.models.m.routes[1].canary`",
        ),
        ("breakers: {cooldown_s: .nan}", "cooldown_s must be a finite number > 0 - at `$.breakers`"),
        ("breakers: {cooldown_s: .inf}", "cooldown_s must be a finite number > 0 - at `$.breakers`"),
        (
            "server: {request_timeout_s: .nan}",
            "request_timeout_s must be a finite number > 0 - at `$.server`",
        ),
    ],
)
def test_non_finite_numbers_and_weightless_models_are_refused(tmp_path, text, message):
    """NaN passes every `x <= 0` check, and a model whose routes all weigh 0 would fail each request."""
    with pytest.raises(ConfigError) as info:
        _parse(REMOTES + text, tmp_path)
    assert str(info.value) == message


def test_weights_must_add_up(tmp_path, model):
    text = GOOD.format(model=model).replace("weight: 10", "weight: 20")
    with pytest.raises(ConfigError, match=r"route weights add up to 110, not 100 - at `\$.models.m.routes`"):
        _parse(text, tmp_path)


def test_env_interpolation(tmp_path):
    config = _parse("server: {host: '${HOST}'}", tmp_path, env={"HOST": "0.0.0.0"})
    assert config.server.host == "0.0.0.0"


def test_backend_options_are_checked_by_create_app(tmp_path, model):
    text = f"deployments: {{a: {{backend: onnxruntime, model: {model}, options: {{threads: 2}}}}}}"
    config = _parse(text, tmp_path)
    with pytest.raises(ConfigError, match=r"options: .*threads.* - at `\$.deployments.a`"):
        create_app(config)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")


def test_check_config_cli_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {port: '80'}\n")
    out = subprocess.run(
        [sys.executable, "-m", "gateway.serve.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "fleetgate: Expected `int`, got `str` - at `$.server.port`"
    assert "Traceback" not in out.stderr


def test_demo_configs_are_valid(tmp_path):
    """The shipped configs parse (model files aside, which `make run` builds)."""
    for path in Path("configs").glob("*.yaml"):
        try:
            load_config(path, env={"EDGE1_KEY": "x", "FLEETGATE_ADMIN_KEY": "x"})
        except ConfigError as exc:
            assert "does not exist" in str(exc), f"{path}: {exc}"


def test_grpc_port_follows_the_http_port(tmp_path):
    assert _parse("server: {port: 9000}", tmp_path, env={}).server.grpc_listen_port == 9001
    assert _parse("server: {port: 0}", tmp_path, env={}).server.grpc_listen_port == 0  # both ephemeral
    assert _parse("server: {port: 9000, grpc_port: null}", tmp_path, env={}).server.grpc_listen_port is None
    assert _parse("server: {port: 9000}", tmp_path, env={"FLEETGATE_GRPC_PORT": "off"}).server.grpc_listen_port is None
    with pytest.raises(ConfigError, match="grpc_port must differ from port"):
        _parse("server: {port: 9000, grpc_port: 9000}", tmp_path, env={})


@pytest.mark.parametrize(
    ("deployment", "message"),
    [
        (
            "{backend: onnxruntime, model: m.onnx, providers: [CPUExecutionProvider, CUDAProvider]}",
            "unknown ONNX Runtime execution provider 'CUDAProvider' (did you mean 'CUDAExecutionProvider'?); "
            "known: ",
        ),
        ("{backend: openvino, model: m.onnx, device: cpu}", "unknown OpenVINO device 'cpu': use CPU, GPU, GPU.N, NPU"),
        ("{backend: openvino, model: m.onnx, device: 'HETERO:GPU,TPU'}", "unknown OpenVINO device 'HETERO:GPU,TPU'"),
        ("{backend: torch_llm, model: m.onnx, device: gpu}", "unknown torch_llm device 'gpu': use cpu, cuda, cuda:N"),
        ("{backend: torch_llm, model: m.onnx, device: 'cuda:x'}", "unknown torch_llm device 'cuda:x'"),
        ("{backend: onnxruntime, model: m.onnx, device: tpu}", "unknown onnxruntime device 'tpu': use cpu, cuda"),
    ],
)
def test_unknown_devices_and_providers_name_the_path_and_the_choices(tmp_path, model, deployment, message):
    with pytest.raises(ConfigError) as info:
        _parse(f"deployments:\n  d: {deployment}\n", tmp_path)
    text = str(info.value)
    assert message in text and "\n" not in text
    field = "providers[1]" if "providers" in deployment else "device"
    assert text.endswith(f" - at `$.deployments.d.{field}`")
    if "providers" in deployment:  # every valid name is listed
        import onnxruntime

        assert all(p in text for p in onnxruntime.get_all_providers())


@pytest.mark.parametrize(
    ("backend", "device"),
    [
        ("openvino", "CPU"),
        ("openvino", "GPU.1"),
        ("openvino", "NPU"),
        ("openvino", "AUTO"),
        ("openvino", "'HETERO:GPU,CPU'"),
        ("openvino", "'MULTI:GPU.0,GPU.1'"),
        ("openvino", "'AUTO:-CPU'"),
        ("torch_llm", "cuda:1"),
        ("torch_llm", "auto"),
        ("onnxruntime", "cpu"),
        ("remote", "h100"),  # an upstream's device is a label of its hardware
    ],
)
def test_known_devices_pass(tmp_path, model, backend, device):
    extra = "url: 'http://x', protocol: openai" if backend == "remote" else "model: m.onnx"
    _parse(f"deployments:\n  d: {{backend: {backend}, {extra}, device: {device}}}\n", tmp_path)


def test_a_fallback_must_serve_what_the_routes_serve(tmp_path, model):
    base = (
        "deployments:\n  llm: {backend: remote, url: 'http://x', protocol: openai}\n"
        "  ort: {backend: onnxruntime, model: m.onnx}\n  v2: {backend: remote, url: 'http://y', protocol: kserve_v2}\n"
    )
    with pytest.raises(ConfigError) as info:
        _parse(base + "models: {chat: {routes: [{deployment: llm}], fallback: [v2, ort]}}", tmp_path)
    assert str(info.value) == (
        "fallback 'v2' (remote) serves only tensors, while the model's routes serve embeddings and text: "
        "a fallback must answer the same requests - at `$.models.chat.fallback[0]`"
    )
    with pytest.raises(ConfigError, match=r"serves only embeddings and text.* - at `\$.models.t.fallback\[0\]`"):
        _parse(base + "models: {t: {routes: [{deployment: ort}], fallback: [llm]}}", tmp_path)
    _parse(base + "models: {t: {routes: [{deployment: ort}], fallback: [v2]}}", tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "server: {log_level: loud}",
            "Invalid enum value 'loud' (expected one of: debug, error, info, warning) - at `$.server.log_level`",
        ),
        (
            "deployments: {a: {backend: magic}}",
            "Invalid enum value 'magic' (expected one of: onnxruntime, openvino, openvino_llm, remote, tfserving, torch_llm)"
            " - at `$.deployments.a.backend`",
        ),
        (
            "deployments: {a: {backend: remote, url: 'http://x', protocol: grpc}}",
            "Invalid enum value 'grpc' (expected one of: kserve_v2, openai) - at `$.deployments.a.protocol`",
        ),
        (
            "models: {m: {routes: [{deployment: a}], balance: fastest}}",
            "Invalid enum value 'fastest' (expected one of: least_wait, weighted) - at `$.models.m.balance`",
        ),
    ],
)
def test_enum_errors_list_the_valid_values(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        _parse(text, tmp_path)
    assert str(info.value) == message


def test_option_enum_errors_list_the_valid_values():
    from backends.openvino.options import OpenVINOOptions
    from backends.spec import decode_options

    with pytest.raises(ValueError) as info:
        decode_options({"precision": "f8"}, OpenVINOOptions)
    assert str(info.value) == "options: Invalid enum value 'f8' (expected one of: bf16, f16, f32) - at `options.precision`"


@pytest.mark.parametrize("name", ["a:1", "a@b", "a/../b", "-a", "a b"])
def test_model_names_follow_the_rule(tmp_path, name):
    with pytest.raises(ConfigError) as info:
        _parse(f"models: {{'{name}': {{routes: [{{deployment: x}}]}}}}", tmp_path)
    assert f"{name!r} is not a valid model name: " in str(info.value)
    assert str(info.value).endswith(f" - at `$.models.{name}`")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server:\n  port: 80\n  host: a: b\n", "at line 3, column 10: mapping values are not allowed here: `host: a: b`"),
        ("server: {port: [80\n\n", "at line 3, column 1: expected ',' or ']', but got '<stream end>' (near line 1: `server: {port: [80`)"),
    ],
)
def test_yaml_errors_name_the_file_line_column_and_text(tmp_path, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value) == f"invalid YAML in {bad} {message}"
    out = subprocess.run(
        [sys.executable, "-m", "gateway.serve.cli", "check-config", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stderr.strip() == f"fleetgate: invalid YAML in {bad} {message}"
