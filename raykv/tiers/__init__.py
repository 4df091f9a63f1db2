"""The tier core as plain Python: no Ray import anywhere in this package.

* `budget`: byte budgets over an eviction policy, bounded key sets.
* `cpu`: the CPU tier's bookkeeping (batches, pins, leases); the objects are opaque.
* `disk`: the local disk tier (files, index, background writes).
* `remote`: the remote tier (timeouts, error counts) over Redis or a `ray://` KV server.
* `breaker`: one circuit breaker per remote in a process.
* `lookup`: one lookup plan, driven by the manager loop, its Ray threads and clients.
* `kv_server`: the state of a `ray://NAME` KV server.
* `index`: the manager's prefix index (which tier holds which chunk, lookups, pins).

The actors in `raykv.actors` are thin shells that own one of these objects; every class
here is unit-tested in `tests/unit` without starting Ray.
"""
