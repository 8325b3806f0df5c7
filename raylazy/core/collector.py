"""Python's cyclic garbage collector paused while many long-lived objects are made (`gc_paused`)."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused(promote: bool = True):
    """Pause Python's cyclic garbage collector while many objects are made: a large checkpoint's headers and plan
    are ~10^5 small acyclic objects, and the collector's passes over them (and over all else alive) would cost
    more than planning itself; raylazy's modules imported into a vLLM worker, which already holds torch's and
    vLLM's hundreds of thousands of objects, would set off full passes over all of them that cost more than the
    import.

    With `promote`, on resuming, what was allocated meanwhile goes straight to the oldest generation (`gc.freeze()`
    then `gc.unfreeze()`: two list splices), as a long-lived plan would after surviving two passes: otherwise the
    first young pass after it scans every one of those objects (hundreds of thousands for DeepSeek-V3's plan). That
    is done only where the pause left more than a young pass's worth (`gc.get_threshold()[0]`) of new objects: fewer
    cost a young pass little, and the check before promoting does not (below). A process that froze objects of its
    own keeps them frozen: its young objects are then left to the passes. Asking whether it did walks every frozen
    object (`gc.get_freeze_count()`, in proportion to the heap a vLLM worker froze), so where a full collection
    follows anyway (vLLM's after a load) pass `promote=False`."""
    was_enabled, young = gc.isenabled(), gc.get_count()[0]
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            made = gc.get_count()[0] - young  # net of what was freed meanwhile
            if promote and made > gc.get_threshold()[0] and not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
