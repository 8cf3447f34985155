"""Quantization schemes: each plugs a `QuantMethod` into the linear layers it covers."""
