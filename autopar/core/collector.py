"""Python's cyclic garbage collector paused while autopar makes many objects that live on.

Importing torch and autopar, and a plan's search, each create hundreds of thousands to millions of objects
that outlive the work (modules and functions; the search's cached prices, options and problems). Each
collection the collector runs meanwhile rescans the young ones, and each full one every object alive,
for almost nothing to free: on the 2-core development machine a sixth of ``import autopar`` and of
Mixtral 8x7B's planning on 64 H100s. Reference counting frees what is dropped as before; what is left in
reference cycles waits for the next collection after the pause.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside (``gc.disable``), on again after unless it was off before. At the
    end every object alive is put in the oldest generation without a scan (``gc.freeze`` then
    ``gc.unfreeze``), where the collector's thresholds leave them until they are a quarter of it:
    re-enabled with a young generation of millions, it would scan them all at the first allocation (half a
    second after a pinned Llama 3 70B pipeline's search). That move is skipped where the
    caller froze objects itself, which ``gc.unfreeze`` would thaw too."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()
            gc.unfreeze()
        gc.enable()
