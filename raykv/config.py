"""RayKVConfig: the one configuration object of raykv.

Precedence, lowest to highest (each layer overrides the one before it):

1. the defaults below,
2. a YAML file (``RayKVConfig.load(path)`` or the file named by ``RAYKV_CONFIG_FILE``),
3. ``RAYKV_<KEY>`` environment variables -- these ALWAYS apply on top of the file,
4. keyword overrides passed to ``RayKVConfig.load(**overrides)``.

Everything is validated once, when the dataclass is constructed; a bad key or value
raises :class:`raykv.errors.ConfigError` naming the key, the value and what is allowed.
A redis password or the payload secret never appears in a repr, a log line or an error message.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import logging
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

from raykv.cpus import AUTO as AUTO_CPUS
from raykv.cpus import parse_cpus
from raykv.errors import ConfigError, InvalidInputError
from raykv.keys import DEFAULT_HASH_SEED
from raykv.masking import MASK as _MASK
from raykv.masking import mask_extra, mask_url

logger = logging.getLogger(__name__)

GB = 1024**3
ENV_PREFIX = "RAYKV_"
CONFIG_FILE_ENV = "RAYKV_CONFIG_FILE"
TIERS = ("cpu", "disk", "remote")
KNOWN_SERDES = ("naive", "raw")
LOAD_MODES = ("async", "sync")  # how the vLLM connector loads a hit (see load_mode)
KV_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NULL = frozenset({"", "null", "none", "~"})
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*\Z")
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_CLASS_PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*\Z")
# A Ray node id in hex: 28 bytes (ray.NodeID.size()), as `ray.get_runtime_context().get_node_id()`.
_NODE_ID_RE = re.compile(r"^[0-9a-fA-F]{56}\Z")
# Ray refuses these names in `resources` (they have their own options).
_RAY_RESERVED_RESOURCES = frozenset({"CPU", "GPU"})
# Ray's resource precision: a smaller amount is rejected when the actor is created.
_MIN_RESOURCE_AMOUNT = 0.0001
# Fields whose whole value is a secret: "***" in repr, config show, logs and errors.
SECRET_FIELDS = ("payload_secret",)
MIN_PAYLOAD_SECRET_CHARS = 16
# One layer of settings: (key, value, where it came from) triples.
_Layer = list[tuple[Any, Any, str]]


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class RayKVConfig:
    """Every raykv setting, immutable and validated; build it with :meth:`load`."""

    # --- chunking and keys ---
    chunk_size: int = 256  # tokens per chunk; the unit of hashing, storage and eviction
    save_unfull_chunk: bool = False  # also store a trailing partial chunk (else it is dropped)
    hash_seed: str = DEFAULT_HASH_SEED  # seed of the chained prefix hash; change it to split caches
    model_name: str = "default"  # part of every CacheKey: different models never share chunks
    world_size: int = 1  # tensor-parallel world size, part of every CacheKey
    worker_id: int = 0  # this worker's rank in [0, world_size), part of every CacheKey
    kv_dtype: str = "bfloat16"  # dtype name of the KV tensors, part of every CacheKey
    # --- L1: CPU tier (Ray object store) ---
    local_cpu: bool = True  # enable the CPU tier
    max_local_cpu_size: float = 5.0  # CPU tier capacity in GB (GiB, 1024**3 bytes)
    # --- L2: local disk tier ---
    local_disk: str | None = None  # disk tier directory (plain path or file:///path); null = off
    max_local_disk_size: float = 0.0  # disk tier capacity in GB; must be > 0 when local_disk is set
    disk_write_workers: int = 2  # threads writing chunks to disk in the background
    disk_max_pending_writes: int = 64  # bound of the disk write queue; beyond it writes are dropped
    disk_fsync: bool = False  # fsync each chunk file and its directory (durable, slower)
    disk_queue_wait_secs: float = 1.0  # a put waits this long for a full write queue, then skips
    # --- L3: remote tier ---
    remote_url: str | None = None  # ray://NAME or redis[s]://[[user]:password@]host[:port][/db]
    remote_serde: str = "naive"  # codec of chunks sent to the remote tier
    max_remote_size: float = 5.0  # capacity in GB of the ray:// KVServer actor
    kv_server_node_id: str | None = None  # Ray node id (hex) to pin a new ray:// KVServer to
    kv_server_resources: str | dict[str, float] | None = None  # custom resource(s) it must get
    remote_index_max_keys: int = 1 << 20  # remote keys a storage manager remembers (oldest go)
    # --- integrity of stored KV (disk and redis records) ---
    payload_secret: str | None = None  # shared secret (>= 16 chars): records carry an HMAC; masked
    # --- eviction ---
    cache_policy: str = "LRU"  # eviction policy name (case-insensitive) or "module:Class"
    cpu_cache_policy: str | None = None  # CPU tier policy; null = use cache_policy
    disk_cache_policy: str | None = None  # disk tier policy; null = use cache_policy
    remote_cache_policy: str | None = None  # ray:// KVServer policy; null = use cache_policy
    priority_limit: int | None = None  # store only requests with priority <= this; null = all
    # --- timing ---
    blocking_timeout_secs: float = 10.0  # wait this long for unpinned space before skipping a store
    lookup_timeout_ms: int = 3000  # give up on a lookup after this long (counts as a miss)
    pin_lease_secs: float = 300.0  # a pin taken by lookup(pin=True) expires after this long
    # --- runtime ---
    use_layerwise: bool = False  # GPU connector moves KV layer by layer (overlaps with compute)
    worker_num_gpus: float = 0.0  # GPUs a GPU worker actor reserves (0: CPU-only, as in tests)
    namespace: str = "raykv"  # Ray namespace of the raykv actors; one cache per namespace
    ray_address: str | None = None  # Ray to attach to when not up in-process; null: $RAY_ADDRESS
    enable_controller: bool = False  # report chunks to the KVController (aware routing, peer tier)
    max_lower_writes_in_flight: int = 32  # background writes per lower tier; beyond it: skipped
    store_staging_size: float = 0.0  # GB a client stages for background stores; 0: stores wait
    read_cache_size: float = 0.0  # GB of batch objects a client keeps mapped after reading them
    client_remote_probe: bool = True  # a lookup asks the ray:// server itself, beside the manager
    load_mode: str = "async"  # vLLM connector: async (loads beside the engine's steps) or sync
    max_loads_in_flight: int = 4  # vLLM connector: async loads at once; more requests wait
    max_lookups_in_flight: int = 64  # vLLM connector: lookups at once; more requests are computed
    lookup_wait_ms: int = 5  # vLLM connector: per step, how long the scheduler waits for lookups
    lookup_view: bool = True  # vLLM connector: lookups answered from a copy of the CPU keys
    disk_direct_reads: bool = True  # vLLM connector: disk hits on this node read from the files
    sync_load_max_bytes: int = 33554432  # vLLM connector: async mode loads hits this small in-step
    load_timeout_ms: int = 30000  # vLLM connector: an async load still running then is recomputed
    load_wait_ms: int = 10  # vLLM connector: per step, how long a step's end waits for ending loads
    save_after_step: bool = True  # vLLM connector, CPU engine: blocks copied out after the step
    helper_cpus: str = "auto"  # engine process: cores for raykv's and Ray's threads ("": leave)
    extra_config: dict[str, Any] = field(default_factory=dict)  # free-form settings for extensions

    def __post_init__(self) -> None:
        _refuse_fields_in_extra(self)
        _validate(self)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={_show(v)}" for k, v in self.to_dict(mask_secrets=True).items())
        return f"RayKVConfig({body})"

    # ----- constructors -----

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "mapping") -> RayKVConfig:
        """Build from a mapping of YAML keys (defaults fill the rest); unknown keys fail."""
        return cls._from_layers([_layer(values, source)])

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RayKVConfig:
        """Build from one YAML file over the defaults (no env); see :meth:`load` for layering."""
        return cls._from_layers([_layer(_read_yaml(path), f"file {os.fspath(path)}")])

    @classmethod
    def from_env(cls) -> RayKVConfig:
        """Build from ``RAYKV_<KEY>`` variables over the defaults (ignores RAYKV_CONFIG_FILE)."""
        return cls._from_layers([_env_layer(os.environ)])

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> RayKVConfig:
        """The full chain: defaults < YAML file < ``RAYKV_*`` env < keyword overrides.

        ``path`` defaults to ``$RAYKV_CONFIG_FILE``; with neither, there is no file layer.
        Env variables apply on top of the file whether or not a file was given.
        """
        if path is None:
            path = os.environ.get(CONFIG_FILE_ENV)
            if path is not None and not path.strip():
                # Set but empty (a template that lost its value): skipping the file would
                # silently drop whatever it sets, its payload_secret too.
                raise ConfigError(
                    f"{CONFIG_FILE_ENV} is set but empty: unset it to run without a config "
                    "file, or name the file"
                )
        layers: list[_Layer] = []
        if path is not None:
            layers.append(_layer(_read_yaml(path), f"file {os.fspath(path)}"))
        layers.append(_env_layer(os.environ))
        layers.append(_layer(overrides, "keyword arguments"))
        return cls._from_layers(layers)

    def replace(self, **changes: Any) -> RayKVConfig:
        """Return a validated copy with ``changes`` applied (the config itself is frozen)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def _from_layers(cls, layers: list[_Layer]) -> RayKVConfig:
        """Merge layers, later ones winning; an invalid value's error says which layer set it."""
        merged: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for layer in layers:
            for key, value, source in layer:
                _check_key(key, value, source)
                merged[key] = value
                sources[key] = source
        try:
            return cls(**merged)
        except ConfigError as exc:
            key = getattr(exc, "key", None)
            if key in sources:
                raise ConfigError(f"{exc} (set by {sources[key]})") from None
            raise

    # ----- views -----

    def to_dict(self, *, mask_secrets: bool = False) -> dict[str, Any]:
        """All fields as plain Python values, in declaration order (a deep copy)."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if mask_secrets and out["remote_url"] is not None:
            out["remote_url"] = mask_url(out["remote_url"])
        if mask_secrets:
            out["extra_config"] = mask_extra(out["extra_config"])
        for name in SECRET_FIELDS:
            if mask_secrets and out[name] is not None:
                out[name] = _MASK
        return out

    def to_yaml(self, *, mask_secrets: bool = False) -> str:
        """YAML that :meth:`from_file` reads back to an equal config.

        Holds the real redis password and ``payload_secret`` unless ``mask_secrets`` (use
        that for display).
        """
        return yaml.safe_dump(
            self.to_dict(mask_secrets=mask_secrets),
            sort_keys=False,
            default_flow_style=False,
            # Escaped non-ASCII: PyYAML's unicode output does not read back U+0085 (NEL).
            allow_unicode=False,
        )

    def policy_for(self, tier: str) -> str:
        """Eviction policy of ``tier`` (cpu, disk or remote): its override, else cache_policy."""
        if tier not in TIERS:
            raise InvalidInputError(f"unknown tier {tier!r}; allowed: {', '.join(TIERS)}")
        return getattr(self, f"{tier}_cache_policy") or self.cache_policy

    @property
    def max_local_cpu_bytes(self) -> int:
        """CPU tier capacity in bytes."""
        return int(self.max_local_cpu_size * GB)

    @property
    def store_staging_bytes(self) -> int:
        """Bytes of a client's background-store staging ring (0: synchronous stores)."""
        return int(self.store_staging_size * GB)

    @property
    def read_cache_bytes(self) -> int:
        """Bytes of batch objects a client keeps after reading them (0: none)."""
        return int(self.read_cache_size * GB)

    @property
    def max_local_disk_bytes(self) -> int:
        """Disk tier capacity in bytes."""
        return int(self.max_local_disk_size * GB)

    @property
    def max_remote_bytes(self) -> int:
        """ray:// KVServer capacity in bytes."""
        return int(self.max_remote_size * GB)


