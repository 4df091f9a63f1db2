"""Secrets kept out of what raykv shows: URLs with their passwords masked, the secrets a
URL carries (what a log line must never show), and `extra_config` for display."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

MASK = "***"

_QUERY_ARG = re.compile(r"([?&;])([^=&;#]*)=([^&;#]*)")


def _names_a_secret(name: str) -> bool:
    """A setting or query argument name that carries a secret, however it is spelt or
    percent-encoded (`password`, `ssl_password`, `%70assword`, `client_secret`,
    `api_token`, ...)."""
    low = unquote(name).lower()
    return any(word in low for word in ("pass", "secret", "token")) or low in ("pwd", "auth")


def _authority(url: str) -> tuple[str, str, str]:
    """(scheme://, authority, the rest) of `url`; ("", "", url) without a scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "", "", url
    cut = min(
        (i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest)
    )
    return scheme + sep, rest[:cut], rest[cut:]


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***``: the user info's, and the value of
    every query argument whose (percent-decoded) name names a secret (redis-py accepts
    ``?password=`` and ``?ssl_password=``). User names stay visible."""
    url = _QUERY_ARG.sub(lambda m: f"{m[1]}{m[2]}={MASK}" if _names_a_secret(m[2]) else m[0], url)
    head, authority, tail = _authority(url)
    if "@" not in authority:
        return url
    userinfo, _, host = authority.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    masked = f"{user}:{MASK}" if colon else MASK
    return f"{head}{masked}@{host}{tail}"


def url_secrets(url: str) -> list[str]:
    """Every secret `url` carries, raw and percent-decoded (the user info's password and
    secret-named query values), longest first: what a log line must never show."""
    found: set[str] = set()
    _, authority, _ = _authority(url)
    if "@" in authority:
        user, colon, password = authority.rpartition("@")[0].partition(":")
        found.update((password, unquote(password)) if colon else (user, unquote(user)))
    for m in _QUERY_ARG.finditer(url):
        if _names_a_secret(m[2]):
            found.update((m[3], unquote(m[3])))
    return sorted((s for s in found if s), key=len, reverse=True)


def mask_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra_config` for display: values under keys that name a secret are masked."""
    return {k: (MASK if isinstance(k, str) and _names_a_secret(k) else v) for k, v in extra.items()}


__all__ = ["MASK", "mask_extra", "mask_url", "url_secrets"]
