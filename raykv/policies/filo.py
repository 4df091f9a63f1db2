"""FILO: evict the most recently inserted key; hits change nothing."""

from __future__ import annotations

from raykv.policies._ordered import OrderedPolicy


class FILOPolicy(OrderedPolicy):
    """First In, Last Out (a stack): the newest insertion is evicted first.

    Keeps whatever filled the cache first; the mirror image of FIFO.
    """

    name = "filo"
    reorder_on_hit = False
    evict_newest = True
