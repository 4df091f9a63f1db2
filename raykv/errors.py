"""Exceptions raised by raykv.

A cache miss is a return value, never an exception. These errors are for input
that cannot be right (bad config, malformed payloads, wrong shapes) and for
explicit waits that ran out of time.
"""

from __future__ import annotations

import math


class RayKVError(Exception):
    """Base class of every error raykv raises on purpose."""


class ConfigError(RayKVError, ValueError):
    """A configuration key or value is invalid; the message names key, value and what is allowed."""


class PayloadError(RayKVError, ValueError):
    """Bytes or a tensor are not a valid KV chunk payload (bad header, checksum, shape or dtype)."""


class InvalidInputError(RayKVError, ValueError):
    """A caller passed arguments of the wrong kind, shape or length."""


def check_timeout(timeout: float | None) -> None:
    """Raise `InvalidInputError` unless `timeout` is None or a finite number >= 0."""
    if timeout is not None and (
        not isinstance(timeout, (int, float))
        or isinstance(timeout, bool)
        or not math.isfinite(timeout)  # NaN or inf would make Ray's own timeout raise
        or timeout < 0
    ):
        raise InvalidInputError(f"timeout must be a finite number >= 0 or None, got {timeout!r}")


__all__ = [
    "RayKVError",
    "ConfigError",
    "PayloadError",
    "InvalidInputError",
    "check_timeout",
]
