"""Speculative decoding: proposers draft tokens (chains or trees), one verifier
checks them against the target in a single forward, losslessly."""
