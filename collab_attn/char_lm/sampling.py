"""Text sampled from a character model with ``generate`` and the key/value cache (nanoGPT's ``sample.py``:
temperature 0.8, top-k 200, starting from a newline).

A model sees at most ``max_position_embeddings`` characters. Past that, nanoGPT crops the context to the last block and
recomputes; here the text is generated in chunks of half a block: each chunk is one ``generate`` call, with the
cache, conditioned on the last half block of what came before."""

from __future__ import annotations

import torch


@torch.no_grad()
def sample_text(model, corpus, length: int = 300, seed: int = 0, temperature: float = 0.8, top_k: int = 200,
                prompt: str = "\n", use_cache: bool = True) -> str:
    """``length`` characters sampled after ``prompt`` (seeded; the model's train/eval mode is restored).
    ``use_cache=False`` recomputes the whole context at every step: the same text, slower (what the cache is tested
    against)."""
    if length <= 0:
        return ""
    block = model.config.max_position_embeddings
    chunk = max(1, block // 2)
    device = next(model.parameters()).device
    ids = torch.tensor([corpus.encode(prompt)], device=device)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        produced = 0
        while produced < length:
            context = ids[:, -min(ids.shape[1], block - chunk):]
            new = min(chunk, length - produced)
            out = model.generate(
                input_ids=context, attention_mask=torch.ones_like(context), max_new_tokens=new, do_sample=True,
                temperature=temperature, top_k=top_k, use_cache=use_cache, pad_token_id=0,
            )
            ids = torch.cat([ids, out[:, context.shape[1]:]], dim=1)
            produced += new
    finally:
        model.train(was_training)
        torch.random.set_rng_state(generator_state)
    return corpus.decode(ids[0, len(prompt):].tolist())
