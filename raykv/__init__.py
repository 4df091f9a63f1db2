"""raykv: a tiered KV cache for LLM serving, built on Ray.

Only the names in `__all__` are public; everything else may change.
"""

from __future__ import annotations

from raykv.actors.gpu_worker import create_gpu_worker
from raykv.config import RayKVConfig
from raykv.connector import GPUConnector
from raykv.engine import KVCache, KVTarget, connect
from raykv.errors import (
    ConfigError,
    InvalidInputError,
    PayloadError,
    RayKVError,
    RayKVTimeout,
    TierUnavailableError,
)
from raykv.keys import CacheKey, ChunkSpan, KeyMaker
from raykv.model import save_demo_model
from raykv.payload import PayloadMeta

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "connect",
    "create_gpu_worker",
    "KVCache",
    "KVTarget",
    "GPUConnector",
    "RayKVConfig",
    "CacheKey",
    "ChunkSpan",
    "KeyMaker",
    "PayloadMeta",
    "save_demo_model",
    "RayKVError",
    "ConfigError",
    "PayloadError",
    "InvalidInputError",
    "TierUnavailableError",
    "RayKVTimeout",
]
