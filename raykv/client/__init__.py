"""The client: what a serving process holds (`raykv.connect()` -> `KVCache`).

`kvcache` has the verbs and the manager calls, `layout` the checks and copies of the KV,
`staging` the ring a background store copies into, `readcache` the batches read lately,
`probe` a lookup's own question to a `ray://` server. Nothing here runs in an actor.
Names load lazily: importing one part (say `staging`) does not import torch or Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "KVCache": "raykv.client.kvcache",
    "attach_ray": "raykv.client.attach",
    "connect": "raykv.client.kvcache",
    "KVLayout": "raykv.client.layout",
    "KVTarget": "raykv.client.layout",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'raykv.client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
