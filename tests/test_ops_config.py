"""Configuration: the documented reference file, example configs, env overrides, validation.

``kvxferd serve --check-config`` runs as a real process, so its exit codes are the ones an
operator (or an ExecStartPre=) sees. No daemon is started here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.errors import ConfigError
from kvxferd.ops import config
from kvxferd.ops.config import tomllib

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
EXAMPLES = ("single-node.toml", "prefill-node.toml", "decode-node.toml", "one-host/prefill.toml", "one-host/decode.toml")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without KVXFERD_* or runtime-dir variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVXFERD_") and k not in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")}
    env.update(extra)
    return env


def check_config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxferd", "serve", *args], capture_output=True, text=True,
                          env=env or clean_env(), cwd=ROOT, timeout=60)


# -- the reference file ------------------------------------------------------------------

def test_reference_file_lists_every_setting_with_its_default():
    data = tomllib.loads((CONFIGS / "kvxferd.toml").read_text())
    defaults = config.Config().to_dict()
    assert sorted(data) == sorted(defaults), "sections of configs/kvxferd.toml != Config"
    for section, values in defaults.items():
        assert sorted(data[section]) == sorted(values), f"keys of [{section}] in configs/kvxferd.toml"
        for key, default in values.items():
            assert data[section][key] == default, f"{section}.{key}: file says {data[section][key]!r}, " \
                                                  f"default is {default!r}"


def test_reference_file_documents_every_key():
    """Each key (or the [auth] block as a whole) has a comment line right above it."""
    lines = (CONFIGS / "kvxferd.toml").read_text().splitlines()
    section = ""
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line.strip("[]")
        m = re.match(r"^([a-z_]+) = ", line)
        if not m:
            continue
        j = i - 1
        while j >= 0 and re.match(r"^[a-z_]+ = ", lines[j]) and section == "auth":
            j -= 1
        assert lines[j].startswith("#"), f"{section}.{m.group(1)} has no comment above it"


@pytest.mark.parametrize("name", ("kvxferd.toml",) + EXAMPLES)
def test_shipped_configs_load(name):
    cfg = config.load(CONFIGS / name, environ={})
    assert cfg.peer.control_port > 0


def test_examples_are_commented_and_differ_where_the_role_needs():
    single = config.load(CONFIGS / "single-node.toml", environ={})
    prefill = config.load(CONFIGS / "prefill-node.toml", environ={})
    decode = config.load(CONFIGS / "decode-node.toml", environ={})
    assert single.peer.bind_host == "127.0.0.1"
    for cfg in (prefill, decode):
        assert cfg.peer.bind_host == "0.0.0.0" and cfg.peer.advertise_host
        assert cfg.engine.socket_path == "/run/kvxferd/engine.sock"
    for name in EXAMPLES:
        text = (CONFIGS / name).read_text()
        assert text.startswith("#") and text.count("\n#") >= 3, f"{name} should explain itself"


# -- env overrides -----------------------------------------------------------------------

def test_env_overrides_every_type_and_beats_the_file(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[peer]\ncontrol_port = 6001\n[daemon]\nlog_format = "logfmt"\n')
    cfg = config.load(path, environ={
        "KVXFERD_PEER_CONTROL_PORT": "6000",           # int, beats the file
        "KVXFERD_DAEMON_LOG_FORMAT": "json",           # str, beats the file
        "KVXFERD_TIMEOUTS_DRAIN_GRACE_S": "2.5",       # float
        "KVXFERD_PEER_REQUIRE_SAME_PAGE_SIZE": "yes",  # bool
        "KVXFERD_ENGINE_SHM_DIRS": "/dev/shm, /dev/hugepages",  # list
        "KVXFERD_LIMITS_MAX_MESSAGE_BYTES": "0x100000",
        "OTHER_VARIABLE": "ignored",
    })
    assert cfg.peer.control_port == 6000
    assert cfg.daemon.log_format == "json"
    assert cfg.timeouts.drain_grace_s == 2.5
    assert cfg.peer.require_same_page_size is True
    assert cfg.engine.shm_dirs == ["/dev/shm", "/dev/hugepages"]
    assert cfg.limits.max_message_bytes == 1 << 20


def test_every_key_has_an_env_override():
    for section, values in config.Config().to_dict().items():
        for key, default in values.items():
            if isinstance(default, bool):
                raw, want = ("false", False) if default else ("true", True)
            elif isinstance(default, (int, float)):
                want = default * 2 or type(default)(7)
                raw = str(want)
            elif isinstance(default, list):
                raw, want = "/dev/shm", ["/dev/shm"]
            else:
                continue  # strings are checked one by one below: most have a fixed vocabulary
            env = {f"KVXFERD_{section}_{key}".upper(): raw}
            if (section, key) == ("auth", "enabled"):
                env["KVXFERD_AUTH_ENABLED"] = "false"  # enabling needs a key file; parsing is what counts here
                want = False
            if (section, key) == ("peer", "transports"):
                env[f"KVXFERD_{section}_{key}".upper()], want = "nixl,tcp", ["nixl", "tcp"]  # a fixed vocabulary
            if (section, key) == ("qos", "bulk_nice"):  # a nice value: 0..19
                env[f"KVXFERD_{section}_{key}".upper()], want = "5", 5
            if (section, key) == ("qos", "instances"):  # entries of their own shape
                env[f"KVXFERD_{section}_{key}".upper()], want = "chat=latency,b-*=bulk:3", ["chat=latency", "b-*=bulk:3"]
            assert getattr(getattr(config.load(None, env), section), key) == want, env


def test_misspelt_env_variable_is_reported():
    env = {"KVXFERD_LOG_FORMAT": "json", "KVXFERD_DAEMON_LOG_FORMAT": "json", "KVXFERD_PEER_NOPE": "1",
           # read by the copy path and the SGLang adapter, not by the config: not misspellings
           "KVXFERD_RUNCOPY": "off", "KVXFERD_SGLANG_INSTANCE": "p"}
    assert config.unknown_env(env) == ["KVXFERD_LOG_FORMAT", "KVXFERD_PEER_NOPE"]
    out = check_config("--check-config", env=clean_env(KVXFERD_LOG_FORMAT="json"))
    assert out.returncode == 0
    assert "KVXFERD_LOG_FORMAT names no setting" in out.stderr


def test_bad_env_value_names_the_variable_key():
    with pytest.raises(ConfigError) as err:
        config.load(None, {"KVXFERD_PEER_CONTROL_PORT": "fast"})
    assert err.value.field == "peer.control_port"
    assert "peer.control_port" in str(err.value) and "'fast'" in str(err.value)


# -- validation --------------------------------------------------------------------------

@pytest.mark.parametrize("toml, key", [
    ('[peer]\ncontrol_port = "x"\n', "peer.control_port"),
    ("[peer]\ncontrol_port = 70000\n", "peer.control_port"),
    ("[peer]\nheartbeat_interval_s = 5.0\npeer_timeout_s = 2.0\n", "peer.peer_timeout_s"),
    ('[peer]\nmode = "fastest"\n', "peer.mode"),
    ('[peer]\ntransport = "carrier-pigeon"\n', "peer.transport"),
    ('[peer]\nbind_host = ""\n', "peer.bind_host"),
    ("[peer]\nport = 1\n", "peer.port"),
    ("[timeouts]\ndrain_grace_s = 0\n", "timeouts.drain_grace_s"),
    ("[timeouts]\ntransfer_s = nan\n", "timeouts.transfer_s"),
    ("[timeouts]\nbootstrap_s = inf\n", "timeouts.bootstrap_s"),
    ("[limits]\nmax_inflight_requests = -1\n", "limits.max_inflight_requests"),
    ('[daemon]\nlog_format = "xml"\n', "daemon.log_format"),
    ('[daemon]\nlog_level = "loud"\n', "daemon.log_level"),
    ("[daemon]\ndata_threads = 0\n", "daemon.data_threads"),
    ('[engine]\nsocket_mode = "0666"\n', "engine.socket_mode"),
    ('[engine]\nsocket_mode = "rw"\n', "engine.socket_mode"),
    ('[engine]\nsocket_group = "no-such-group-kvxferd"\n', "engine.socket_group"),
    ("[engine]\nshm_dirs = []\n", "engine.shm_dirs"),
    ('[metrics]\nbind = "9400"\n', "metrics.bind"),
    ('[metrics]\nbind = "127.0.0.1:http"\n', "metrics.bind"),
    ("[auth]\nenabled = true\n", "auth.secret_key_file"),
    ("[nosuch]\nx = 1\n", "nosuch"),
    ("[to_dict]\nx = 1\n", "to_dict"),
    ("socket_path = 1\n", "socket_path"),
    ("[peer\n", "config"),
    ('[directory]\nbackend = "zookeeper"\n', "directory.backend"),
    ('[directory]\nbackend = "etcd"\netcd_endpoints = []\n', "directory.etcd_endpoints"),
    ('[directory]\nbackend = "etcd"\netcd_endpoints = ["127.0.0.1:2379"]\n', "directory.etcd_endpoints"),
    ('[directory]\nbackend = "etcd"\netcd_endpoints = ["http://h:2379/v3"]\n', "directory.etcd_endpoints"),
    ('[directory]\ncluster = "a/b"\n', "directory.cluster"),
    ("[directory]\nlease_ttl_s = -1\n", "directory.lease_ttl_s"),
    ("[directory]\nlease_ttl_s = 0.5\n", "directory.lease_ttl_s"),
    ("[directory]\netcd_timeout_s = 0\n", "directory.etcd_timeout_s"),
])
def test_invalid_config_names_the_key(tmp_path, toml, key):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        config.load(path, environ={})
    assert err.value.field == key
    assert err.value.fix, "every config error says how to fix it"


# -- kvxferd serve --check-config --------------------------------------------------------

def test_check_config_accepts_the_shipped_files():
    for name in ("kvxferd.toml",) + EXAMPLES:
        out = check_config("--check-config", str(CONFIGS / name))
        assert out.returncode == 0, out.stderr
        assert f"config ok: {CONFIGS / name}" in out.stdout
    out = check_config("--config", str(CONFIGS / "single-node.toml"), "--check-config")
    assert out.returncode == 0, out.stderr


def test_check_config_refuses_a_bad_file_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[peer]\nheartbeat_interval_s = 1.0\npeer_timeout_s = 0.5\n")
    out = check_config("--check-config", str(bad))
    assert out.returncode == 2
    assert "config error" in out.stderr and "peer.peer_timeout_s" in out.stderr
    assert out.stdout == ""


def test_check_config_applies_env_overrides():
    out = check_config("--check-config", str(CONFIGS / "kvxferd.toml"),
                       env=clean_env(KVXFERD_METRICS_BIND="localhost"))
    assert out.returncode == 2 and "metrics.bind" in out.stderr
    out = check_config("--check-config", str(CONFIGS / "kvxferd.toml"),
                       env=clean_env(KVXFERD_PEER_CONTROL_PORT="6123"))
    assert out.returncode == 0 and ":6123" in out.stdout


def test_check_config_missing_file():
    out = check_config("--check-config", "/nonexistent/kvxferd.toml")
    assert out.returncode == 2 and "cannot read config" in out.stderr


# -- where the engine socket goes --------------------------------------------------------

def test_runtime_directory_wins_over_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "svc"))
    assert config.default_runtime_dir() == tmp_path / "svc"
    assert config.load(None, {}).socket_path == str(tmp_path / "svc" / "engine.sock")
    # systemd joins several RuntimeDirectory= entries with ':'
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")
    assert config.default_runtime_dir() == tmp_path / "a"
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    assert config.default_runtime_dir() == tmp_path / "xdg" / "kvxferd"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    expected = Path("/run/kvxferd") if os.geteuid() == 0 else Path(f"/tmp/kvxferd-{os.getuid()}")
    assert config.default_runtime_dir() == expected


def test_configured_socket_path_beats_runtime_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    cfg = config.load(None, {"KVXFERD_ENGINE_SOCKET_PATH": "/x/y.sock"})
    assert cfg.socket_path == "/x/y.sock"
    assert config.candidate_socket_paths()[0] == str(tmp_path / "engine.sock")


def test_every_setting_is_a_dataclass_field_with_a_default():
    """What docs/CONFIGURATION.md and the reference file promise: a default for every setting."""
    for section in dataclasses.fields(config.Config):
        for f in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
