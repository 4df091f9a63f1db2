"""Attaching a serving process to Ray (`attach_ray`), safe inside a seeded engine."""

from __future__ import annotations

import os
import random

import ray

from raykv.errors import ConfigError


def attach_ray(address: str | None = None) -> None:
    """Attach this process to Ray by explicit address, unless it already is.

    `address` (else `$RAY_ADDRESS`) names the cluster: `auto`, `HOST:PORT`, or `local`
    for a private instance. With neither, raise: a bare `ray.init()` would start a
    second cluster, or join whichever one happens to run on the machine.

    `ray.init` runs with Python's global `random` reseeded from the OS and restored after.
    Ray draws its GCS subscribers' ids from that generator, and vLLM seeds it alike in
    every worker (seed 0 unless set), so every engine's driver would draw the same ids.
    The GCS then answers each one's long poll at once to take the other's, and Ray's
    error-listener threads spin on it (about 0.2 core each with two engines on this
    project's machines). Restoring the state keeps the engine's seeded sampling as it
    would be without raykv.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        raise ConfigError(
            "Ray is not initialized in this process and no Ray address is given: call "
            "ray.init(...) first (address='local' starts a private instance), or set "
            "ray_address (RAYKV_RAY_ADDRESS) or RAY_ADDRESS to the cluster to attach to"
        )
    state = random.getstate()
    random.seed()  # from os.urandom: ids of their own, however the process was seeded
    try:
        ray.init(address=address, log_to_driver=False)
    finally:
        random.setstate(state)
