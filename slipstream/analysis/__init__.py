"""The analysis layer: FLOPs, bytes moved and roofline bounds for a model on a
device, and the theory of speculative decoding (reference chapter, sections 1
and 3.3-3.4)."""
