"""A client's own question to the `ray://` server, sent beside its manager's lookup.

A lookup whose prefix runs past what the manager's index knows (chunks another instance
wrote to the shared server) costs two round trips when the manager asks the server
after its own answer: client -> manager -> server -> manager -> client. With config
`client_remote_probe` (on by default) the client sends the manager's `lookup_local`
and the server's `contains` at the same time and joins the two answers: one round
trip, at the price of one small call to the server per lookup (also when the local
tiers hold the whole prefix; the manager asks the server for every other lookup
anyway).

A server that fails or does not answer in time costs the remote's hits, never the
lookup: this process's circuit breaker of the server opens (`raykv.tiers.breaker`) and
the manager asks the server, behind its own process's breaker, until the half-open
trial succeeds.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from raykv.client.staging import SerialWorker
from raykv.tiers.breaker import breaker_for

logger = logging.getLogger(__name__)


class ServerProbe:
    """`contains` calls from this client to the `KVServer` named `name` in `namespace`."""

    def __init__(self, name: str, namespace: str) -> None:
        self.name = name
        self.namespace = namespace
        self._server: Any = None  # resolved on first use, again after a failure
        self.breaker = breaker_for(f"ray://{name}", namespace)
        self.sent = 0
        self.failed = 0
        # What the client tells the manager after a probe (`note_remote`), sent from a
        # thread of its own: submitting a call costs ~0.05-0.15 ms of Python (argument
        # serialization), which a lookup should not wait for.
        self.notes = SerialWorker(f"raykv-notes-{namespace}")

    def ready(self) -> bool:
        """Whether `send` would ask the server (False while its breaker is open)."""
        return self.breaker.ready()

    def send(self, keys_wire: bytes) -> tuple[ray.ObjectRef, bool] | None:
        """Ask the server which keys it holds (a `PackedSpans` or `PackedKeys` `wire()`):
        the reply's ref and whether it is the breaker's trial (pass both to `answer`), or
        None while the breaker is open or when the server cannot be reached."""
        trial = self.breaker.admit()
        if trial is None:
            return None
        try:
            if self._server is None:
                from raykv.actors.common import check_actor_class
                from raykv.actors.kv_server import KVServer

                server = ray.get_actor(self.name, namespace=self.namespace)
                self._server = check_actor_class(server, KVServer, self.name, self.namespace)
            ref = self._server.contains.remote(keys_wire)
        except Exception as exc:  # no such actor yet, Ray going away: the manager asks
            self._fail(trial, exc)
            return None
        self.sent += 1
        return ref, trial

    def answer(
        self, sent: tuple[ray.ObjectRef, bool], n_keys: int, timeout: float
    ) -> list[bool] | None:
        """The server's answer to `send` (one bool per key), or None if it failed, came
        too late or is malformed (then the breaker opens)."""
        ref, trial = sent
        try:
            found = ray.get(ref, timeout=max(timeout, 0.0))
        except Exception as exc:  # a timeout, a dead or restarting server
            self._fail(trial, exc)
            return None
        if not isinstance(found, list) or len(found) != n_keys:
            bad = ValueError(f"contains answered {type(found).__name__}, not {n_keys} bools")
            self._fail(trial, bad)
            return None
        if self.breaker.settle(trial):
            logger.info("raykv: ray://%s answers this client's lookups again", self.name)
        return found

    def drop(self, sent: tuple[ray.ObjectRef, bool] | None) -> None:
        """A `send` whose answer is not needed after all: neither outcome for the breaker
        (a dropped trial lets the next call try again)."""
        if sent is not None:
            self.breaker.cancel(sent[1])

    def _fail(self, trial: bool, exc: BaseException) -> None:
        self.failed += 1
        self._server = None  # a restarted server is a new actor: look it up again
        log = logger.warning if self.breaker.settle(trial, exc) else logger.debug
        log(
            "raykv: this client's probe of ray://%s failed (%s: %s); the manager asks it "
            "for the next %.1f s",
            self.name,
            type(exc).__name__,
            exc,
            self.breaker.backoff_s,
        )

    def stats(self) -> dict[str, int]:
        return {"remote_probes_sent": self.sent, "remote_probes_failed": self.failed}


__all__ = ["ServerProbe"]
