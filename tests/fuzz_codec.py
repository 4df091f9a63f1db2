"""A bounded, seeded mutation fuzzer for the codec and the two read paths that decode it.

Targets (one input each, in turn):

* ``codec``: ``payload.read_header`` and ``payload.decode`` on the mutated bytes;
* ``disk``: a ``DiskStore`` (temp dir, reads on the caller's thread) whose chunk file was
  overwritten with the mutated bytes, half the time padded or cut back to the size the
  index recorded so the read gets past the size check into the decoder;
* ``redis``: ``RedisBackend.get_batch`` with its client replaced by an in-process fake
  (no server), so the backend's own decode-and-delete path runs on the mutated value.

Mutations: bit flips, truncation, extension, header field overwrites with extreme values
(sizes, ndim, key length, dtype/layout/serde codes, shape; half of them with a re-forged
header checksum, as a hostile writer would), and random bytes.

Allowed outcomes: a decode whose body matches its checksum (``ok``; ``ok_forged`` when a
forged header changed the metadata), a ``PayloadError`` (codec) or a miss (disk, redis).
Anything else is ``unexpected``: another exception, a hit with wrong bytes, a miss that
left a bad file or value behind, an input over the time limit (``hang``; SIGALRM when run
on the main thread) or one that allocated more than the memory bound (numpy data is
tracked by ``tracemalloc``). Run: ``python tests/fuzz_codec.py --seconds 10 --seed 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import struct
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from raykv.config import RayKVConfig
from raykv.errors import PayloadError
from raykv.keys import CacheKey, make_key
from raykv.payload import ForeignRecordError, PayloadMeta, decode, encode, read_header
from raykv.tiers.disk import DiskStore
from raykv.tiers.remote import RedisBackend

MIB = 1 << 20
INPUT_TIME_LIMIT_S = 2.0
INPUT_MEM_BOUND = 16 * MIB  # per-input peak of traced allocations (inputs are < 64 KiB)
RSS_GROWTH_BOUND = 256 * MIB  # whole-run growth of the process's peak RSS

# Offsets of the fixed header "<4sHBBBBHQQ": (name, offset, struct format).
FIELDS = (
    ("magic", 0, "<I"),
    ("version", 4, "<H"),
    ("serde", 6, "<B"),
    ("dtype", 7, "<B"),
    ("layout", 8, "<B"),
    ("ndim", 9, "<B"),
    ("key_len", 10, "<H"),
    ("nbytes", 12, "<Q"),
    ("checksum", 20, "<Q"),
)
FIXED_SIZE = 28
EXTREMES = (0, 1, 2, 7, 8, 9, 255, 1023, 1024, 1025, 0xFFFF, 1 << 31, 1 << 36, (1 << 36) + 1)
EXTREMES_64 = (1 << 63, (1 << 64) - 1, (1 << 64) - 2, 1 << 40)
DTYPE = "float16"


class InputTimeout(Exception):
    """Raised by the SIGALRM handler when one input runs over the time limit."""


@dataclass
class Seed:
    """A valid record and what it must decode to."""

    key: CacheKey
    meta: PayloadMeta
    data: np.ndarray
    record: bytes


@dataclass
class FuzzResult:
    """Counts by target:outcome, throughput, and the first unexpected inputs."""

    inputs: int = 0
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    mutations: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    max_input_s: float = 0.0
    max_input_alloc: int = 0
    rss_growth: int = 0

    @property
    def n_unexpected(self) -> int:
        return sum(n for k, n in self.counts.items() if k.split(":", 1)[1] not in ALLOWED)

    def report(self) -> str:
        rate = self.inputs / self.seconds if self.seconds else 0.0
        lines = [
            f"fuzz_codec: {self.inputs} inputs in {self.seconds:.1f} s ({rate:.0f} inputs/s); "
            f"slowest input {self.max_input_s * 1000:.1f} ms, largest input allocation "
            f"{self.max_input_alloc / 1024:.0f} KiB, peak RSS growth "
            f"{self.rss_growth / MIB:.1f} MiB",
            "outcomes: " + ", ".join(f"{k}={n}" for k, n in sorted(self.counts.items())),
            "mutations: " + ", ".join(f"{k}={n}" for k, n in sorted(self.mutations.items())),
            f"unexpected: {self.n_unexpected}",
        ]
        lines += [f"  {u}" for u in self.unexpected[:10]]
        return "\n".join(lines)


ALLOWED = frozenset({"ok", "ok_forged", "payload_error", "miss", "miss_foreign"})


# ----- seeds and mutations -----


def make_seeds(rng: np.random.Generator) -> list[Seed]:
    """Valid float16 KV_2LTD records of a few shapes (the disk and Redis key dtype)."""
    seeds = []
    for i, shape in enumerate(((2, 1, 1, 1), (2, 2, 4, 8), (2, 2, 16, 64), (2, 1, 3, 5))):
        key = make_key("fuzz-model", 1, 0, f"{i + 1:032x}", DTYPE)
        meta = PayloadMeta(DTYPE, shape)
        data = rng.integers(0, 256, meta.nbytes, dtype=np.uint8)
        seeds.append(Seed(key, meta, data, encode(data, meta, key.to_string()).tobytes()))
    return seeds


def _forge_checksum(buf: bytearray) -> None:
    """Recompute the header checksum for the (possibly mutated) ndim and key length."""
    if len(buf) < FIXED_SIZE:
        return
    ndim, klen = buf[9], struct.unpack_from("<H", buf, 10)[0]
    end = FIXED_SIZE + 8 * ndim + klen
    if end + 4 <= len(buf):
        struct.pack_into("<I", buf, end, xxhash.xxh32_intdigest(bytes(buf[:end])))


def _extreme(rng: np.random.Generator, fmt: str) -> int:
    bits = struct.calcsize(fmt) * 8
    pool = [v for v in EXTREMES + (EXTREMES_64 if bits == 64 else ()) if v < 1 << bits]
    if rng.random() < 0.2:
        return int(rng.integers(0, 1 << min(bits, 63)))
    return pool[int(rng.integers(len(pool)))]


def mutate(rng: np.random.Generator, rec: bytes) -> tuple[str, bytes]:
    """One random mutation of `rec`: (mutation name, bytes)."""
    kind = ("bitflip", "truncate", "extend", "field", "shape", "random", "stack")[
        int(rng.choice(7, p=(0.22, 0.12, 0.1, 0.26, 0.1, 0.1, 0.1)))
    ]
    buf = bytearray(rec)
    if kind in ("field", "shape") and len(buf) < FIXED_SIZE:
        kind = "bitflip" if buf else "random"  # too short for a header (stacked mutation)
    if kind == "bitflip":
        for _ in range(int(rng.integers(1, 9))):
            pos = int(rng.integers(len(buf) * 8))
            buf[pos // 8] ^= 1 << (pos % 8)
    elif kind == "truncate":
        del buf[int(rng.integers(len(buf))) :]
    elif kind == "extend":
        buf += rng.integers(0, 256, int(rng.integers(1, 4096)), dtype=np.uint8).tobytes()
    elif kind == "field":
        name, off, fmt = FIELDS[int(rng.integers(len(FIELDS)))]
        kind = f"field:{name}"
        struct.pack_into(fmt, buf, off, _extreme(rng, fmt))
        if rng.random() < 0.5:
            _forge_checksum(buf)
            kind += "+forged"
    elif kind == "shape":
        # Extreme dims with a matching (wrapped) nbytes: only a size limit can stop it.
        ndim = min(buf[9], (len(buf) - FIXED_SIZE) // 8)
        dims = [_extreme(rng, "<Q") for _ in range(ndim)]
        for i, d in enumerate(dims):
            struct.pack_into("<Q", buf, FIXED_SIZE + 8 * i, d)
        total = 2
        for d in dims:
            total = total * d % (1 << 64)
        struct.pack_into("<Q", buf, 12, total)
        _forge_checksum(buf)
    elif kind == "random":
        buf = bytearray(rng.integers(0, 256, int(rng.integers(0, 2048)), dtype=np.uint8).tobytes())
        if rng.random() < 0.5:
            buf[:4] = b"RKVC"
    else:  # stack: two mutations on top of each other
        k1, b1 = mutate(rng, rec)
        k2, b2 = mutate(rng, b1) if b1 else (k1, b1)
        return f"stack({k1.split(':')[0]},{k2.split(':')[0]})", b2
    return kind, bytes(buf)


# ----- checks shared by the targets -----


def _check_hit(seed: Seed, meta: PayloadMeta, data: np.ndarray, header_sum: int | None) -> str:
    """ "ok"/"ok_forged" if the hit's bytes are right; raises AssertionError otherwise."""
    body = np.ascontiguousarray(data).view(np.uint8)
    if header_sum is not None:
        assert xxhash.xxh3_64_intdigest(body) == header_sum, "body does not match its checksum"
    assert body.nbytes == meta.nbytes, f"{body.nbytes} bytes for {meta}"
    if meta == seed.meta and np.array_equal(body, seed.data):
        return "ok"
    # Only a hostile writer who re-forged the header checksum gets here: the body
    # checksum still holds, so the bytes are the seed's under other metadata.
    assert np.array_equal(body, seed.data), "a hit returned bytes that were never stored"
    return "ok_forged"


