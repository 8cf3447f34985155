"""slipstream: an LLM inference engine where every acceleration is a switchable,
measured layer."""
__version__ = "0.1.0"

# Imported on first use, so `import slipstream.<module>` stays light.
_EXPORTS = {
    "LLM": "slipstream.llm",
    "SamplingParams": "slipstream.sampling_params",
    "EngineArgs": "slipstream.engine.args",
    "RequestOutput": "slipstream.engine.outputs",
    "CompletionOutput": "slipstream.engine.outputs",
    "Logprob": "slipstream.engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
