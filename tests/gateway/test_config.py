"""Config files: every mistake is refused with one line naming the path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.config import ConfigError, load_config, parse_config


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
        [sys.executable, "-m", "gateway.cli", "check-config", str(bad)],
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
