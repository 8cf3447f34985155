"""Errors a user can act on. Their message is the whole story: the CLI prints
it alone, without a traceback."""


class SlipstreamError(Exception):
    """Base of the errors slipstream raises for a user to read."""


class ModelLoadError(SlipstreamError, ValueError):
    """A model path is missing, unsupported or corrupt."""
