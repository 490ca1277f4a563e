"""``core/collector.collector_paused``: Python's cyclic garbage collector off inside, as it was after, and
what was made inside moved to the oldest generation unscanned."""

from __future__ import annotations

import gc

from autopar.core.collector import collector_paused


class _Cell:
    """An object the collector tracks."""


def test_the_collector_is_off_inside_and_on_again_after_with_what_was_made_left_unscanned():
    assert gc.isenabled()
    scans: list[int] = []
    gc.callbacks.append(lambda phase, info: scans.append(info["generation"]) if phase == "start" else None)
    try:
        with collector_paused():
            assert not gc.isenabled()
            made = [_Cell() for _ in range(200_000)]
        assert gc.isenabled() and scans == []  # no collection ran inside, nor on the way out
    finally:
        gc.callbacks.pop()
    assert gc.get_count()[0] < 1_000  # not 200,000 young objects, scanned at the next allocation
    assert gc.get_freeze_count() == 0 and gc.is_tracked(made[0])  # in the oldest generation: still collectable
    del made


def test_a_collector_the_caller_turned_off_or_froze_is_left_as_it_was():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    kept = [_Cell() for _ in range(10)]
    gc.freeze()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        # the caller's frozen objects stay frozen: in no generation (the count itself drops as frozen objects die)
        assert not any(o is kept[0] for o in gc.get_objects())
    finally:
        gc.unfreeze()
    del kept


def test_importing_autopar_leaves_the_collector_as_it_was():
    """``import autopar`` loads torch with the collector paused: on after it where it was on, with the objects
    the import made in the oldest generation; off where the caller had turned it off."""
    import subprocess
    import sys

    def after_import(before: str) -> list[str]:
        script = f"import gc; {before}; import autopar; print(gc.isenabled(), gc.get_count()[0] < 10_000)"
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout.split()

    assert after_import("gc.enable()") == ["True", "True"]  # on, its young generation not left to scan
    assert after_import("gc.disable()")[0] == "False"
