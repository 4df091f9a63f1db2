"""One lookup, written once: the plan that every lookup path of the manager drives.

A prefix lookup walks the tiers in order: what the manager's index knows (CPU, disk,
the remote keys it has seen), then a peer instance's CPU tier (asked of the controller),
then the shared remote server (asked directly) for the keys no index knows. Each step
after the index is a call to another process, and each caller makes it its own way, so
the plan is one object and the callers are thin drivers:

    plan = LookupPlan.start(index, keys, ends, tiers, peer=..., remote=...)
    while (need := plan.need()) is not Need.NOTHING:
        if need is Need.PEER:
            plan.give_peer(<the controller's answer for plan.missing>)
        else:
            plan.give_remote(<the server's bools for plan.missing>, failed=...)
    hit_tokens = plan.finish(index)

`give_*` with None (a peer that could not be asked, a remote behind an open breaker)
records a miss for that step; either way the step is done and `need` moves on.

The drivers and the thread each runs on (the manager holds one lock, taken by its event
loop except while the loop waits for I/O, and by a Ray thread between two loop steps):

* manager loop (`ManagerCore._drive`, coroutines on the manager's event loop): every
  need, awaited; used by `lookup` the index cannot answer and by every prefetch (the
  vLLM connector's async lookup is a prefetch plus a wait).
* manager thread (`ManagerCore.try_lookup`, a Ray thread under the lock): a plan that
  needs nothing, or needs only a `ray://` remote, which that thread asks itself with the
  lock released (`RemoteProbe`) and gives back under the lock; a plan that needs a peer
  or a Redis remote goes to the loop. Saves the loop hop (~0.15-0.2 ms of a ~0.8 ms
  lookup, measured when the manager became a threaded actor).
* client probe (`KVCache._lookup` with `client_remote_probe`): the client asks the
  manager with `remote=False` (`lookup_local`) and the `ray://` server in the same
  instant, and reports what the server held (`note_remote`), which the manager gives to
  a plan of its own. Kept because it saves a round trip: at 512 chunks with the remote
  holding the last third, 1.58 ms against 1.96 ms when the manager asks (19 %;
  docs/BENCHMARKS.md, tiers).

A remote's failures are counted and backed off by its circuit breaker
(`raykv.tiers.breaker`), one per remote in a process, whichever driver asks.
Plain Python (no Ray), unit-tested in tests/unit/test_lookup_plan.py.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.keys import CacheKey, leading
from raykv.tiers.index import PrefixIndex, Segment, tokens
from raykv.wire import TIER_CPU, TIER_DISK, TIER_PEER, TIER_REMOTE, PeerTier, TailCandidates, kind

MAX_TAIL_PLANS = 8  # held partial chunks a lookup tries to plan after its whole chunks


class Need(enum.Enum):
    """What a lookup plan still needs before it can finish."""

    NOTHING = "nothing"
    PEER = "peer"  # the controller: which peer's CPU tier holds `missing`'s prefix
    REMOTE = "remote"  # the remote server: which of `missing` it holds


@dataclass(slots=True)
class LookupPlan:
    """One lookup's plan: the segments (tier, start, stop) of the hit prefix found so
    far, `n` chunks long, and the steps still to ask."""

    keys: list[CacheKey]
    ends: list[int]
    segs: list[Segment]
    n: int
    ask_peer: bool
    ask_remote: bool
    remote_failed: bool = False
    asked: int | None = None  # tokens asked for, where `ends` was cut (`with_tail`)

    @classmethod
    def start(
        cls,
        index: PrefixIndex,
        keys: list[CacheKey],
        ends: list[int],
        tiers: Sequence[str],
        *,
        peer: bool = False,
        remote: bool = True,
    ) -> LookupPlan:
        """The plan from what `index` knows of `keys` over `tiers`. `peer`: ask the
        controller for a peer next (the caller knows whether a controller is on);
        `remote`: ask the remote server for keys no index knows (when `tiers` has the
        remote and it is up)."""
        segs, n = index.plan(keys, tiers)
        remote = remote and TIER_REMOTE in tiers and index.up(TIER_REMOTE)
        return cls(keys, ends, segs, n, peer, remote)

    @property
    def complete(self) -> bool:
        """Whether every chunk was found."""
        return self.n == len(self.keys)

    @property
    def missing(self) -> list[CacheKey]:
        """The keys after the prefix found so far: what the next step asks about."""
        return self.keys[self.n :]

    def need(self) -> Need:
        """The next step, or NOTHING once the prefix is complete or every step was asked."""
        if self.complete:
            return Need.NOTHING
        if self.ask_peer:
            return Need.PEER
        if self.ask_remote:
            return Need.REMOTE
        return Need.NOTHING

    def give_peer(self, found: tuple[PeerTier, int] | None) -> None:
        """The controller's answer: the peer holding a prefix of `missing` and its length
        in chunks, or None (no peer has it, or the controller could not be asked)."""
        self.ask_peer = False
        if found is not None and found[1] > 0:
            count = min(found[1], len(self.keys) - self.n)
            self.segs.append((found[0], self.n, self.n + count))
            self.n += count

    def give_remote(self, found: Sequence[bool] | None, failed: bool = False) -> list[CacheKey]:
        """The remote server's answer for `missing` (one bool per key; None: not asked,
        or no answer), `failed` if the call failed. Returns the keys it holds as a
        prefix, which the caller indexes (`PrefixIndex.found_remote`) so a get pulls
        them from there."""
        self.ask_remote = False
        self.remote_failed = failed
        held = leading(list(found or ()), 0, _is_true) if found is not None else 0
        held = min(held, len(self.keys) - self.n)
        if not held:
            return []
        got = self.keys[self.n : self.n + held]
        if self.segs and self.segs[-1][0] == TIER_REMOTE:
            tier, a, _b = self.segs[-1]
            self.segs[-1] = (tier, a, self.n + held)
        else:
            self.segs.append((TIER_REMOTE, self.n, self.n + held))
        self.n += held
        return got

    def with_tail(
        self, index: PrefixIndex, tails: TailCandidates, tiers: Sequence[str]
    ) -> LookupPlan:
        """This plan extended by the first of `tails` that starts where its whole chunks
        end and that `index` holds over `tiers`, every rank's key of it
        (`save_unfull_chunk`: a chat's next turn loading its history to the block). The
        result is planned afresh from the index, so a key that left meanwhile leaves this
        plan as it is. A plan with a peer's segment is not extended (a peer is asked for
        whole chunks only)."""
        if any(kind(tier) == TIER_PEER for tier, _a, _b in self.segs):
            return self
        width = tails.world_size  # keys per chunk: one per rank
        keep = self.n - self.n % width  # the whole chunks found, every rank's key
        start = self.ends[keep - 1] if keep else 0
        plans = MAX_TAIL_PLANS
        for keys, ends in tails.at(start):
            if index.plan(keys, tiers)[1] < len(keys):
                continue  # not held: checked alone first, the full plan only if it is
            extended = self.keys[:keep] + keys
            segs, n = index.plan(extended, tiers)  # the tiers in order, as for whole chunks
            if n == len(extended):
                asked = max(tokens(self.ends, len(self.ends)), ends[-1])
                args = (segs, n, False, False, self.remote_failed, asked)
                return LookupPlan(extended, self.ends[:keep] + ends, *args)
            plans -= 1
            if not plans:
                break
        return self

    def finish(self, index: PrefixIndex) -> tuple[int, int]:
        """Count the lookup in `index`; (hit tokens, miss tokens)."""
        return index.count_lookup(self.segs, self.ends, self.n, self.asked)

    @property
    def hit_tokens(self) -> int:
        """Tokens of the prefix found so far."""
        return tokens(self.ends, self.n)

    def cpu_prefix(self) -> int:
        """Chunks at the start of the prefix held by the CPU tier (what a pin covers)."""
        return self.segs[0][2] if self.segs and self.segs[0][0] == TIER_CPU else 0

    def direct_disk(self) -> Segment | None:
        """The disk segment when the prefix past its CPU run is all on the local disk tier
        (what a client reading the files itself takes, `raykv.client.direct`), else None:
        a prefix that goes on in another tier is promoted as usual. With several ranks
        (each chunk one key per rank, in rank order) only a prefix wholly on disk is: a
        run's end in tokens (`sources`, what the scheduler sees) cannot tell a CPU run
        that ends at a chunk from one that ends inside it, on one rank's key
        (`raykv.integrations.vllm_meta.direct_start` applies the same rule)."""
        width = self.keys[0].world_size if self.keys else 1
        lower = self.segs[1:] if self.cpu_prefix() and width == 1 else self.segs
        if len(lower) == 1 and lower[0][0] == TIER_DISK:
            return lower[0]
        return None

    def sources(self) -> list[tuple[str, int]]:
        """Where the prefix was found: `[(tier kind, prefix tokens up to the end of its
        run), ...]` (the vLLM connector's hit sources)."""
        return [(kind(tier), self.ends[b - 1]) for tier, _a, b in self.segs]

    def tier_tokens(self) -> list[tuple[str, int]]:
        """Hit tokens per segment: `[(tier kind, tokens), ...]` (for metrics)."""
        return [
            (kind(tier), self.ends[b - 1] - (self.ends[a - 1] if a else 0))
            for tier, a, b in self.segs
        ]


def _is_true(found: object) -> bool:
    return found is True


__all__ = ["LookupPlan", "Need"]
