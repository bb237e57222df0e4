"""Batches collated one step ahead, in a background thread, while the model trains on the current one.

A batch's collation is host work the step waits for: padding the token arrays and, for a model on cached BERT
features, gathering every sentence's states out of the memory-mapped cache (BERT-JAM reads all of MiniLM's 7
layers: ~26 MB a batch). Warm, that is a few milliseconds; where the cache's pages are not yet resident it is
disk reads inside the step (BERT-JAM phase 1 on 2 cores, the first 40 batches of an epoch read cold: 53 ms a
batch against 4.9 ms warm, next to a ~410 ms update). :func:`prefetch` collates the next batch in a thread while
the current update runs; numpy copies and page faults do not hold the interpreter lock, so they overlap the
update's kernels.

Same batches, same order: the thread only runs the iterator it is given, which must draw no random numbers from
a generator the training loop shares (batch order and shuffling come from ``numpy.random.default_rng((seed,
epoch))`` inside :func:`~nmtcore.data.batch_indices`).
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetch(items: Iterable[T], depth: int = 1) -> Iterator[T]:
    """Yield ``items`` in order while a daemon thread produces up to ``depth`` ahead; ``depth`` 0 = no thread.

    An exception raised while producing an item is raised here, at that item. Closing the returned generator
    (a ``break`` out of the loop, garbage collection) stops the thread after the item it is producing."""
    if depth < 0:
        raise ValueError(f"prefetch depth must be >= 0, got {depth}")
    if depth == 0:
        yield from items
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            put(_Failed(e))
            return
        put(_END)

    thread = threading.Thread(target=produce, name="nmtcore-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
