"""slipstream: an LLM inference engine where every acceleration is a switchable,
measured layer."""
__version__ = "0.1.0"
