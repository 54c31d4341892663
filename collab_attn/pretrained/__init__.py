"""Pretrained rotary decoders (SmolLM2): held-out comparison with the original and the cache race."""
