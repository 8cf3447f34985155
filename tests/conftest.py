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
