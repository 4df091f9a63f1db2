"""Test helpers shared by the suites: free loopback ports, a real redis-server, and the
small factories of keys and chunks that every tier test builds its cases from.

A module of its own (not conftest.py) so tests can import it by a unique name.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

from raykv.keys import CacheKey, make_key
from raykv.payload import PayloadMeta

TEST_NAMESPACE = "raykv-test"


def chunk_key(i: int, model: str = "m", dtype: str = "bfloat16") -> CacheKey:
    """The i-th test chunk's key (its hash is i in hex)."""
    return make_key(model, 1, 0, f"{i:032x}", dtype)


def byte_meta(nbytes: int) -> PayloadMeta:
    """The metadata of an opaque `nbytes`-byte payload (uint8 K and V)."""
    return PayloadMeta("uint8", (2, 1, 1, nbytes // 2))


def seeded_chunk(i: int, tokens: int = 16) -> tuple[PayloadMeta, np.ndarray]:
    """A bfloat16 chunk whose bytes are a function of i, so every hit can be checked."""
    meta = PayloadMeta("bfloat16", (2, 2, tokens, 32))
    return meta, np.random.default_rng(i).integers(0, 256, meta.nbytes, dtype=np.uint8)


class FakeRef:
    """Stands in for an ObjectRef (Ray-free tier tests)."""

    def __init__(self, name: str = "") -> None:
        self.name = name


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server on a free loopback port, stoppable and restartable by PID."""

    def __init__(
        self, workdir: Path, password: str | None = None, maxmemory_mb: int | None = None
    ) -> None:
        """`maxmemory_mb`: Redis evicts least recently used keys past it (raykv keeps no
        byte budget for a Redis remote: the server's own limit is the budget)."""
        self.binary = shutil.which("redis-server")
        self.maxmemory_mb = maxmemory_mb
        if self.binary is None:
            raise RuntimeError("redis-server not found: apt-get install -y redis-server")
        self.workdir = workdir
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory_mb is not None:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}") from None
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def kv_for(tokens, num_layers: int = 2, hidden: int = 16):
    """`KV_2LTD` fp16 KV whose values derive from the token ids: equal prefixes give equal KV."""
    import torch  # only the tests that build KV need it

    t = torch.as_tensor(tokens, dtype=torch.float32)
    layers = torch.arange(num_layers, dtype=torch.float32).view(1, num_layers, 1, 1)
    cols = torch.arange(hidden, dtype=torch.float32).view(1, 1, 1, hidden)
    kv = t.view(1, 1, -1, 1) * 1000 + layers * 10 + cols / 100
    return torch.cat([kv, -kv]).to(torch.float16)
