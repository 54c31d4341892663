"""The rotary frequencies of an exported layer: pair ``i`` of a head of size R rotates at its band's frequency
``theta_(b_i)`` of the source, written in transformers' ``longrope`` form (also vLLM's, and llama.cpp's
``rope_freqs.weight``):

    inv_freq_i = 1 / (factor_i * base^(2i/R)),    so    factor_i = base^(-2i/R) / theta_(b_i),

with the same short and long factors, attention factor 1, and ``original_max_position_embeddings`` equal to
``max_position_embeddings`` (the short factors always apply). Transformers computes the product in float32; a factor
is chosen among the float32 numbers next to the exact one so that the float32 frequency it gives is the source's
where one does, and the nearest otherwise (``frequency_error`` reports the largest relative miss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # the frequencies do not depend on the sequence length


@dataclass
class LongRope:
    """Factors per pair (float32 values as Python floats), the base, and the largest relative error of the float32
    frequencies they give against the source's (0.0: every one exact)."""

    factors: list[float]
    base: float
    frequency_error: float
    inexact_pairs: int

    def parameters(self, max_positions: int) -> dict:
        """transformers 5's ``rope_parameters`` for these factors."""
        return {"rope_type": "longrope", "rope_theta": self.base, "short_factor": self.factors,
                "long_factor": self.factors, "factor": 1.0, "attention_factor": 1.0,
                "original_max_position_embeddings": max_positions}

    def legacy_fields(self, max_positions: int) -> dict:
        """The same in the fields transformers read before 5 (and vLLM reads): ``rope_theta`` and ``rope_scaling``."""
        scaling = {"rope_type": "longrope", "type": "longrope", "short_factor": self.factors,
                   "long_factor": self.factors, "factor": 1.0, "attention_factor": 1.0,
                   "original_max_position_embeddings": max_positions}
        return {"rope_theta": self.base, "rope_scaling": scaling}


def standard_frequencies(factors: torch.Tensor, base: float) -> torch.Tensor:
    """What transformers' ``longrope`` computes in float32 from ``factors`` (pairs,) for head size 2 x pairs."""
    dim = 2 * factors.numel()
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors.float() * base**shape)


def source_frequencies(model) -> torch.Tensor:
    """The source's inverse frequency per band, float32, as its rotary embedding holds them; refused where they
    change with the sequence length or come with an attention scaling a standard layer would not reproduce."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(f"{type(model).__name__} has no rotary embedding (model.model.rotary_emb) to read the "
                         "frequencies from; export takes a converted Llama, Qwen2 or Mistral causal LM")
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"the source's rope type {rope_type!r} changes its frequencies with the sequence length; "
                         f"export writes fixed frequencies (rope types {', '.join(STATIC_ROPE_TYPES)})")
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise ValueError(f"the source's rotary embedding scales attention by {rotary.attention_scaling}; export "
                         "writes an attention factor of 1")
    return rotary.inv_freq.detach().float().cpu()


def long_rope(bands: torch.Tensor, source: torch.Tensor, base: float) -> LongRope:
    """The factors that make pair ``i`` rotate at ``source[bands[i]]`` (module doc)."""
    pairs = bands.numel()
    target = source[bands.long()]
    exponent = torch.arange(0, 2 * pairs, 2, dtype=torch.float64) / (2 * pairs)
    exact = 1.0 / (target.double() * torch.tensor(base, dtype=torch.float64) ** exponent)
    factors = exact.float()
    for step in range(8):  # walk up to 8 float32 steps either way where the frequency is not hit exactly
        missed = standard_frequencies(factors, base) != target
        if not missed.any():
            break
        for direction in (1, -1):
            trial = factors.clone()
            for _ in range(step + 1):
                trial = torch.where(missed, torch.nextafter(trial, trial * (2.0 ** direction)), trial)
            hit = missed & (standard_frequencies(trial, base) == target)
            factors = torch.where(hit, trial, factors)
            missed &= ~hit
    error = ((standard_frequencies(factors, base).double() - target.double()).abs() / target.double()).max()
    inexact = int((standard_frequencies(factors, base) != target).sum())
    return LongRope(factors.tolist(), float(base), float(error), inexact)
