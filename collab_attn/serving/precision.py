"""What a half-precision key/value cache does to a standard model (the exported one, or the original), measured in
float32 otherwise: every key and value is rounded to ``dtype`` as it is computed (``rounded_cache``), as an engine
that caches in float16 or bfloat16 stores them. The key is rounded before its rotation, which changes a number's
rounding error by at most a rounding of its own.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@contextmanager
def rounded_cache(model, dtype: torch.dtype, queries: bool = False):
    """Within the block, ``model``'s keys and values (the outputs of every ``k_proj`` and ``v_proj``) are rounded to
    ``dtype`` and back; with ``queries``, the queries (``q_proj``) too, as llama.cpp rounds them to multiply them
    with a float16 cache. Refused for a model without keys and values."""
    names = ("q_proj", "k_proj", "v_proj") if queries else ("k_proj", "v_proj")
    projections = [module for name, module in model.named_modules() if name.endswith(names)]
    if not projections:
        raise ValueError(f"{type(model).__name__} has no k_proj/v_proj modules: rounded_cache takes a standard "
                         "Llama, Qwen2 or Mistral model (an exported one, or the original)")
    hooks = [module.register_forward_hook(lambda _m, _i, out: out.to(dtype).to(out.dtype)) for module in projections]
    try:
        yield model
    finally:
        for hook in hooks:
            hook.remove()


class RoundedCall:
    """``model`` called with its keys and values rounded to ``dtype`` (``rounded_cache`` around each call), and as it
    is otherwise: one model can be measured against itself in float32 without a copy of its weights."""

    def __init__(self, model, dtype: torch.dtype):
        self.model, self.dtype = model, dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __call__(self, *args, **kwargs):
        with rounded_cache(self.model, self.dtype):
            return self.model(*args, **kwargs)
