"""raykv: a tiered KV cache for LLM serving, built on Ray.

Only the names in `__all__` are public; everything else may change. Attributes load on
first use, so `import raykv` (and `raykv --version`) imports neither torch nor ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it (imported on first access).
_LAZY: dict[str, str] = {
    "connect": "raykv.client.kvcache",
    "KVCache": "raykv.client.kvcache",
    "KVTarget": "raykv.client.layout",
    "GPUConnector": "raykv.connector",
    "PageConnector": "raykv.page_connector",
    "RayKVConfig": "raykv.config",
    "shutdown_namespace": "raykv.actors.factory",
    "CacheKey": "raykv.keys",
    "ChunkSpan": "raykv.keys",
    "KeyMaker": "raykv.keys",
    "PayloadMeta": "raykv.payload",
    "RayKVError": "raykv.errors",
    "ConfigError": "raykv.errors",
    "PayloadError": "raykv.errors",
    "InvalidInputError": "raykv.errors",
}

__all__ = [
    "__version__",
    "connect",
    "KVCache",
    "KVTarget",
    "GPUConnector",
    "PageConnector",
    "RayKVConfig",
    "shutdown_namespace",
    "CacheKey",
    "ChunkSpan",
    "KeyMaker",
    "PayloadMeta",
    "RayKVError",
    "ConfigError",
    "PayloadError",
    "InvalidInputError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'raykv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from raykv.actors.factory import shutdown_namespace
    from raykv.client.kvcache import KVCache, connect
    from raykv.client.layout import KVTarget
    from raykv.config import RayKVConfig
    from raykv.connector import GPUConnector
    from raykv.errors import (
        ConfigError,
        InvalidInputError,
        PayloadError,
        RayKVError,
    )
    from raykv.keys import CacheKey, ChunkSpan, KeyMaker
    from raykv.page_connector import PageConnector
    from raykv.payload import PayloadMeta
