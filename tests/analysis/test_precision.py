import pytest

from slipstream.analysis.precision import parse_precision


@pytest.mark.parametrize("text, nbytes", [
    ("bf16", 2.0), ("fp16", 2.0), ("float32", 4.0), ("fp8", 1.0), ("int8", 1.0),
    # int4 stores half a byte plus one fp16 scale per group: 0.5 + 2 / g.
    ("int4", 0.5 + 2 / 128), ("int4-g64", 0.5 + 2 / 64), ("INT4_g32", 0.5 + 2 / 32),
    ("int8-g128", 1.0 + 2 / 128),
])
def test_bytes_per_element(text, nbytes):
    assert parse_precision(text).bytes_per_element == pytest.approx(nbytes, rel=1e-12)


def test_labels_and_errors():
    assert parse_precision("int4").label == "int4-g128"
    assert parse_precision("bfloat16").label == "bf16"
    for bad in ("int3", "fp4", "int4-g0", ""):
        with pytest.raises(ValueError):
            parse_precision(bad)
