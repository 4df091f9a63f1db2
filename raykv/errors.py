"""Exceptions raised by raykv.

A cache miss is a return value, never an exception. These errors are for input
that cannot be right (bad config, malformed payloads, wrong shapes) and for
explicit waits that ran out of time.
"""

from __future__ import annotations


class RayKVError(Exception):
    """Base class of every error raykv raises on purpose."""


class ConfigError(RayKVError, ValueError):
    """A configuration key or value is invalid; the message names key, value and what is allowed."""


class PayloadError(RayKVError, ValueError):
    """Bytes or a tensor are not a valid KV chunk payload (bad header, checksum, shape or dtype)."""


class InvalidInputError(RayKVError, ValueError):
    """A caller passed arguments of the wrong kind, shape or length."""


__all__ = [
    "RayKVError",
    "ConfigError",
    "PayloadError",
    "InvalidInputError",
]