# ----- targets -----


class CodecTarget:
    """`read_header` and `decode` on the raw bytes."""

    name = "codec"

    def run(self, seed: Seed, data: bytes) -> str:
        try:
            header = read_header(data)
        except PayloadError:
            header = None
        try:
            out = decode(data, expected_key=seed.key.to_string())
        except PayloadError:
            return "payload_error"
        assert header is not None, "decode accepted what read_header refused"
        return _check_hit(seed, out.meta, out.data, header.checksum)

    def close(self) -> None:
        pass


class DiskTarget:
    """A `DiskStore` reading a chunk file that was overwritten with the input."""

    name = "disk"

    def __init__(self, seeds: list[Seed], root: str) -> None:
        self.store = DiskStore(
            root, 4 * MIB, model_name="fuzz-model", kv_dtype=DTYPE, read_workers=1
        )
        self.seeds = seeds
        self._put([s for s in seeds])
        self._rng = np.random.default_rng(1)

    def _put(self, seeds: list[Seed]) -> None:
        self.store.put([s.key for s in seeds], [s.meta for s in seeds], [s.data for s in seeds])
        assert self.store.flush(10.0), "disk writes did not finish"
        held = self.store.contains([s.key for s in seeds])
        assert all(held), "a seed chunk was not stored"

    def run(self, seed: Seed, data: bytes) -> str:
        if not self.store.contains([seed.key])[0]:
            self._put([seed])
        if self._rng.random() < 0.5:  # same size as indexed: past the size check
            n = len(seed.record)
            data = data[:n] + bytes(max(0, n - len(data)))
        path = self.store.path_of(seed.key)
        with open(path, "wb") as f:
            f.write(data)
        (got,) = self.store.get([seed.key])
        if got is None:
            assert not os.path.exists(path), "a bad chunk file was left behind"
            assert not self.store.contains([seed.key])[0], "a bad chunk is still indexed"
            return "miss"
        return _check_hit(seed, got[0], got[1], None)

    def close(self) -> None:
        self.store.close()


