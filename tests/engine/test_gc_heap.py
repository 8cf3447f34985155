"""The engine moves the start-up heap out of the collector's way, and a dropped
engine is still freed when the next one is built."""
import gc
import weakref

from tests.engine.conftest import make_llm


class _Marker:
    pass


def _in_young_generations(obj) -> bool:
    # gc.get_objects() lists the three generations, not the frozen (permanent) one.
    return any(o is obj for o in gc.get_objects())


def test_engine_freezes_startup_heap(tiny_folder, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_GC_FREEZE", raising=False)
    folder, _ = tiny_folder("llama")
    before = _Marker()
    assert _in_young_generations(before)
    llm = make_llm(folder)
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[2] >= 100      # full collections spaced out
    assert not _in_young_generations(before)
    assert not _in_young_generations(llm.engine)
    after = _Marker()
    assert _in_young_generations(after)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_dropped_engine_is_freed_by_the_next(tiny_folder, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_GC_FREEZE", raising=False)
    folder, _ = tiny_folder("llama")
    first = make_llm(folder)
    first.engine._cycle = first.engine          # a reference cycle, as engines have
    gone = weakref.ref(first.engine)
    del first
    assert gone() is not None                   # frozen: no collection frees it
    gc.collect()
    assert gone() is not None
    second = make_llm(folder)
    assert gone() is None                       # thawed and collected while building this one
    assert second.engine is not None


def test_opt_out_leaves_the_collector_alone(tiny_folder, monkeypatch):
    folder, _ = tiny_folder("llama")
    gc.unfreeze()
    monkeypatch.setenv("SLIPSTREAM_GC_FREEZE", "0")
    llm = make_llm(folder)
    assert gc.get_freeze_count() == 0
    assert _in_young_generations(llm.engine)


def test_idle_engine_freezes_what_grew_since(tiny_folder, monkeypatch):
    """Long-lived objects made after start-up (compiled kernels, captured graphs:
    here a stand-in) are frozen once the engine goes idle, if there are enough."""
    from slipstream.engine import gc_heap
    monkeypatch.delenv("SLIPSTREAM_GC_FREEZE", raising=False)
    monkeypatch.setattr(gc_heap, "REFREEZE_OBJECTS", 1000)
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder)
    grown = [_Marker() for _ in range(2000)]
    gc.collect()                                  # survivors reach the oldest generation
    assert _in_young_generations(grown[0])
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert not _in_young_generations(grown[0])    # frozen at the idle step
    few = _Marker()
    gc.collect()
    monkeypatch.setattr(gc_heap, "REFREEZE_OBJECTS", 10 ** 9)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert _in_young_generations(few)             # below the threshold: left alone
