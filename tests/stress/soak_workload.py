"""The soak workload shared by the stress tests: N client threads on a mixed, verified workload.

Every chunk's bytes are a function of its `CacheKey` (and the key is the chained hash of
the whole prefix), so every hit is checked byte for byte against what must be there. A
client never catches raykv's exceptions for it: an exception is an error surfaced to a
client and is counted (the tests require 0); a wrong byte is counted too (must be 0).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

import raykv
from raykv.wire import PackedSpans

C = 16  # tokens per chunk
LAYERS, HIDDEN = 2, 64
CHUNK_BYTES = 2 * LAYERS * C * HIDDEN * 2  # float16: 8 KiB a chunk
VOCAB = 50_000
OPS = ("store", "lookup", "prefetch", "retrieve", "pinned", "abandon")
# Weights of the ops above; "abandon" is a client that pins and never comes back.
OP_WEIGHTS = (0.30, 0.15, 0.20, 0.25, 0.08, 0.02)


def zipf_weights(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    return w / w.sum()


@dataclass(frozen=True)
class Corpus:
    """Zipf-popular shared documents (1-6 chunks) x Zipf-popular user suffixes (1-2 chunks)."""

    n_docs: int = 64
    n_suffixes: int = 8
    zipf_a: float = 1.1
    seed: int = 0

    def doc(self, d: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, 1, d))
        return rng.integers(0, VOCAB, C * int(rng.integers(1, 7)))

    def suffix(self, d: int, s: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, 2, d, s))
        return rng.integers(0, VOCAB, C * int(rng.integers(1, 3)))

    def prompt(self, rng: np.random.Generator) -> np.ndarray:
        d = int(rng.choice(self.n_docs, p=zipf_weights(self.n_docs, self.zipf_a)))
        s = int(rng.choice(self.n_suffixes, p=zipf_weights(self.n_suffixes, self.zipf_a)))
        tail = rng.integers(0, VOCAB, int(rng.integers(0, C)))  # a partial chunk: never stored
        return np.concatenate([self.doc(d), self.suffix(d, s), tail])

    def working_set_bytes(self) -> int:
        chunks = sum(len(self.doc(d)) // C for d in range(self.n_docs))
        chunks += sum(
            len(self.suffix(d, s)) // C for d in range(self.n_docs) for s in range(self.n_suffixes)
        )
        return chunks * CHUNK_BYTES


def chunk_bytes(key: Any) -> np.ndarray:
    """The only correct bytes of the chunk under `key` (a function of the whole prefix)."""
    seed = np.frombuffer(bytes.fromhex(key.chunk_hash), dtype=np.uint64)
    return np.random.default_rng(seed).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)


def chunk_tensor(key: Any) -> torch.Tensor:
    return torch.from_numpy(chunk_bytes(key)).view(torch.float16).view(2, LAYERS, C, HIDDEN)


@dataclass
class Counters:
    """What the clients did and saw; mutated under `Workload.lock`."""

    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    latency_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    hit_chunks: int = 0  # chunks retrieved and verified
    miss_chunks: int = 0  # chunks of a retrieve that were not a hit
    lookup_hit_tokens: int = 0
    lookup_miss_tokens: int = 0
    stored_tokens: int = 0
    wrong_chunks: int = 0
    errors: list[str] = field(default_factory=list)
    abandoned_pins: int = 0
    last_hit: float = 0.0  # monotonic time of the last retrieve with a verified hit

    def snapshot(self) -> dict[str, Any]:
        return {
            "ops": sum(self.ops.values()),
            "hit_chunks": self.hit_chunks,
            "miss_chunks": self.miss_chunks,
            "wrong_chunks": self.wrong_chunks,
            "errors": len(self.errors),
        }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Workload:
    """`n_clients` threads, each with its own `raykv.connect`, running the mixed workload."""

    def __init__(
        self,
        connect_kwargs: dict[str, Any],
        n_clients: int = 8,
        corpus: Corpus | None = None,
        seed: int = 0,
    ) -> None:
        self.connect_kwargs = connect_kwargs
        self.n_clients = n_clients
        self.corpus = corpus or Corpus()
        self.seed = seed
        self.lock = threading.Lock()
        self.c = Counters()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ----- lifecycle -----

    def start(self) -> None:
        for i in range(self.n_clients):
            t = threading.Thread(target=self._client, args=(i,), name=f"soak-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"client threads hung: {alive}"

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return self.c.snapshot()

    # ----- one client -----

    def _client(self, i: int) -> None:
        rng = np.random.default_rng((self.seed, 100, i))
        try:
            kv = raykv.connect(**self.connect_kwargs)
        except Exception:
            self._error("connect", traceback.format_exc())
            return
        try:
            while not self._stop.is_set():
                op = OPS[int(rng.choice(len(OPS), p=OP_WEIGHTS))]
                tokens = self.corpus.prompt(rng)
                t0 = time.perf_counter()
                try:
                    getattr(self, f"_op_{op}")(kv, tokens)
                except Exception:
                    self._error(op, traceback.format_exc())
                dt = (time.perf_counter() - t0) * 1000
                with self.lock:
                    self.c.ops[op] += 1
                    self.c.latency_ms[op].append(dt)
        finally:
            try:
                kv.close()
            except Exception:
                self._error("close", traceback.format_exc())

    def _error(self, op: str, text: str) -> None:
        with self.lock:
            self.c.errors.append(f"{op}: {text}")

    def _op_store(self, kv: Any, tokens: np.ndarray) -> None:
        spans = kv.spans(tokens)
        stored = kv.store(tokens, [chunk_tensor(s.key) for s in spans])
        with self.lock:
            self.c.stored_tokens += stored

    def _op_lookup(self, kv: Any, tokens: np.ndarray) -> None:
        spans = kv.spans(tokens)
        hit = kv.lookup(tokens)
        ends = {0, *(s.end for s in spans)}
        if hit not in ends:
            self._error("lookup", f"lookup returned {hit}, not a chunk boundary of {sorted(ends)}")
        with self.lock:
            self.c.lookup_hit_tokens += hit
            self.c.lookup_miss_tokens += (spans[-1].end if spans else 0) - hit

    def _op_prefetch(self, kv: Any, tokens: np.ndarray) -> None:
        lookup_id = kv.prefetch(tokens)
        kv.wait(lookup_id, timeout=2.0)
        self._retrieve(kv, tokens, lookup_id)

    def _op_retrieve(self, kv: Any, tokens: np.ndarray) -> None:
        self._retrieve(kv, tokens, None)

    def _op_pinned(self, kv: Any, tokens: np.ndarray) -> None:
        kv.lookup(tokens, pin=True)
        self._retrieve(kv, tokens, None)

    def _op_abandon(self, kv: Any, tokens: np.ndarray) -> None:
        """A client that pins and dies: only the lease can release these pins."""
        spans = kv.spans(tokens)
        if spans:
            kv._call(
                "lookup",
                PackedSpans.of(spans),
                True,
                None,
                uuid.uuid4().hex,
                timeout=kv._lookup_timeout,
                default=0,
            )
            with self.lock:
                self.c.abandoned_pins += 1

    def _retrieve(self, kv: Any, tokens: np.ndarray, lookup_id: str | None) -> None:
        spans = kv.spans(tokens)
        dest = torch.zeros(2, LAYERS, len(tokens), HIDDEN, dtype=torch.float16)
        mask = kv.retrieve(tokens, dest, lookup_id=lookup_id)
        n_hit = int(mask.sum())
        hit_chunks = wrong = 0
        if n_hit and (not mask[:n_hit].all() or n_hit not in {s.end for s in spans}):
            wrong += 1  # a hit mask that is not a prefix of whole chunks
        got = dest.view(torch.int16)
        for span in spans:
            if span.end > n_hit:
                break
            want = chunk_tensor(span.key).view(torch.int16)
            if torch.equal(got[:, :, span.start : span.end], want):
                hit_chunks += 1
            else:
                wrong += 1
        if got[:, :, n_hit:].any():
            wrong += 1  # bytes written outside the hit mask
        with self.lock:
            self.c.hit_chunks += hit_chunks
            self.c.miss_chunks += len(spans) - hit_chunks
            self.c.wrong_chunks += wrong
            if hit_chunks:
                self.c.last_hit = time.monotonic()

    # ----- reporting -----

    def report(self, title: str, seconds: float) -> str:
        with self.lock:
            c = self.c
            lines = [
                f"== {title}: {self.n_clients} clients, {seconds:.0f} s ==",
                f"ops={sum(c.ops.values())} ({sum(c.ops.values()) / seconds:.0f}/s) "
                f"retrieve hit chunks={c.hit_chunks} miss chunks={c.miss_chunks} "
                f"lookup hit/miss tokens={c.lookup_hit_tokens}/{c.lookup_miss_tokens} "
                f"stored tokens={c.stored_tokens} abandoned pins={c.abandoned_pins}",
                f"wrong chunks={c.wrong_chunks} client errors={len(c.errors)}",
            ]
            for op in OPS:
                lat = c.latency_ms.get(op, [])
                lines.append(
                    f"  {op:9s} n={len(lat):6d} p50={percentile(lat, 50):7.2f} ms "
                    f"p99={percentile(lat, 99):8.2f} ms"
                )
        return "\n".join(lines)


# ----- fault helpers -----


def actor_pid(handle: Any) -> int:
    """The PID of a live actor (from the GCS; works with the dashboard off)."""
    info = ray._private.state.actors(handle._actor_id.hex())
    return int(info["Pid"])


def sigkill_actor(handle: Any, class_name: str) -> int:
    """SIGKILL the process of `handle` by PID, after checking it is that actor's worker."""
    pid = actor_pid(handle)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    assert cmdline.startswith(f"ray::{class_name}"), f"pid {pid} is {cmdline[:60]!r}"
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_until(pred: Callable[[], bool], timeout: float, every: float = 0.2) -> float | None:
    """Seconds until `pred()` is true (exceptions count as false); None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if pred():
                return time.monotonic() - t0
        except Exception:
            pass
        time.sleep(every)
    return None
