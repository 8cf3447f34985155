"""Resolves `EngineConfig.quantization` to the model's `QuantMethodFor`."""
from __future__ import annotations

import importlib

from slipstream.quant.base import QuantMethodFor, registered_schemes

# Scheme name -> module that registers it (imported only when asked for).
BUILTIN_SCHEMES: dict[str, str] = {
    "gguf": "slipstream.quant.gguf",
    "rtn-int4": "slipstream.quant.rtn",
    "rtn-int4-head8": "slipstream.quant.rtn",
    "rtn-int3": "slipstream.quant.rtn",
    "int8": "slipstream.quant.rtn",
    "int8-head8": "slipstream.quant.rtn",
    "fp8": "slipstream.quant.fp8",
    "w8a8": "slipstream.quant.w8a8",
    "slipstream": "slipstream.quant.checkpoint",
    "gptq": "slipstream.quant.hf_checkpoint",
    "awq": "slipstream.quant.hf_checkpoint",
}


def quant_method_for(config, files) -> QuantMethodFor | None:
    """None when the model runs unquantized (dense weights in the model dtype)."""
    name = config.quantization
    qc = getattr(files, "quantization_config", None)
    if qc:   # a quantized checkpoint names its own scheme
        stored = qc.get("quant_method")
        if name not in (None, stored):
            raise ValueError(f"quantization: {name!r} asked for, but {files.path} is already "
                             f"quantized ({stored!r}); leave quantization unset")
        name = stored
    if name is None:
        if config.device.type == "cpu":   # dense products run on torch's threads
            from slipstream.kernels import cpu_library
            cpu_library.release_threads()
        return None
    if name not in registered_schemes() and name in BUILTIN_SCHEMES:
        importlib.import_module(BUILTIN_SCHEMES[name])
    try:
        factory = registered_schemes()[name]
    except KeyError:
        known = sorted(set(registered_schemes()) | set(BUILTIN_SCHEMES))
        raise ValueError(f"quantization: unknown {name!r}; choose from {known}") from None
    return factory(config, files)