# Unknown keywords to the constructor become a ConfigError (with a suggestion) rather
# than dataclass's bare TypeError, so every entry point reports keys the same way.
_dataclass_init = RayKVConfig.__init__


@functools.wraps(_dataclass_init)
def _checked_init(self: RayKVConfig, *args: Any, **kwargs: Any) -> None:
    for key, value in kwargs.items():
        _check_key(key, value, "keyword arguments")
    _dataclass_init(self, *args, **kwargs)


RayKVConfig.__init__ = _checked_init  # type: ignore[method-assign]

FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RayKVConfig))


def env_name(key: str) -> str:
    """The environment variable that overrides ``key``: ``RAYKV_<KEY>``."""
    return ENV_PREFIX + key.upper()


# ----- validation -----


def _show(value: Any) -> str:
    """repr() of a value for messages, with any URL password masked."""
    if isinstance(value, str):
        return repr(mask_url(value))
    return repr(value)


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    """A ConfigError that also records its key, so layered loading can say who set it."""
    shown = _MASK if _is_secret_key(key) else _show(value)
    err = ConfigError(f"invalid {key}={shown}: {allowed}")
    err.key = key  # type: ignore[attr-defined]
    return err


def _suggest(key: str, candidates: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _is_secret_key(key: str) -> bool:
    """A secret field, or a key that looks like one (a misspelt secret is still secret)."""
    low = key.lower()
    return "secret" in low or bool(difflib.get_close_matches(low, SECRET_FIELDS, cutoff=0.8))


def _check_key(key: Any, value: Any, source: str) -> None:
    if key in FIELD_NAMES:
        return
    if not isinstance(key, str):
        raise ConfigError(f"config keys must be strings, got {key!r} in {source}")
    raise ConfigError(
        f"unknown config key {key!r} (value {_MASK if _is_secret_key(key) else _show(value)}) "
        f"in {source}"
        f"{_suggest(key, FIELD_NAMES)} Known keys: {', '.join(FIELD_NAMES)}"
    )


@functools.cache
def _field_types() -> dict[str, tuple[type, bool]]:
    """Field name -> (base type, optional) from the annotations."""
    out: dict[str, tuple[type, bool]] = {}
    for name, tp in typing.get_type_hints(RayKVConfig).items():
        optional = False
        if isinstance(tp, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            optional, tp = True, args[0]
        out[name] = (typing.get_origin(tp) or tp, optional)
    return out


_KIND_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "a bool (true/false)",
    str: "a string",
    dict: "a mapping",
}


def _check_type(cfg: RayKVConfig, name: str) -> None:
    base, optional = _field_types()[name]
    value = getattr(cfg, name)
    if value is None and optional:
        return
    kind = _KIND_NAMES[base] + (" or null" if optional else "")
    if base is float:
        # ints are fine for floats (but a bool is not a number here)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(name, value, f"must be {kind}, got {type(value).__name__}")
        try:
            number = float(value)
        except OverflowError:
            raise _fail(name, value, "must be a finite number") from None
        if not math.isfinite(number):
            raise _fail(name, value, "must be a finite number (not NaN or infinity)")
        object.__setattr__(cfg, name, number)
        return
    if name == "kv_server_resources":  # str | dict: _validate_kv_server_resources checks it
        return
    if base is int and isinstance(value, bool):
        raise _fail(name, value, f"must be {kind}, got a bool")
    if not isinstance(value, base):
        raise _fail(name, value, f"must be {kind}, got {type(value).__name__}")


def _validate_helper_cpus(cfg: RayKVConfig) -> None:
    if cfg.helper_cpus in ("", AUTO_CPUS):
        return
    try:
        parse_cpus(cfg.helper_cpus)
    except ValueError as exc:
        _require(cfg, "helper_cpus", False, f"must be 'auto', '' or a CPU list: {exc}")


def _validate(cfg: RayKVConfig) -> None:
    for name in FIELD_NAMES:
        _check_type(cfg, name)
    for name in ("chunk_size", "world_size", "lookup_timeout_ms", "load_timeout_ms"):
        _require(cfg, name, getattr(cfg, name) > 0, "must be a positive integer")
    for name in ("disk_write_workers", "disk_max_pending_writes"):
        _require(cfg, name, getattr(cfg, name) > 0, "must be a positive integer")
    for name in (
        "max_lower_writes_in_flight",
        "remote_index_max_keys",
        "max_loads_in_flight",
        "max_lookups_in_flight",
    ):
        _require(cfg, name, getattr(cfg, name) >= 1, "must be an integer >= 1")
    for name in ("lookup_wait_ms", "load_wait_ms", "sync_load_max_bytes"):
        _require(cfg, name, getattr(cfg, name) >= 0, "must be an integer >= 0")
    _require(cfg, "disk_queue_wait_secs", cfg.disk_queue_wait_secs >= 0, "must be >= 0 seconds")
    _require(cfg, "store_staging_size", cfg.store_staging_size >= 0, "must be >= 0 GB")
    _require(cfg, "read_cache_size", cfg.read_cache_size >= 0, "must be >= 0 GB")
    if cfg.kv_server_node_id is not None:
        _require(
            cfg,
            "kv_server_node_id",
            bool(_NODE_ID_RE.match(cfg.kv_server_node_id)),
            "must be a Ray node id: 56 hex digits (ray.get_runtime_context().get_node_id()),"
            " or null",
        )
    _validate_kv_server_resources(cfg)
    for name in ("blocking_timeout_secs", "pin_lease_secs"):
        _require(cfg, name, getattr(cfg, name) > 0, "must be > 0 seconds")
    _require(
        cfg,
        "worker_id",
        0 <= cfg.worker_id < cfg.world_size,
        f"must be in [0, world_size={cfg.world_size})",
    )
    _require(cfg, "worker_num_gpus", cfg.worker_num_gpus >= 0, "must be >= 0")
    _require(cfg, "kv_dtype", cfg.kv_dtype in KV_DTYPES, f"allowed: {', '.join(KV_DTYPES)}")
    _require(cfg, "model_name", bool(cfg.model_name), "must be a non-empty string")
    _require(
        cfg,
        "namespace",
        bool(_NAME_RE.match(cfg.namespace)),
        "must be letters, digits, '_', '.' or '-', starting with a letter or digit",
    )
    _require(cfg, "load_mode", cfg.load_mode in LOAD_MODES, f"allowed: {', '.join(LOAD_MODES)}")
    _validate_helper_cpus(cfg)
    _require(
        cfg, "remote_serde", cfg.remote_serde in KNOWN_SERDES, f"allowed: {', '.join(KNOWN_SERDES)}"
    )
    _validate_sizes(cfg)
    _validate_local_disk(cfg)
    if cfg.remote_url is not None:
        _validate_remote_url(cfg.remote_url)
    for name in ("cache_policy", "cpu_cache_policy", "disk_cache_policy", "remote_cache_policy"):
        if getattr(cfg, name) is not None:
            _validate_policy(name, getattr(cfg, name))
    if cfg.payload_secret is not None:
        _require(
            cfg,
            "payload_secret",
            len(cfg.payload_secret) >= MIN_PAYLOAD_SECRET_CHARS,
            f"must be null or a string of at least {MIN_PAYLOAD_SECRET_CHARS} characters",
        )
        _require(
            cfg,
            "payload_secret",
            cfg.payload_secret == cfg.payload_secret.strip(),
            "must not start or end with whitespace (from a file, the environment or a "
            "keyword alike: a stray space or newline would change the key)",
        )
    _validate_extra(cfg.extra_config)
    object.__setattr__(cfg, "extra_config", copy.deepcopy(cfg.extra_config))


def _require(cfg: RayKVConfig, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise _fail(name, getattr(cfg, name), allowed)


def _validate_sizes(cfg: RayKVConfig) -> None:
    if cfg.local_cpu:
        _require(
            cfg,
            "max_local_cpu_size",
            cfg.max_local_cpu_size > 0,
            "must be > 0 GB when local_cpu is true",
        )
    else:
        _require(cfg, "max_local_cpu_size", cfg.max_local_cpu_size >= 0, "must be >= 0 GB")
    if cfg.local_disk is not None:
        _require(
            cfg,
            "max_local_disk_size",
            cfg.max_local_disk_size > 0,
            "must be > 0 GB when local_disk is set",
        )
    else:
        _require(cfg, "max_local_disk_size", cfg.max_local_disk_size >= 0, "must be >= 0 GB")
    is_ray = cfg.remote_url is not None and cfg.remote_url.startswith("ray://")
    if is_ray:
        _require(
            cfg,
            "max_remote_size",
            cfg.max_remote_size > 0,
            "must be > 0 GB with a ray:// remote_url",
        )
    else:
        _require(cfg, "max_remote_size", cfg.max_remote_size >= 0, "must be >= 0 GB")


def _validate_kv_server_resources(cfg: RayKVConfig) -> None:
    """A custom resource name, or ``{name: amount}`` (amounts stored as floats), or null."""
    value = cfg.kv_server_resources
    allowed = (
        "must be a custom resource name, a non-empty mapping of resource names to amounts"
        f" >= {_MIN_RESOURCE_AMOUNT}, or null; names are non-empty and not"
        f" {' or '.join(sorted(_RAY_RESERVED_RESOURCES))}"
    )
    if value is None:
        return
    if isinstance(value, str):
        names = [value]
    elif isinstance(value, dict) and value:
        names = list(value)
        amounts = list(value.values())
        for amount in amounts:
            if isinstance(amount, bool) or not isinstance(amount, int | float):
                raise _fail("kv_server_resources", value, allowed)
            if not (math.isfinite(amount) and amount >= _MIN_RESOURCE_AMOUNT):
                raise _fail("kv_server_resources", value, allowed)
    else:
        raise _fail("kv_server_resources", value, allowed)
    for name in names:
        if not isinstance(name, str) or not name.strip() or name in _RAY_RESERVED_RESOURCES:
            raise _fail("kv_server_resources", value, allowed)
    if isinstance(value, dict):
        object.__setattr__(cfg, "kv_server_resources", {k: float(v) for k, v in value.items()})


def _refuse_fields_in_extra(cfg: RayKVConfig) -> None:
    """A field's name in ``extra_config`` is a ConfigError: extensions read extra_config,
    raykv never does, so the setting would be silently ignored."""
    extra = cfg.extra_config
    if not isinstance(extra, dict):
        return  # the type check reports it
    fields = sorted(set(extra) & set(FIELD_NAMES))
    if fields:
        key = fields[0]
        raise _fail(
            "extra_config",
            extra,
            f"no field names as keys: {key} is a field; set {key} (or {env_name(key)}), "
            f"not extra_config[{key!r}]",
        )


def _validate_local_disk(cfg: RayKVConfig) -> None:
    """Normalise local_disk to an absolute plain path (``file:///x`` -> ``/x``)."""
    raw = cfg.local_disk
    if raw is None:
        return
    path = raw
    if _URL_RE.match(raw):
        parts = urlsplit(raw)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not parts.path:
            raise _fail("local_disk", raw, "must be a directory path or a file:///path URL")
        path = unquote(parts.path)
    if not path.strip():
        raise _fail("local_disk", raw, "must be a non-empty directory path (or null to disable)")
    # Absolute, so Ray actors with another working directory find the same directory.
    object.__setattr__(cfg, "local_disk", os.path.abspath(os.path.expanduser(path)))


def _validate_remote_url(url: str) -> None:
    allowed = "allowed: ray://NAME, redis://[[user]:password@]host[:port][/db], rediss://..."
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme == "ray":
        name = url[len("ray://") :]
        if not _NAME_RE.match(name):
            raise _fail(
                "remote_url",
                url,
                f"ray:// needs an actor name of letters, digits, '_.-'; {allowed}",
            )
        return
    if scheme not in ("redis", "rediss"):
        raise _fail("remote_url", url, f"unknown scheme {scheme or '(none)'!r}; {allowed}")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise _fail("remote_url", url, f"host or port does not parse; {allowed}") from None
    if not host:
        raise _fail("remote_url", url, f"missing host; {allowed}")
    if port is not None and port == 0:
        raise _fail("remote_url", url, f"port must be 1-65535; {allowed}")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise _fail("remote_url", url, f"db must be a non-negative integer; {allowed}")
    if parts.fragment:
        raise _fail("remote_url", url, f"a fragment ('#...') is not allowed; {allowed}")


def _known_policies() -> list[str]:
    from raykv.policies import known_policies  # lazily: policies import this module's errors

    return known_policies()


def _validate_policy(name: str, value: str) -> None:
    if _CLASS_PATH_RE.match(value):
        # An out-of-tree policy: import it now so a typo fails at load, not inside an actor.
        from raykv.policies import policy_class

        try:
            policy_class(value)
        except ConfigError as exc:
            raise _fail(name, value, str(exc)) from None
        return
    known = _known_policies()
    # Same normalisation as the policy registry, so "S3-FIFO" is "s3fifo".
    normalised = value.strip().lower().replace("-", "").replace("_", "")
    if normalised in known:
        return
    hint = _suggest(normalised, tuple(known)).lstrip("; ")
    raise _fail(
        name,
        value,
        f"unknown policy; allowed (any case, '-'/'_' ignored): {', '.join(known)} or 'module:Class'"
        + (f"; {hint}" if hint else ""),
    )


def _validate_extra(extra: dict[str, Any]) -> None:
    def plain(value: Any) -> bool:
        if value is None or isinstance(value, bool | int | float | str):
            return True
        if isinstance(value, list):  # not tuple: YAML would read it back as a list
            return all(plain(v) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        return False

    if not plain(extra):
        raise _fail(
            "extra_config",
            extra,
            "must be a mapping with string keys and plain YAML values"
            " (str, number, bool, null, list, mapping)",
        )


# ----- YAML and env layers -----


def _layer(values: Mapping[Any, Any], source: str) -> _Layer:
    return [(key, value, source) for key, value in values.items()]


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key written twice (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader reports unhashable keys itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of a YAML config file (an empty file is an empty mapping)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not UTF-8 text") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        # Only the problem and position: the YAML snippet could contain a password.
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(f"invalid YAML in config file {path!r} at {where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in config file {path!r}: {type(exc).__name__}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path!r} must hold a mapping of keys to values at the top level, "
            f"got {type(data).__name__}"
        )
    return data


def _env_layer(environ: Mapping[str, str]) -> _Layer:
    """Field values from ``RAYKV_<KEY>`` variables; unknown ``RAYKV_*`` names are logged."""
    by_env = {env_name(name): name for name in FIELD_NAMES}
    layer: _Layer = []
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var == CONFIG_FILE_ENV:
            continue
        key = by_env.get(var)
        if key is None:
            logger.warning(
                "ignoring unknown environment variable %s%s", var, _suggest(var, tuple(by_env))
            )
            continue
        layer.append((key, _parse_env(key, var, environ[var]), f"env {var}"))
    return layer


def _parse_env(key: str, var: str, text: str) -> Any:
    """Parse one env value with the field's type; errors name the variable."""
    base, optional = _field_types()[key]
    if key in SECRET_FIELDS:
        # Never turned off (or trimmed) by the environment: an empty or null value is a
        # mistake that would silently accept forgeable records; whitespace is checked,
        # as for a file's value, in validation.
        if text.strip().lower() in _NULL:
            raise ConfigError(
                f"{var} is set but empty or null: a secret cannot be turned off from the "
                f"environment (unset {var} to use the file's {key}, or give the secret)"
            )
        return text
    s = text.strip()
    if optional and s.lower() in _NULL:
        return None
    if key == "kv_server_resources" and s.startswith("{"):
        base = dict  # a resource name, or a {name: amount} mapping
    try:
        if base is bool:
            if s.lower() in _TRUE:
                return True
            if s.lower() in _FALSE:
                return False
            raise ValueError
        if base is int:
            return int(s)
        if base is float:
            return float(s)
        if base is dict:
            value = yaml.safe_load(s) if s else {}
            if not isinstance(value, dict):
                raise ValueError
            return value
    except (ValueError, yaml.YAMLError):
        allowed = {
            bool: "true/false, 1/0, yes/no or on/off",
            int: "an integer",
            float: "a number",
            dict: 'a YAML/JSON mapping such as {"a": 1}',
        }[base]
        null = " (or null/none/empty)" if optional else ""
        raise ConfigError(
            f"invalid {var}={_show(text)} for {key}: expected {allowed}{null}"
        ) from None
    return s


__all__ = [
    "GB",
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "FIELD_NAMES",
    "KNOWN_SERDES",
    "KV_DTYPES",
    "TIERS",
    "RayKVConfig",
    "env_name",
    "mask_url",
]
