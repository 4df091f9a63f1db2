"""RayKVConfig: defaults, the file < env < keyword layering, validation messages, masking, CLI."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import pickle
import sys
import types
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raykv
from raykv import config as config_mod
from raykv.config import (
    FIELD_NAMES,
    GB,
    KNOWN_SERDES,
    KV_DTYPES,
    RayKVConfig,
    env_name,
    mask_url,
)
from raykv.errors import ConfigError, InvalidInputError

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-pw"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no RAYKV_* variables, whatever the developer's shell has."""
    import os

    for var in list(os.environ):
        if var.startswith("RAYKV_"):
            monkeypatch.delenv(var)


def write(tmp_path: Path, text: str, name: str = "raykv.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ----- defaults and shape -----


def test_defaults_are_the_documented_ones() -> None:
    cfg = RayKVConfig()
    assert cfg.chunk_size == 256
    assert cfg.local_cpu is True
    assert cfg.max_local_cpu_size == 5.0
    assert cfg.local_disk is None
    assert cfg.max_local_disk_size == 0.0
    assert cfg.remote_url is None
    assert cfg.remote_serde == "naive"
    assert cfg.save_unfull_chunk is False
    assert cfg.cache_policy == "LRU"
    assert cfg.blocking_timeout_secs == 10
    assert cfg.use_layerwise is False
    assert cfg.priority_limit is None
    assert cfg.namespace == "raykv"
    assert cfg.hash_seed == "raykv-v1"
    assert cfg.lookup_timeout_ms == 3000
    assert cfg.pin_lease_secs == 300
    assert cfg.extra_config == {}
    assert (cfg.model_name, cfg.world_size, cfg.worker_id) == ("default", 1, 0)
    assert cfg.kv_dtype == "bfloat16"
    assert cfg.max_remote_size == 5.0
    assert (cfg.disk_write_workers, cfg.disk_max_pending_writes) == (2, 64)


def test_every_field_has_a_one_line_comment() -> None:
    source = inspect.getsource(RayKVConfig)
    for name in FIELD_NAMES:
        line = next(ln for ln in source.splitlines() if ln.strip().startswith(f"{name}:"))
        assert "  # " in line, f"field {name} has no comment"


def test_docs_reference_lists_every_key_and_env_name() -> None:
    doc = (REPO / "docs" / "CONFIG.md").read_text(encoding="utf-8")
    for name in FIELD_NAMES:
        assert f"`{name}`" in doc
        assert f"`{env_name(name)}`" in doc
    assert "RAYKV_CONFIG_FILE" in doc


def test_config_is_frozen_and_replace_returns_a_validated_copy() -> None:
    cfg = RayKVConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 1  # type: ignore[misc]
    other = cfg.replace(chunk_size=16)
    assert (cfg.chunk_size, other.chunk_size) == (256, 16)
    with pytest.raises(ConfigError, match="chunk_size"):
        cfg.replace(chunk_size=0)
    with pytest.raises(ConfigError, match="did you mean 'chunk_size'"):
        cfg.replace(chunk_sise=16)


def test_config_pickles_for_ray_actors() -> None:
    cfg = RayKVConfig(remote_url="ray://kv", extra_config={"a": [1, {"b": None}]})
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_byte_properties_use_gib() -> None:
    cfg = RayKVConfig(
        max_local_cpu_size=0.5, local_disk="/tmp/x", max_local_disk_size=2, max_remote_size=1
    )
    assert GB == 1024**3
    assert cfg.max_local_cpu_bytes == GB // 2
    assert cfg.max_local_disk_bytes == 2 * GB
    assert cfg.max_remote_bytes == GB


def test_policy_for_uses_the_tier_override_or_cache_policy() -> None:
    cfg = RayKVConfig(cache_policy="LFU", disk_cache_policy="fifo")
    assert cfg.policy_for("cpu") == "LFU"
    assert cfg.policy_for("disk") == "fifo"
    assert cfg.policy_for("remote") == "LFU"
    with pytest.raises(InvalidInputError, match="cpu, disk, remote"):
        cfg.policy_for("gpu")


def test_extra_config_is_copied_so_the_caller_cannot_mutate_the_config() -> None:
    extra = {"a": {"b": 1}}
    cfg = RayKVConfig(extra_config=extra)
    extra["a"]["b"] = 2
    assert cfg.extra_config == {"a": {"b": 1}}
    cfg.to_dict()["extra_config"]["a"]["b"] = 3
    assert cfg.extra_config == {"a": {"b": 1}}


# ----- local_disk normalisation -----


@pytest.mark.parametrize(
    "given_path",
    ["file:///var/cache/raykv", "file://localhost/var/cache/raykv", "/var/cache/raykv"],
)
def test_local_disk_file_url_becomes_a_plain_path(given_path: str) -> None:
    cfg = RayKVConfig(local_disk=given_path, max_local_disk_size=1)
    assert cfg.local_disk == "/var/cache/raykv"


def test_local_disk_relative_path_becomes_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = RayKVConfig(local_disk="cache", max_local_disk_size=1)
    assert cfg.local_disk == str(tmp_path / "cache")


@pytest.mark.parametrize("bad", ["s3://bucket/x", "file://otherhost/x", "", "   "])
def test_local_disk_rejects_non_file_urls_and_empty_paths(bad: str) -> None:
    with pytest.raises(ConfigError, match="local_disk") as err:
        RayKVConfig(local_disk=bad, max_local_disk_size=1)
    assert "directory path" in str(err.value)


# ----- file loading -----


def test_from_file_reads_every_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
chunk_size: 16
local_cpu: true
max_local_cpu_size: 1          # an int is fine for a float field
local_disk: file:///data/kv
max_local_disk_size: 20.5
remote_url: ray://kvserver
cache_policy: s3fifo
disk_cache_policy: FIFO
priority_limit: 3
namespace: team-a
hash_seed: my-seed
extra_config: {foo: [1, 2], bar: {baz: true}}
""",
    )
    cfg = RayKVConfig.from_file(path)
    assert cfg.chunk_size == 16
    assert cfg.max_local_cpu_size == 1.0 and isinstance(cfg.max_local_cpu_size, float)
    assert cfg.local_disk == "/data/kv"
    assert cfg.max_local_disk_size == 20.5
    assert cfg.remote_url == "ray://kvserver"
    assert cfg.policy_for("cpu") == "s3fifo" and cfg.policy_for("disk") == "FIFO"
    assert cfg.priority_limit == 3
    assert cfg.namespace == "team-a" and cfg.hash_seed == "my-seed"
    assert cfg.extra_config == {"foo": [1, 2], "bar": {"baz": True}}


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    assert RayKVConfig.from_file(write(tmp_path, "# nothing\n")) == RayKVConfig()


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        RayKVConfig.from_file(tmp_path / "nope.yaml")


def test_yaml_syntax_error_reports_the_line_number(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 16\nlocal_cpu: true\nnamespace: [unclosed\nhash_seed: x\n")
    with pytest.raises(ConfigError) as err:
        RayKVConfig.from_file(path)
    message = str(err.value)
    assert "invalid YAML" in message and str(path) in message
    assert "line 4" in message or "line 3" in message


def test_yaml_error_on_the_password_line_does_not_leak_it(tmp_path: Path) -> None:
    path = write(tmp_path, f'remote_url: "redis://:{SECRET}@host:6379/0\nchunk_size: 1\n')
    with pytest.raises(ConfigError, match="line") as err:
        RayKVConfig.from_file(path)
    assert SECRET not in str(err.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_yaml_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="mapping of keys to values at the top level"):
        RayKVConfig.from_file(write(tmp_path, text))


def test_yaml_duplicate_key_is_rejected_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 16\nlocal_cpu: true\nchunk_size: 32\n")
    with pytest.raises(ConfigError, match=r"line 3.*duplicate key 'chunk_size'"):
        RayKVConfig.from_file(path)


def test_yaml_python_tags_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "extra_config: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="line 1"):
        RayKVConfig.from_file(path)


def test_unknown_key_in_file_names_file_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 16\nmax_local_cpu_sise: 2\n")
    with pytest.raises(ConfigError) as err:
        RayKVConfig.from_file(path)
    message = str(err.value)
    assert "'max_local_cpu_sise'" in message and "(value 2)" in message
    assert "did you mean 'max_local_cpu_size'" in message
    assert str(path) in message


def test_invalid_value_in_file_says_which_file_set_it(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: -1\n")
    with pytest.raises(ConfigError, match=rf"chunk_size=-1.*set by file {path}"):
        RayKVConfig.from_file(path)


# ----- layering: defaults < file < env < keyword overrides -----


def test_file_overrides_defaults(tmp_path: Path) -> None:
    cfg = RayKVConfig.load(write(tmp_path, "chunk_size: 64\n"))
    assert cfg.chunk_size == 64 and cfg.namespace == "raykv"


def test_env_overrides_file_even_when_the_file_sets_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "chunk_size: 64\nnamespace: from-file\n")
    monkeypatch.setenv("RAYKV_CHUNK_SIZE", "128")
    cfg = RayKVConfig.load(path)
    assert cfg.chunk_size == 128  # env wins
    assert cfg.namespace == "from-file"  # file still applies where env is silent


def test_keyword_overrides_beat_env_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "chunk_size: 64\nhash_seed: file\n")
    monkeypatch.setenv("RAYKV_CHUNK_SIZE", "128")
    monkeypatch.setenv("RAYKV_HASH_SEED", "env")
    cfg = RayKVConfig.load(path, chunk_size=512)
    assert cfg.chunk_size == 512 and cfg.hash_seed == "env"


def test_config_file_env_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYKV_CONFIG_FILE", str(write(tmp_path, "chunk_size: 64\n")))
    monkeypatch.setenv("RAYKV_NAMESPACE", "from-env")
    cfg = RayKVConfig.load()
    assert (cfg.chunk_size, cfg.namespace) == (64, "from-env")


def test_explicit_path_beats_config_file_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYKV_CONFIG_FILE", str(write(tmp_path, "chunk_size: 64\n", "a.yaml")))
    assert RayKVConfig.load(write(tmp_path, "chunk_size: 32\n", "b.yaml")).chunk_size == 32


def test_load_without_file_or_env_is_the_defaults() -> None:
    assert RayKVConfig.load() == RayKVConfig()


def test_from_env_ignores_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYKV_CONFIG_FILE", str(write(tmp_path, "chunk_size: 64\n")))
    monkeypatch.setenv("RAYKV_LOCAL_CPU", "off")
    cfg = RayKVConfig.from_env()
    assert cfg.chunk_size == 256 and cfg.local_cpu is False


def test_unknown_keyword_override_suggests_the_nearest_key() -> None:
    with pytest.raises(ConfigError, match="did you mean 'namespace'"):
        RayKVConfig.load(namespce="x")


def test_invalid_env_value_says_which_variable_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYKV_CHUNK_SIZE", "0")
    with pytest.raises(ConfigError, match=r"chunk_size=0.*set by env RAYKV_CHUNK_SIZE"):
        RayKVConfig.load(write(tmp_path, "chunk_size: 64\n"))


# ----- env parsing -----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("True", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        ("On", True),
        (" yes ", True),
        ("false", False),
        ("False", False),
        ("0", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_env_bool_variants(monkeypatch: pytest.MonkeyPatch, text: str, expected: bool) -> None:
    monkeypatch.setenv("RAYKV_USE_LAYERWISE", text)
    monkeypatch.setenv("RAYKV_SAVE_UNFULL_CHUNK", text)
    cfg = RayKVConfig.load()
    assert cfg.use_layerwise is expected and cfg.save_unfull_chunk is expected


@pytest.mark.parametrize("text", ["maybe", "2", "", "truee"])
def test_env_bad_bool_names_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("RAYKV_LOCAL_CPU", text)
    with pytest.raises(ConfigError) as err:
        RayKVConfig.load()
    message = str(err.value)
    assert "RAYKV_LOCAL_CPU" in message and repr(text) in message
    assert "true/false" in message


@pytest.mark.parametrize("text", ["null", "None", "", "NULL"])
def test_env_null_for_optional_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    path = write(tmp_path, "local_disk: /data\nmax_local_disk_size: 1\npriority_limit: 3\n")
    monkeypatch.setenv("RAYKV_LOCAL_DISK", text)
    monkeypatch.setenv("RAYKV_PRIORITY_LIMIT", text)
    cfg = RayKVConfig.load(path)
    assert cfg.local_disk is None and cfg.priority_limit is None


def test_env_typed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYKV_CHUNK_SIZE", " 512 ")
    monkeypatch.setenv("RAYKV_MAX_LOCAL_CPU_SIZE", "0.25")
    monkeypatch.setenv("RAYKV_PIN_LEASE_SECS", "30")
    monkeypatch.setenv("RAYKV_PRIORITY_LIMIT", "-2")
    monkeypatch.setenv("RAYKV_EXTRA_CONFIG", '{"tags": ["a", "b"], "n": 1}')
    monkeypatch.setenv("RAYKV_REMOTE_URL", "redis://localhost:6379/2")
    monkeypatch.setenv("RAYKV_NAMESPACE", "none")  # not optional: a literal name
    cfg = RayKVConfig.load()
    assert cfg.chunk_size == 512
    assert cfg.max_local_cpu_size == 0.25
    assert cfg.pin_lease_secs == 30.0
    assert cfg.priority_limit == -2
    assert cfg.extra_config == {"tags": ["a", "b"], "n": 1}
    assert cfg.remote_url == "redis://localhost:6379/2"
    assert cfg.namespace == "none"


def test_env_yaml_flow_mapping_for_dict_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYKV_EXTRA_CONFIG", "{a: 1, b: {c: x}}")
    assert RayKVConfig.load().extra_config == {"a": 1, "b": {"c": "x"}}


@pytest.mark.parametrize(
    ("var", "text", "allowed"),
    [
        ("RAYKV_CHUNK_SIZE", "12.5", "an integer"),
        ("RAYKV_CHUNK_SIZE", "lots", "an integer"),
        ("RAYKV_MAX_LOCAL_CPU_SIZE", "5GB", "a number"),
        ("RAYKV_EXTRA_CONFIG", "[1, 2]", "mapping"),
        ("RAYKV_EXTRA_CONFIG", "{a: [", "mapping"),
        ("RAYKV_PRIORITY_LIMIT", "high", "null"),
        ("RAYKV_MAX_LOWER_WRITES_IN_FLIGHT", "many", "an integer"),
        ("RAYKV_REMOTE_INDEX_MAX_KEYS", "1e6", "an integer"),
        ("RAYKV_DISK_FSYNC", "sometimes", "true/false"),
        ("RAYKV_DISK_QUEUE_WAIT_SECS", "1s", "a number"),
        ("RAYKV_KV_SERVER_RESOURCES", "{kv: [", "mapping"),
    ],
)
def test_env_bad_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, text: str, allowed: str
) -> None:
    monkeypatch.setenv(var, text)
    with pytest.raises(ConfigError) as err:
        RayKVConfig.load()
    message = str(err.value)
    assert var in message and repr(text) in message and allowed in message


def test_env_nan_is_rejected_with_the_variable_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYKV_BLOCKING_TIMEOUT_SECS", "nan")
    with pytest.raises(ConfigError, match=r"finite.*RAYKV_BLOCKING_TIMEOUT_SECS"):
        RayKVConfig.load()


def test_unknown_env_var_warns_but_does_not_fail(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RAYKV_CHUNK_SIZ", "64")
    monkeypatch.delenv("RAYKV_CONFIG_FILE", raising=False)
    with caplog.at_level(logging.WARNING, logger="raykv.config"):
        cfg = RayKVConfig.load()
    assert cfg.chunk_size == 256
    messages = [r.getMessage() for r in caplog.records]
    assert any("RAYKV_CHUNK_SIZ" in m and "RAYKV_CHUNK_SIZE" in m for m in messages)
    assert not any("RAYKV_CONFIG_FILE" in m for m in messages)


# ----- validation errors -----


def test_unknown_constructor_key_is_a_config_error_with_known_keys() -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig(chunksize=3)  # type: ignore[call-arg]
    message = str(err.value)
    assert "'chunksize'" in message and "did you mean 'chunk_size'" in message
    assert "Known keys: chunk_size" in message


def test_unknown_key_without_close_match_has_no_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig.from_dict({"zzzzzz": 1})
    assert "did you mean" not in str(err.value) and "Known keys" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("chunk_size", True, "an integer"),  # bool is not an int
        ("chunk_size", "256", "an integer"),
        ("chunk_size", 256.0, "an integer"),
        ("world_size", False, "an integer"),
        ("local_cpu", 1, "a bool"),
        ("local_cpu", "yes", "a bool"),
        ("max_local_cpu_size", "5", "a number"),
        ("max_local_cpu_size", True, "a number"),
        ("namespace", 7, "a string"),
        ("hash_seed", 7, "a string"),
        ("local_disk", 3, "a string or null"),
        ("priority_limit", 1.5, "an integer or null"),
        ("extra_config", [1], "a mapping"),
        ("extra_config", "a=1", "a mapping"),
    ],
)
def test_wrong_type_names_key_value_and_expected_type(
    key: str, value: object, allowed: str
) -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig.from_dict({key: value})
    message = str(err.value)
    assert f"{key}={value!r}" in message and allowed in message


def test_ints_are_accepted_for_float_fields_and_stored_as_floats() -> None:
    cfg = RayKVConfig(max_local_cpu_size=2, blocking_timeout_secs=1, pin_lease_secs=60)
    assert all(
        isinstance(v, float)
        for v in (cfg.max_local_cpu_size, cfg.blocking_timeout_secs, cfg.pin_lease_secs)
    )


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400])
@pytest.mark.parametrize("key", ["max_local_cpu_size", "blocking_timeout_secs", "pin_lease_secs"])
def test_non_finite_numbers_are_rejected(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"{key}=.*finite"):
        RayKVConfig.from_dict({key: value})


@pytest.mark.parametrize(
    ("values", "key", "allowed"),
    [
        ({"chunk_size": 0}, "chunk_size", "positive integer"),
        ({"chunk_size": -256}, "chunk_size", "positive integer"),
        ({"max_local_cpu_size": 0}, "max_local_cpu_size", "> 0 GB when local_cpu is true"),
        ({"local_cpu": False, "max_local_cpu_size": -1}, "max_local_cpu_size", ">= 0"),
        ({"local_disk": "/d"}, "max_local_disk_size", "> 0 GB when local_disk is set"),
        ({"local_disk": "/d", "max_local_disk_size": -1}, "max_local_disk_size", "> 0"),
        ({"max_local_disk_size": -0.5}, "max_local_disk_size", ">= 0"),
        ({"remote_url": "ray://kv", "max_remote_size": 0}, "max_remote_size", "> 0 GB"),
        ({"max_remote_size": -1}, "max_remote_size", ">= 0"),
        ({"lookup_timeout_ms": 0}, "lookup_timeout_ms", "positive"),
        ({"blocking_timeout_secs": 0}, "blocking_timeout_secs", "> 0"),
        ({"pin_lease_secs": -5}, "pin_lease_secs", "> 0"),
        ({"world_size": 0}, "world_size", "positive"),
        ({"world_size": 2, "worker_id": 2}, "worker_id", "[0, world_size=2)"),
        ({"worker_id": -1}, "worker_id", "[0, world_size=1)"),
        ({"disk_write_workers": 0}, "disk_write_workers", "positive"),
        ({"disk_max_pending_writes": 0}, "disk_max_pending_writes", "positive"),
        ({"remote_serde": "pickle"}, "remote_serde", ", ".join(KNOWN_SERDES)),
        ({"kv_dtype": "fp16"}, "kv_dtype", ", ".join(KV_DTYPES)),
        ({"namespace": ""}, "namespace", "letters, digits"),
        ({"namespace": "has space"}, "namespace", "letters, digits"),
        ({"model_name": ""}, "model_name", "non-empty"),
    ],
)
def test_out_of_range_values_name_key_value_and_allowed(
    values: dict[str, object], key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig.from_dict(values)
    message = str(err.value)
    assert f"invalid {key}=" in message and allowed in message


def test_sizes_may_be_zero_when_the_tier_is_off() -> None:
    cfg = RayKVConfig(local_cpu=False, max_local_cpu_size=0, max_local_disk_size=0)
    assert cfg.max_local_cpu_bytes == 0


@pytest.mark.parametrize(
    "policy", ["LRU", "lru", "Lfu", "S3FIFO", "S3-FIFO", "s3_fifo", "sieve", "arc", "clock"]
)
def test_known_policies_are_accepted_case_insensitively(policy: str) -> None:
    assert RayKVConfig(cache_policy=policy, cpu_cache_policy=policy).policy_for("cpu") == policy


def test_module_class_policy_is_accepted() -> None:
    cfg = RayKVConfig(remote_cache_policy="raykv.policies.lru:LRUPolicy")
    assert cfg.policy_for("remote") == "raykv.policies.lru:LRUPolicy"


def test_module_class_policy_that_cannot_be_imported_fails_at_load() -> None:
    with pytest.raises(ConfigError, match="remote_cache_policy=.*cannot be loaded"):
        RayKVConfig(remote_cache_policy="my_pkg.policies:Hyperbolic")


@pytest.mark.parametrize(
    "key", ["cache_policy", "cpu_cache_policy", "disk_cache_policy", "remote_cache_policy"]
)
def test_unknown_policy_lists_the_known_ones(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig.from_dict({key: "LRUU"})
    message = str(err.value)
    assert f"{key}='LRUU'" in message
    assert "lru" in message and "s3fifo" in message and "module:Class" in message
    assert "did you mean 'lru'" in message


def test_policy_names_come_from_the_policy_registry_when_it_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = types.ModuleType("raykv.policies")
    fake.known_policies = lambda: ["lru", "tinylfu"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "raykv.policies", fake)
    assert RayKVConfig(cache_policy="TinyLFU").cache_policy == "TinyLFU"
    with pytest.raises(ConfigError, match="allowed.*lru, tinylfu"):
        RayKVConfig(cache_policy="sieve")


@pytest.mark.parametrize(
    "url",
    [
        "ray://kvserver",
        "ray://raykv.kv-server_1",
        "redis://localhost:6379/0",
        "redis://localhost",
        "redis://:pw@10.0.0.1:6380/3",
        "redis://user:pw@[::1]:6379/0",
        "rediss://cache.example.com:6380",
    ],
)
def test_valid_remote_urls(url: str) -> None:
    assert RayKVConfig(remote_url=url).remote_url == url


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://host:6379", "unknown scheme 'http'"),
        ("localhost:6379", "unknown scheme"),
        ("ray://", "actor name"),
        ("ray://a/b", "actor name"),
        ("redis://:6379/0", "missing host"),
        ("redis://host:port/0", "port"),
        ("redis://host:99999/0", "port"),
        ("redis://host:0/0", "port"),
        ("redis://host:6379/db1", "db must be"),
        ("redis://host:6379/-1", "db must be"),
    ],
)
def test_malformed_remote_url_says_what_is_wrong(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig(remote_url=url)
    message = str(err.value)
    assert "remote_url=" in message and problem in message and "ray://NAME" in message


@pytest.mark.parametrize("value", [{"a": object()}, {1: "x"}, {"a": (1, 2)}, {"a": {2: 3}}])
def test_extra_config_must_hold_plain_yaml_values(value: dict[object, object]) -> None:
    with pytest.raises(ConfigError, match="extra_config=.*plain YAML values"):
        RayKVConfig(extra_config=value)  # type: ignore[arg-type]


# ----- settings once read from extra_config, fields now -----

NODE_ID = "ab" * 28  # 56 hex digits, the shape of ray.get_runtime_context().get_node_id()


def test_moved_settings_default_to_the_values_the_actors_used() -> None:
    cfg = RayKVConfig()
    assert cfg.max_lower_writes_in_flight == 32
    assert cfg.remote_index_max_keys == 1 << 20
    assert cfg.kv_server_node_id is None
    assert cfg.kv_server_resources is None
    assert cfg.disk_fsync is False
    assert cfg.disk_queue_wait_secs == 1.0 and isinstance(cfg.disk_queue_wait_secs, float)


@pytest.mark.parametrize(
    ("key", "text", "expected"),
    [
        ("max_lower_writes_in_flight", "8", 8),
        ("remote_index_max_keys", " 1000 ", 1000),
        ("kv_server_node_id", NODE_ID, NODE_ID),
        ("kv_server_node_id", "none", None),
        ("kv_server_resources", "kv_node", "kv_node"),
        ("kv_server_resources", "{kv_node: 0.5, ssd: 1}", {"kv_node": 0.5, "ssd": 1.0}),
        ("kv_server_resources", "", None),
        ("disk_fsync", "yes", True),
        ("disk_fsync", "0", False),
        ("disk_queue_wait_secs", "0", 0.0),
        ("disk_queue_wait_secs", "2.5", 2.5),
    ],
)
def test_moved_settings_env_override(
    monkeypatch: pytest.MonkeyPatch, key: str, text: str, expected: object
) -> None:
    monkeypatch.setenv(env_name(key), text)
    assert getattr(RayKVConfig.load(), key) == expected
    assert getattr(RayKVConfig.from_env(), key) == expected


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("max_lower_writes_in_flight", 0, "integer >= 1"),
        ("max_lower_writes_in_flight", -3, "integer >= 1"),
        ("max_lower_writes_in_flight", 2.0, "an integer"),
        ("max_lower_writes_in_flight", True, "an integer"),
        ("remote_index_max_keys", 0, "integer >= 1"),
        ("remote_index_max_keys", "1024", "an integer"),
        ("disk_fsync", "yes", "a bool"),
        ("disk_fsync", 1, "a bool"),
        ("disk_queue_wait_secs", -0.5, ">= 0 seconds"),
        ("disk_queue_wait_secs", math.inf, "finite"),
        ("disk_queue_wait_secs", "1", "a number"),
        ("kv_server_node_id", "node-1", "56 hex digits"),
        ("kv_server_node_id", NODE_ID[:-2], "56 hex digits"),
        ("kv_server_node_id", NODE_ID + "0", "56 hex digits"),
        ("kv_server_node_id", "", "56 hex digits"),
        ("kv_server_node_id", 7, "a string or null"),
        ("kv_server_resources", "", "custom resource name"),
        ("kv_server_resources", "GPU", "not CPU or GPU"),
        ("kv_server_resources", {"CPU": 1}, "not CPU or GPU"),
        ("kv_server_resources", {}, "non-empty mapping"),
        ("kv_server_resources", {"kv": 0}, ">= 0.0001"),
        ("kv_server_resources", {"kv": -1}, ">= 0.0001"),
        ("kv_server_resources", {"kv": math.nan}, ">= 0.0001"),
        ("kv_server_resources", {"kv": "1"}, ">= 0.0001"),
        ("kv_server_resources", {"kv": True}, ">= 0.0001"),
        ("kv_server_resources", ["kv"], "custom resource name"),
        ("kv_server_resources", 3, "custom resource name"),
    ],
)
def test_moved_settings_invalid_values_name_the_field_and_what_is_allowed(
    key: str, value: object, allowed: str
) -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig.from_dict({key: value})
    message = str(err.value)
    assert f"invalid {key}=" in message and allowed in message


def test_moved_settings_valid_values() -> None:
    cfg = RayKVConfig(
        max_lower_writes_in_flight=1,
        remote_index_max_keys=1,
        kv_server_node_id=NODE_ID.upper(),
        kv_server_resources={"kv_node": 2},
        disk_fsync=True,
        disk_queue_wait_secs=0,
    )
    assert cfg.kv_server_resources == {"kv_node": 2.0}
    assert isinstance(cfg.kv_server_resources["kv_node"], float)
    assert cfg.disk_queue_wait_secs == 0.0 and isinstance(cfg.disk_queue_wait_secs, float)
    assert RayKVConfig(kv_server_resources="kv_node").kv_server_resources == "kv_node"


@pytest.mark.parametrize("key", ["disk_fsync", "remote_index_max_keys", "chunk_size"])
def test_a_field_name_in_extra_config_is_refused_not_ignored(key: str, tmp_path: Path) -> None:
    """raykv never reads extra_config (it is for extensions): a field given there would
    be silently ignored, so it is an error that names the field to set instead."""
    with pytest.raises(ConfigError, match=rf"extra_config=.*{key} is a field; set {key}"):
        RayKVConfig(extra_config={key: 1, "mine": 1})
    path = write(tmp_path, f"extra_config: {{{key}: 1}}\n")
    with pytest.raises(ConfigError, match=rf"{key} is a field"):
        RayKVConfig.load(path)
    assert RayKVConfig(extra_config={"mine": 1}).extra_config == {"mine": 1}


def test_disk_store_from_config_reads_the_typed_fields(tmp_path: Path) -> None:
    from raykv.tiers.disk import DiskStore

    cfg = RayKVConfig(
        local_disk=str(tmp_path / "kv"),
        max_local_disk_size=0.01,
        disk_fsync=True,
        disk_queue_wait_secs=0.0,
    )
    store = DiskStore.from_config(cfg)
    try:
        assert (store._fsync, store._queue_wait_s) == (True, 0.0)
    finally:
        store.close()
    store = DiskStore.from_config(
        RayKVConfig(local_disk=str(tmp_path / "kv2"), max_local_disk_size=0.01)
    )
    try:
        assert (store._fsync, store._queue_wait_s) == (False, 1.0)
    finally:
        store.close()


# ----- password masking -----


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
        (f"redis://alice:{SECRET}@h:6379/0", "redis://alice:***@h:6379/0"),
        (f"rediss://{SECRET}@h", "rediss://***@h"),
        (f"redis://:p@ss{SECRET}@h:1/0", "redis://:***@h:1/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("ray://kv", "ray://kv"),
        # redis-py also takes the password from the query string.
        (f"redis://h:6379/0?password={SECRET}", "redis://h:6379/0?password=***"),
        (f"redis://h/0?db=1&Password={SECRET}&x=1", "redis://h/0?db=1&Password=***&x=1"),
        (f"redis://u:{SECRET}@h/0?password={SECRET}", "redis://u:***@h/0?password=***"),
        # Any argument whose decoded name names a secret, percent-encoded names included.
        (f"rediss://h/0?ssl_password={SECRET}", "rediss://h/0?ssl_password=***"),
        (f"redis://h/0?%70assword={SECRET}&db=2", "redis://h/0?%70assword=***&db=2"),
        (f"redis://h/0?client_SECRET={SECRET}", "redis://h/0?client_SECRET=***"),
        # An '@' in the query is not user info.
        ("redis://h:1/0?x=a@b", "redis://h:1/0?x=a@b"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert SECRET not in mask_url(url)


def test_a_percent_encoded_password_is_scrubbed_raw_and_decoded_from_remote_errors() -> None:
    from raykv.masking import url_secrets
    from raykv.tiers.remote import RemoteStore

    raw = "s%40cr%2Ft-pass-1234"  # decodes to s@cr/t-pass-1234
    url = f"redis://:{raw}@127.0.0.1:1/0?ssl_password=other-secret-5678"
    assert set(url_secrets(url)) >= {raw, "s@cr/t-pass-1234", "other-secret-5678"}
    store = RemoteStore(RayKVConfig(remote_url=url), timeout_s=0.1)
    text = store._scrub(f"auth failed for s@cr/t-pass-1234 and {raw} and other-secret-5678")
    assert "pass-1234" not in text and "other-secret" not in text


def test_extra_config_values_under_secret_names_are_masked_for_display() -> None:
    cfg = RayKVConfig(extra_config={"api_token": "tok-1234", "sso_password": "pw", "n": 3})
    shown = (repr(cfg), cfg.to_yaml(mask_secrets=True), str(cfg.to_dict(mask_secrets=True)))
    for text in shown:
        assert "tok-1234" not in text and "'pw'" not in text and "3" in text
    assert cfg.extra_config["api_token"] == "tok-1234"  # the value itself is kept


def test_repr_and_config_show_mask_a_query_string_password() -> None:
    cfg = RayKVConfig(remote_url=f"redis://127.0.0.1:6379/0?password={SECRET}")
    shown = (repr(cfg), cfg.to_yaml(mask_secrets=True), str(cfg.to_dict(mask_secrets=True)))
    assert all(SECRET not in text for text in shown)


def test_repr_masks_the_redis_password() -> None:
    cfg = RayKVConfig(remote_url=f"redis://:{SECRET}@host:6379/0")
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)
    assert "redis://:***@host:6379/0" in repr(cfg)
    assert cfg.remote_url == f"redis://:{SECRET}@host:6379/0"  # the real value is kept
    assert SECRET in cfg.to_yaml() and SECRET not in cfg.to_yaml(mask_secrets=True)


@pytest.mark.parametrize(
    "url",
    [f"redis://:{SECRET}@host:notaport/0", f"redis://:{SECRET}@:6379/0", f"http://:{SECRET}@h"],
)
def test_remote_url_errors_mask_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig(remote_url=url)
    assert SECRET not in str(err.value) and "***" in str(err.value)


def test_unknown_key_error_masks_a_password_in_its_value() -> None:
    with pytest.raises(ConfigError) as err:
        RayKVConfig.from_dict({"remote_ur": f"redis://:{SECRET}@h:6379/0"})
    assert SECRET not in str(err.value) and "did you mean 'remote_url'" in str(err.value)


# ----- the CLI -----


@pytest.fixture
def cli_main(monkeypatch: pytest.MonkeyPatch):
    """raykv.cli.main; tolerate a raykv/__init__.py without __version__ (still being written)."""
    monkeypatch.setattr(
        raykv, "__version__", getattr(raykv, "__version__", "0+test"), raising=False
    )
    from raykv.cli import main

    return main


def test_config_show_prints_the_effective_yaml(
    cli_main, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, f"chunk_size: 64\nremote_url: redis://:{SECRET}@h:6379/0\n")
    monkeypatch.setenv("RAYKV_NAMESPACE", "from-env")
    assert cli_main(["config", "show", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["chunk_size"] == 64 and data["namespace"] == "from-env"
    assert data["remote_url"] == "redis://:***@h:6379/0"
    assert SECRET not in out
    assert list(data) == list(FIELD_NAMES)


def test_config_show_json_uses_config_file_env(
    cli_main, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, f"chunk_size: 32\nremote_url: redis://u:{SECRET}@h:6379/0\n")
    monkeypatch.setenv("RAYKV_CONFIG_FILE", str(path))
    assert cli_main(["config", "show", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert data["chunk_size"] == 32 and data["remote_url"] == "redis://u:***@h:6379/0"
    assert SECRET not in out


def test_config_show_bad_config_is_one_error_line_and_exit_2(
    cli_main, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, f"remote_url: redis://:{SECRET}@h:bad/0\n")
    assert cli_main(["config", "show", "--file", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raykv config show: error: invalid remote_url")
    assert SECRET not in captured.err


def test_config_show_bad_env_is_exit_2(
    cli_main, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RAYKV_LOCAL_CPU", "perhaps")
    assert cli_main(["config", "show"]) == 2
    assert "RAYKV_LOCAL_CPU" in capsys.readouterr().err


def test_config_without_subcommand_prints_usage_and_exits_2(
    cli_main, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["config"]) == 2
    assert "show" in capsys.readouterr().err


# ----- property: any valid config round-trips through YAML -----

_plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
_policy = st.sampled_from(
    ["LRU", "lru", "LFU", "fifo", "MRU", "filo", "slru", "priority", "S3FIFO", "sieve", "arc"]
    + ["clock", "raykv.policies.lru:LRUPolicy"]
)
_name = st.from_regex(config_mod._NAME_RE, fullmatch=True)
_userinfo = st.text("abcXYZ019-_.~!$&'()*+,;=%", min_size=1, max_size=12)
_remote = st.one_of(
    st.none(),
    _name.map(lambda n: f"ray://{n}"),
    st.builds(
        "{}://{}{}:{}/{}".format,
        st.sampled_from(["redis", "rediss"]),
        st.one_of(st.just(""), _userinfo.map(lambda p: f":{p}@")),
        st.sampled_from(["localhost", "10.0.0.7", "cache.example.com", "[::1]"]),
        st.integers(1, 65535),
        st.integers(0, 15),
    ),
)
_size = st.floats(min_value=1e-6, max_value=1e6)
_secs = st.floats(min_value=1e-3, max_value=1e6)
_resource = _name.filter(lambda n: n not in ("CPU", "GPU"))
_amount = st.floats(min_value=1e-4, max_value=1e6)
# Keys that are fields now would move out of extra_config (tested above).
_extra_key = st.text().filter(lambda k: k not in FIELD_NAMES)


@st.composite
def valid_configs(draw: st.DrawFn) -> RayKVConfig:
    world_size = draw(st.integers(1, 64))
    local_disk = draw(
        st.one_of(st.none(), st.from_regex(r"/[a-z0-9_]{1,8}(/[a-z0-9_.:-]{1,8})?", fullmatch=True))
    )
    return RayKVConfig(
        chunk_size=draw(st.integers(1, 2**20)),
        save_unfull_chunk=draw(st.booleans()),
        hash_seed=draw(st.text()),
        model_name=draw(st.text(min_size=1)),
        world_size=world_size,
        worker_id=draw(st.integers(0, world_size - 1)),
        kv_dtype=draw(st.sampled_from(KV_DTYPES)),
        local_cpu=draw(st.booleans()),
        max_local_cpu_size=draw(_size),
        local_disk=local_disk,
        max_local_disk_size=draw(_size if local_disk else st.just(0.0)),
        disk_write_workers=draw(st.integers(1, 64)),
        disk_max_pending_writes=draw(st.integers(1, 10_000)),
        disk_fsync=draw(st.booleans()),
        disk_queue_wait_secs=draw(st.just(0.0) | _secs),
        remote_url=draw(_remote),
        remote_serde=draw(st.sampled_from(KNOWN_SERDES)),
        max_remote_size=draw(_size),
        kv_server_node_id=draw(st.none() | st.from_regex(r"[0-9a-f]{56}", fullmatch=True)),
        kv_server_resources=draw(
            st.none() | _resource | st.dictionaries(_resource, _amount, min_size=1, max_size=3)
        ),
        remote_index_max_keys=draw(st.integers(1, 2**40)),
        cache_policy=draw(_policy),
        cpu_cache_policy=draw(st.none() | _policy),
        disk_cache_policy=draw(st.none() | _policy),
        remote_cache_policy=draw(st.none() | _policy),
        priority_limit=draw(st.none() | st.integers()),
        blocking_timeout_secs=draw(_secs),
        lookup_timeout_ms=draw(st.integers(1, 10**7)),
        pin_lease_secs=draw(_secs),
        use_layerwise=draw(st.booleans()),
        namespace=draw(_name),
        max_lower_writes_in_flight=draw(st.integers(1, 4096)),
        extra_config=draw(st.dictionaries(_extra_key, _plain, max_size=4)),
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cfg=valid_configs())
def test_any_valid_config_round_trips_through_yaml(tmp_path: Path, cfg: RayKVConfig) -> None:
    path = tmp_path / "roundtrip.yaml"
    path.write_text(cfg.to_yaml(), encoding="utf-8")
    assert RayKVConfig.from_file(path) == cfg
    assert RayKVConfig.from_dict(cfg.to_dict()) == cfg


def test_an_empty_config_file_variable_is_an_error_not_no_file(monkeypatch) -> None:
    """A template that lost its value left RAYKV_CONFIG_FILE empty: the file (and the
    payload_secret it sets) was skipped without a word."""
    monkeypatch.setenv("RAYKV_CONFIG_FILE", " ")
    with pytest.raises(ConfigError, match="RAYKV_CONFIG_FILE is set but empty"):
        RayKVConfig.load()


@pytest.mark.parametrize(
    "field, value",
    [("namespace", "raykv\n"), ("remote_url", "ray://srv\n"), ("policy", "mod.path:Cls\n")],
)
def test_a_trailing_newline_is_no_part_of_a_name(field, value) -> None:
    with pytest.raises(ConfigError):
        RayKVConfig(**{field: value})
