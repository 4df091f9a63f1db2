"""One circuit breaker per remote server, shared by everything in a process that calls it.

A remote (a Redis server, a `ray://` KV server) that fails or times out must cost hits,
never the lookup: after a failure, calls are skipped (a miss at once) for a back-off
that starts at `BACKOFF_MIN_S` (0.1 s) and doubles up to `BACKOFF_MAX_S` (2 s); then
one trial call is let through (half-open) and its outcome closes the breaker or backs
off again.

Every caller in a process (the manager's lookup probe, the remote tier's store, a
client's own probe) asks the breaker of its remote (`breaker_for(url)`): one failure is
learnt once, on one schedule, and a re-created client object (the manager drops and
re-opens its probe after a resync) keeps what its predecessor learnt.

Thread contract: `admit` and `settle` may be called from any thread (the manager's Ray
threads probe a `ray://` server while its event loop probes too); a lock guards the
state, never held across a call to the server.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0


class Breaker:
    """The state of calls to one remote server: closed (calls go through), open (calls
    are skipped until `retry_at`), half-open (one trial call in flight)."""

    def __init__(self, name: str) -> None:
        self.name = name  # for logs: a URL with its secrets masked
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._retry_at = 0.0
        self._trial = False
        self.failures = 0
        self.skipped = 0

    @property
    def closed(self) -> bool:
        """Whether calls go through now (no failure since the last success)."""
        return not self._backoff

    def ready(self) -> bool:
        """Whether `admit` would let a call through now (without admitting it)."""
        with self._lock:
            return not self._backoff or (not self._trial and time.monotonic() >= self._retry_at)

    def admit(self) -> bool | None:
        """Before a call: None to skip it (open, or the half-open trial is in flight),
        else whether this call is the trial. Every admitted call must be `settle`d."""
        with self._lock:
            if not self._backoff:
                return False
            if self._trial or time.monotonic() < self._retry_at:
                self.skipped += 1
                return None
            self._trial = True
            return True

    def settle(self, trial: bool, error: BaseException | None = None) -> bool:
        """After an admitted call: its success, or its failure `error`. Returns whether
        the breaker changed state (closed after failing, or opened), for the caller to
        log once."""
        with self._lock:
            if trial:
                self._trial = False
            if error is None:
                changed = bool(self._backoff)
                self._backoff = 0.0
                return changed
            self.failures += 1
            opened = not self._backoff
            self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, 2 * self._backoff))
            self._retry_at = time.monotonic() + self._backoff
            return opened

    def cancel(self, trial: bool) -> None:
        """An admitted call that was cancelled before it could tell: neither outcome."""
        if trial:
            with self._lock:
                self._trial = False

    @property
    def backoff_s(self) -> float:
        """The current back-off (0 when closed)."""
        return self._backoff


# Errors that say the server cannot be reached (by class name anywhere in the exception's
# MRO, so neither redis-py nor Ray is imported here): those open the breaker. Others (a
# full Redis refusing writes, a batch whose owner died, a command the server refused)
# cost that call only: the server answered, and its reads go on.
_OUTAGES = frozenset(
    ("ConnectionError", "TimeoutError", "RayActorError", "GetTimeoutError", "OSError")
)


def is_outage(error: BaseException) -> bool:
    """Whether `error` says the remote cannot be reached (see `_OUTAGES`)."""
    return any(cls.__name__ in _OUTAGES for cls in type(error).__mro__)


_breakers: dict[tuple[str, str], Breaker] = {}
_registry_lock = threading.Lock()


def breaker_for(remote: str, scope: str = "") -> Breaker:
    """This process's breaker for the remote named `remote` (its URL, secrets masked);
    `scope` tells apart remotes of one name in different places (a `ray://` server's
    Ray namespace)."""
    with _registry_lock:
        breaker = _breakers.get((scope, remote))
        if breaker is None:
            breaker = _breakers[scope, remote] = Breaker(remote)
        return breaker


__all__ = ["BACKOFF_MAX_S", "BACKOFF_MIN_S", "Breaker", "breaker_for", "is_outage"]
