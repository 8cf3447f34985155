"""The start-up heap out of the collector's way: the server freezes it, `LLM`
engines only when asked (SLIPSTREAM_GC_FREEZE=1), and a dropped engine is still
freed before the next one is built."""
import gc
import weakref

import pytest

from slipstream.engine import gc_heap
from tests.engine.conftest import make_llm


class _Marker:
    pass


def _in_young_generations(obj) -> bool:
    # gc.get_objects() lists the three generations, not the frozen (permanent) one.
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(autouse=True)
def _thawed(monkeypatch):
    gc_heap.thaw()
    gc.unfreeze()
    yield
    gc_heap.thaw()
    gc.unfreeze()


def test_llm_leaves_the_collector_alone_by_default(tiny_folder, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_GC_FREEZE", raising=False)
    llm = make_llm(tiny_folder("llama")[0])
    assert gc.get_freeze_count() == 0 and not gc_heap.active()
    assert _in_young_generations(llm.engine)


def test_engines_freeze_when_asked_and_a_dropped_one_is_freed_first(tiny_folder, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_GC_FREEZE", "1")
    folder, _ = tiny_folder("llama")
    before = _Marker()
    first = make_llm(folder)
    assert gc.get_freeze_count() > 0 and gc_heap.active()
    assert gc.get_threshold()[2] >= gc_heap.OLD_THRESHOLD     # full collections spaced out
    assert not _in_young_generations(before) and not _in_young_generations(first.engine)
    after = _Marker()
    assert _in_young_generations(after)
    first.engine._cycle = first.engine          # a reference cycle, as engines have
    gone = weakref.ref(first.engine)
    del first
    gc.collect()
    assert gone() is not None                   # frozen: the caller's collection cannot free it
    seen = []
    real = gc_heap.engine_built
    monkeypatch.setattr(gc_heap, "engine_built", lambda: (seen.append(gone()), real()))
    second = make_llm(folder)
    assert seen == [None]                       # freed before the new engine was built
    out = second.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
    second.shutdown()                           # thaws: what the caller drops is collectable
    assert gc.get_freeze_count() == 0 and not gc_heap.active()


def test_idle_engine_freezes_what_grew_since(tiny_folder, monkeypatch):
    """Long-lived objects made after start-up (compiled kernels, captured graphs:
    here a stand-in) are frozen once the engine goes idle, if there are enough."""
    monkeypatch.setenv("SLIPSTREAM_GC_FREEZE", "1")
    monkeypatch.setattr(gc_heap, "REFREEZE_OBJECTS", 1000)
    llm = make_llm(tiny_folder("llama")[0])
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


@pytest.mark.parametrize("setting", ["", "0"])
def test_the_server_freezes_unless_told_not_to(tmp_path, monkeypatch, setting):
    """`slipstream serve` freezes once its engine and app are built (checked when
    the HTTP server would start); SLIPSTREAM_GC_FREEZE=0 keeps it from it."""
    pytest.importorskip("uvicorn")
    from slipstream.cli import build_parser
    from slipstream.server import cli
    from tests.server.conftest import TINY_ARGS, write_tiny_model
    monkeypatch.setenv("SLIPSTREAM_GC_FREEZE", setting)
    folder = write_tiny_model(tmp_path / "m")
    seen = []

    class NoServer:
        def __init__(self, config):
            pass

        def run(self):
            seen.append(gc.get_freeze_count() > 0)
    monkeypatch.setattr(cli, "_server_class", lambda: NoServer)
    args = build_parser("serve").parse_args(["serve", "--model", str(folder), *TINY_ARGS])
    assert cli.run(args) == 0
    assert seen == [setting != "0"]
