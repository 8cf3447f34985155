"""A serving process's heap out of the garbage collector's way.

A process that has imported torch and built a model holds a few hundred thousand
tracked objects; each full collection walks them all (0.15-0.19 s on the H200's
host), and the objects a busy engine creates set one off every few seconds,
inside a step. `slipstream serve` therefore moves everything alive once the
engine and the app are built to the permanent generation (`gc.freeze`), so later
collections walk only what came after. Work after start-up leaves long-lived
objects too (kernels compiled and graphs captured for the first requests'
shapes): when the engine goes idle with at least REFREEZE_OBJECTS of them in the
oldest generation, the heap is collected and frozen again, at a moment no step
waits on.

Freezing shrinks the oldest generation, and CPython starts a full collection once
the objects pending for it exceed a quarter of its size: with the heap frozen that
came every 10 collections of the middle generation (H200 throughput run: 14 full
collections of about 30 ms where there had been 2 of about 160 ms; what they walk
is the running requests' token lists). So the third threshold is raised to
OLD_THRESHOLD (a full collection at most every 100 middle ones) unless set higher.

`LLM(...)` leaves the collector alone by default: there a frozen engine the caller
drops would keep its memory (GPU memory included) through the caller's own
`gc.collect()`. SLIPSTREAM_GC_FREEZE: unset, the server freezes; "1", every engine
freezes once built (an engine built after one was dropped first thaws and
collects, so the dropped one is freed before the new one measures free memory, and
`shutdown()` thaws); "0", nothing freezes.
"""
from __future__ import annotations

import gc
import os

REFREEZE_OBJECTS = 50_000
OLD_THRESHOLD = 100
_active = False    # this process froze its heap


def mode() -> str:
    """"serve" (the default), "all" or "off"."""
    v = os.environ.get("SLIPSTREAM_GC_FREEZE", "")
    return {"": "serve", "0": "off", "1": "all"}.get(v, "serve")


def active() -> bool:
    return _active


def freeze() -> None:
    """Collect, then move every live object to the permanent generation."""
    global _active
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if old < OLD_THRESHOLD:
        gc.set_threshold(young, middle, OLD_THRESHOLD)
    _active = True


def thaw() -> None:
    """Back to the collector's generations (and collect them), if frozen: before
    an engine is built, so one dropped earlier frees its memory first."""
    global _active
    if _active:
        gc.unfreeze()
        gc.collect()
        _active = False


def engine_built() -> None:
    """Called at the end of an engine's construction."""
    if mode() == "all":
        freeze()


def serving() -> None:
    """Called by the server once its engine and app are built."""
    if mode() != "off":
        freeze()


def refreeze_if_grown() -> None:
    """Collect and freeze again when the oldest (unfrozen) generation has grown
    past REFREEZE_OBJECTS; called when the engine has nothing to run."""
    if not _active:
        return
    try:
        grown = len(gc.get_objects(generation=2))
    except (TypeError, ValueError):     # a collector without that generation
        return
    if grown >= REFREEZE_OBJECTS:
        freeze()
