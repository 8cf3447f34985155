"""Reuses the tiny quantization test checkpoint."""
from tests.quant.conftest import tiny_llama  # noqa: F401
