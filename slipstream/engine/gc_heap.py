"""The start-up heap out of the garbage collector's way.

A process that has imported torch and built a model holds a few hundred thousand
tracked objects; each full collection walks them all (about 0.1-0.2 s), and the
objects a busy engine creates set one off every few seconds, inside a step. Once
an engine is built, its objects (and the imports') are moved to the permanent
generation (`gc.freeze`), so later collections walk only what came after.

Each new engine first thaws and collects, so an engine dropped earlier (engines
sit in reference cycles) is freed then. Work after start-up leaves long-lived
objects too (kernels compiled for the first requests' shapes, graphs captured
on first use): when the engine goes idle with at least REFREEZE_OBJECTS of them
in the oldest generation, the heap is collected and frozen again, at a moment
no step waits on.

Freezing shrinks the oldest generation, and CPython starts a full collection once
the objects pending for it exceed a quarter of its size: with the heap frozen that
came every 10 collections of the middle generation (H200 throughput run: 14 full
collections of about 30 ms where there had been 2 of about 160 ms; what they walk
is the running requests' token lists). So the third threshold is raised to
OLD_THRESHOLD (a full collection at most every 100 middle ones) unless set
higher already. `SLIPSTREAM_GC_FREEZE=0` leaves the collector alone.
"""
from __future__ import annotations

import gc
import os

REFREEZE_OBJECTS = 50_000
OLD_THRESHOLD = 100


def enabled() -> bool:
    return os.environ.get("SLIPSTREAM_GC_FREEZE", "1") not in ("", "0")


def freeze_startup_heap() -> None:
    if not enabled():
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if old < OLD_THRESHOLD:
        gc.set_threshold(young, middle, OLD_THRESHOLD)


def refreeze_if_grown() -> None:
    """Collect and freeze again when the oldest (unfrozen) generation has grown
    past REFREEZE_OBJECTS; called when the engine has nothing to run."""
    if not enabled():
        return
    try:
        grown = len(gc.get_objects(generation=2))
    except (TypeError, ValueError):     # a collector without that generation
        return
    if grown >= REFREEZE_OBJECTS:
        freeze_startup_heap()
