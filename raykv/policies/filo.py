"""FILO: evict the most recently inserted key; hits change nothing."""

from __future__ import annotations

from collections import OrderedDict

from raykv.policies.base import BasePolicy, CanEvict, Key, take


class FILOPolicy(BasePolicy):
    """First In, Last Out (a stack): the newest insertion is evicted first.

    Keeps whatever filled the cache first; the mirror image of FIFO.
    """

    name = "filo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict = OrderedDict()

    def insert(self, key: Key, priority: float | None = None) -> None:
        if key not in self._order:
            self._order[key] = None

    def touch(self, key: Key) -> None:
        """A hit does not reorder a stack."""

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, incoming: Key | None = None
    ) -> list:
        return take(self._order, n, can_evict, newest=True)

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
