"""The calibration text that ships with slipstream is large enough for GPTQ on the default
model and shares no text with the text perplexity is measured on."""
from pathlib import Path

from slipstream.quant.calibration import default_calibration_text

EVAL = Path(__file__).resolve().parents[2] / "benchmarks/quant/eval_text.txt"


def _shingles(text: str, n: int = 8) -> set[str]:
    w = text.split()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def test_calibration_and_evaluation_texts_are_disjoint():
    calib = default_calibration_text()
    assert len(calib.split()) > 15000          # about 28,000 tokens of the default tokenizer
    assert not _shingles(calib) & _shingles(EVAL.read_text(encoding="utf-8"))