class _FakeRedis:
    """The calls `RedisBackend.get_batch` makes (a pipeline of GETRANGE and STRLEN, MGET,
    UNLINK), answered from one value as Redis would."""

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.unlinked: list[Any] = []

    def pipeline(self, transaction: bool = False) -> _FakePipeline:
        return _FakePipeline(self)

    async def mget(self, names: list[str]) -> list[bytes | None]:
        return [self.value for _ in names]

    async def unlink(self, *names: Any) -> int:
        self.unlinked.extend(names)
        return len(names)

    async def aclose(self) -> None:
        pass


class _FakePipeline:
    def __init__(self, redis: _FakeRedis) -> None:
        self._redis, self._replies = redis, []

    def exists(self, name: str) -> None:
        self._replies.append(int(self._redis.value is not None))

    def getrange(self, name: str, start: int, end: int) -> None:
        value = self._redis.value
        self._replies.append(b"" if value is None else value[start : end + 1])

    def strlen(self, name: str) -> None:
        self._replies.append(0 if self._redis.value is None else len(self._redis.value))

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        return self._replies


class RedisTarget:
    """`RedisBackend.get_batch` on the input as the stored value (no server)."""

    name = "redis"

    def __init__(self) -> None:
        # The client connects lazily; it is replaced before any command is sent.
        self.backend = RedisBackend(
            "redis://127.0.0.1:1/0", RayKVConfig(namespace="fuzz"), timeout_s=1.0
        )
        self.fake = _FakeRedis()
        self.backend._client = self.fake
        self.loop = asyncio.new_event_loop()

    def run(self, seed: Seed, data: bytes) -> str:
        self.fake.value, self.fake.unlinked = data, []
        metas, arrays = self.loop.run_until_complete(self.backend.get_batch([seed.key]))
        if metas[0] is None:
            assert arrays[0].size == 0, "a miss with data"
            try:
                decode(data, seed.key.to_string(), DTYPE)
            except ForeignRecordError:  # well-formed, another secret's: a miss left in place
                assert not self.fake.unlinked, "another secret's record was deleted"
                return "miss_foreign"
            except PayloadError:
                pass
            assert self.fake.unlinked == [self.backend._name(seed.key)], "bad value not deleted"
            return "miss"
        assert not self.fake.unlinked, "a hit was deleted"
        return _check_hit(seed, metas[0], arrays[0], None)

    def close(self) -> None:
        self.loop.close()


