"""Round-to-nearest (RTN) weight-only quantization: the baseline every other method is
measured against. Each group's scale comes from its own range (optionally with the
clip ratio of lowest MSE); no calibration data.

Schemes that quantize a float checkpoint as it loads:
    "rtn-int4"  w4a16, asymmetric, group 128   (weights 4 bits, activations in the model dtype)
    "rtn-int3"  w3a16, asymmetric, group 128   (3-bit codes stored one per nibble)
    "int8"      w8a16, symmetric, per output channel
    "rtn-int4-head8"  rtn-int4, and an untied LM head in int8 per output channel (w8a16): the
                      head is 1/15 of Llama-3-8B's bytes in bf16, a fifth of them once the
                      decoder is int4 (llama.cpp's Q4_K_M keeps it at 6 bits likewise)
    "int8-head8"      int8, and an untied LM head in int8 per output channel too (an eighth of
                      an int8 Llama-3-8B's bytes stay in a bf16 head otherwise; llama.cpp's
                      Q8_0 files quantize the head the same way)
"""
from __future__ import annotations

import torch

from slipstream.quant.base import register_scheme
from slipstream.quant.primitives import QTensor, quantize, search_clip


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int | None = 128, sym: bool = False,
                 clip_search: bool = False) -> QTensor:
    """w [out, in] -> QTensor; group_size None means one group per output channel."""
    granularity = "channel" if group_size is None else "group"
    clip = 1.0
    if clip_search:
        clip = search_clip(w, bits, sym, granularity, group_size or 0)
    return quantize(w, bits, sym, granularity, group_size or 0, clip)


def _dense_layers(config, files, method_factory):
    """QuantMethodFor covering every decoder linear layer (the LM head stays dense)."""
    if getattr(files, "quantization_config", None):
        raise ValueError(f"quantization: {config.quantization!r} quantizes a float checkpoint "
                         f"at load; {files.path} is already quantized (leave quantization unset)")

    def pick(prefix: str):
        return method_factory()
    return pick


@register_scheme("rtn-int4")
def _rtn_int4(config, files):
    from slipstream.quant.int_weight import IntWeightMethod
    return _dense_layers(config, files, lambda: IntWeightMethod(bits=4, group_size=128, sym=False))


@register_scheme("rtn-int3")
def _rtn_int3(config, files):
    from slipstream.quant.int_weight import IntWeightMethod
    return _dense_layers(config, files, lambda: IntWeightMethod(bits=3, group_size=128, sym=False))


@register_scheme("int8")
def _int8(config, files):
    from slipstream.quant.int_weight import IntWeightMethod
    return _dense_layers(config, files, lambda: IntWeightMethod(bits=8, group_size=None, sym=True))


def _with_int8_head(config, files, body_method):
    """body_method for the decoder's linear layers, an int8 per-channel untied LM head."""
    from slipstream.quant.int_weight import IntWeightHeadMethod
    body = _dense_layers(config, files, body_method)

    def pick(prefix: str):
        if prefix == "lm_head":
            return IntWeightHeadMethod(bits=8, group_size=None, sym=True)
        return None if prefix == "model.embed_tokens" else body(prefix)
    return pick


@register_scheme("rtn-int4-head8")
def _rtn_int4_head8(config, files):
    from slipstream.quant.int_weight import IntWeightMethod
    return _with_int8_head(config, files,
                           lambda: IntWeightMethod(bits=4, group_size=128, sym=False))


@register_scheme("int8-head8")
def _int8_head8(config, files):
    from slipstream.quant.int_weight import IntWeightMethod
    return _with_int8_head(config, files,
                           lambda: IntWeightMethod(bits=8, group_size=None, sym=True))
