import faulthandler
import os

import pytest

# Triton kernels run under the interpreter on machines without a GPU. The
# variable must be set before triton is first imported anywhere.
try:
    import torch
    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    import torch
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _hang_guard(request, monkeypatch):
    """A test module with HANG_LIMIT_S (tests across processes, where a peer may never
    answer) ends the run with a traceback after that many seconds instead of holding CI;
    the ranks it starts print theirs a little before (SLIPSTREAM_HANG_DUMP_S,
    distributed/worker.py), so a hang shows where every process waits."""
    limit = getattr(request.module, "HANG_LIMIT_S", None)
    if limit is None:
        yield
        return
    monkeypatch.setenv("SLIPSTREAM_HANG_DUMP_S", str(max(1, limit - 20)))
    faulthandler.dump_traceback_later(limit, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