# ----- the loop -----


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `InputTimeout` after `seconds` (SIGALRM; only on the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise InputTimeout(f"input ran over {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def fuzz(
    seconds: float = 10.0, seed: int = 0, targets: tuple[str, ...] = ("codec", "disk", "redis")
) -> FuzzResult:
    """Fuzz for `seconds` with `seed`; returns the counts (never raises for a finding)."""
    rng = np.random.default_rng(seed)
    seeds = make_seeds(rng)
    result = FuzzResult()
    rss0 = _peak_rss()
    log = logging.getLogger("raykv")  # every rejected input logs a warning: keep it quiet
    level = log.level
    log.setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="raykv-fuzz-") as tmp:
        makers: dict[str, Callable[[], Any]] = {
            "codec": CodecTarget,
            "disk": lambda: DiskTarget(seeds, tmp),
            "redis": RedisTarget,
        }
        active = [makers[name]() for name in targets]
        tracemalloc.start()
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < seconds:
                s = seeds[int(rng.integers(len(seeds)))]
                kind, data = mutate(rng, s.record)
                result.mutations[kind.split("(")[0].split(":")[0]] += 1
                for target in active:
                    outcome = _one(target, s, data, result)
                    result.counts[f"{target.name}:{outcome}"] += 1
                    if outcome not in ALLOWED and len(result.unexpected) < 50:
                        result.unexpected.append(
                            f"{target.name} {kind} {outcome} input={data[:64].hex()}..."
                        )
                result.inputs += 1
        finally:
            result.seconds = time.monotonic() - t0
            tracemalloc.stop()
            for target in active:
                target.close()
            log.setLevel(level)
    result.rss_growth = _peak_rss() - rss0
    if result.rss_growth > RSS_GROWTH_BOUND:
        result.counts["process:rss_over_bound"] += 1
    return result


def _one(target: Any, seed: Seed, data: bytes, result: FuzzResult) -> str:
    """Run one input on one target and classify what happened."""
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    try:
        with time_limit(INPUT_TIME_LIMIT_S):
            outcome = target.run(seed, data)
    except PayloadError:
        outcome = "payload_error" if target.name == "codec" else "unexpected_PayloadError"
    except InputTimeout:
        outcome = "hang"
    except AssertionError as exc:
        outcome = f"wrong({exc})"
    except Exception as exc:
        outcome = f"unexpected_{type(exc).__name__}({str(exc)[:80]})"
    dt = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    result.max_input_s = max(result.max_input_s, dt)
    result.max_input_alloc = max(result.max_input_alloc, peak - base)
    if outcome in ALLOWED and dt > INPUT_TIME_LIMIT_S:
        outcome = "hang"
    if outcome in ALLOWED and peak - base > INPUT_MEM_BOUND:
        outcome = f"memory({(peak - base) / MIB:.0f} MiB)"
    return outcome


def main(argv: list[str] | None = None) -> FuzzResult:
    """CLI entry point: fuzz, print the report, return the result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to fuzz (10)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    parser.add_argument(
        "--targets", default="codec,disk,redis", help="comma-separated: codec,disk,redis"
    )
    args = parser.parse_args(argv)
    result = fuzz(args.seconds, args.seed, tuple(t for t in args.targets.split(",") if t))
    print(result.report())
    return result


if __name__ == "__main__":
    sys.exit(1 if main().n_unexpected else 0)
