"""Eviction policies behind one protocol, looked up by name.

``make_policy("s3fifo", capacity=1000)`` builds a policy; names are
case-insensitive (``S3-FIFO`` works too). ``module.path:ClassName`` names an
out-of-tree class taking ``(capacity, **params)``. Classes load lazily.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from raykv.errors import ConfigError
from raykv.policies.base import BasePolicy, Policy, replay, touch_prefix

# name -> (module, class): loaded on first use, so importing raykv stays cheap.
_REGISTRY: dict[str, tuple[str, str]] = {
    "arc": ("raykv.policies.arc", "ARCPolicy"),
    "clock": ("raykv.policies.clock", "ClockPolicy"),
    "fifo": ("raykv.policies.fifo", "FIFOPolicy"),
    "filo": ("raykv.policies.filo", "FILOPolicy"),
    "lfu": ("raykv.policies.lfu", "LFUPolicy"),
    "lru": ("raykv.policies.lru", "LRUPolicy"),
    "mru": ("raykv.policies.mru", "MRUPolicy"),
    "priority": ("raykv.policies.priority", "PriorityPolicy"),
    "s3fifo": ("raykv.policies.s3fifo", "S3FIFOPolicy"),
    "sieve": ("raykv.policies.sieve", "SIEVEPolicy"),
    "slru": ("raykv.policies.slru", "SLRUPolicy"),
}
_CLASSES = {cls: (module, cls) for module, cls in _REGISTRY.values()}
DEFAULT_POLICY = "lru"


def known_policies() -> list[str]:
    """The registered policy names, sorted and lower-case."""
    return sorted(_REGISTRY)


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


def policy_class(name: str) -> type:
    """The class registered under ``name`` (or named ``module:Class``)."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"policy name {name!r} is invalid; known: {', '.join(known_policies())}")
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"policy {name!r} cannot be loaded ({exc}); use 'module.path:ClassName' "
                f"or one of: {', '.join(known_policies())}"
            ) from None
        if not isinstance(cls, type):
            raise ConfigError(f"policy {name!r} is not a class")
        return cls
    entry = _REGISTRY.get(_normalise(name))
    if entry is None:
        raise ConfigError(
            f"unknown policy {name!r}; known: {', '.join(known_policies())} "
            "(or 'module.path:ClassName')"
        )
    return getattr(importlib.import_module(entry[0]), entry[1])


def make_policy(name: str, capacity: int, **params: Any) -> Policy:
    """Build the policy ``name`` sized for ``capacity`` objects."""
    cls = policy_class(name)
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # not introspectable: let the call report itself
        signature = None
    if signature is not None:
        try:
            signature.bind(capacity, **params)
        except TypeError as exc:
            raise ConfigError(f"policy {name!r}: bad parameters {params!r} ({exc})") from None
    return cls(capacity, **params)


def __getattr__(attr: str) -> Any:
    if attr in _CLASSES:
        module, cls = _CLASSES[attr]
        return getattr(importlib.import_module(module), cls)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = [
    "DEFAULT_POLICY",
    "BasePolicy",
    "Policy",
    "known_policies",
    "make_policy",
    "policy_class",
    "replay",
    "touch_prefix",
    *sorted(_CLASSES),
]
