"""How much key/query capacity do heads really use? The paper's Figure 1.

For one attention layer with per-head projections ``Wq_h``, ``Wk_h`` (head_dim x d_in) this measures the
fraction of energy (squared singular values) captured by the top-k principal components of
- the stacked query projections ``[Wq_1; ...; Wq_H]`` (heads * head_dim x d_in),
- the stacked key projections,
- the concatenated head products ``[Wq_1^T Wk_1, ..., Wq_H^T Wk_H]`` (d_in x heads * d_in).
If the heads learned redundant key/query subspaces, the products concentrate their energy in far fewer than
``heads * head_dim`` directions, which is what collaborative heads exploit.
"""

from __future__ import annotations

import torch
from torch import nn

from collab_attn.decomposition.decompose import head_products
from collab_attn.models.hf import attention_modules, family_of

KINDS = ("query", "key", "products")


def cumulative_energy(matrix: torch.Tensor) -> torch.Tensor:
    """Fraction of ``||matrix||_F^2`` captured by the top-k singular directions, for k = 1 .. min(shape)."""
    singular = torch.linalg.svdvals(matrix.double())
    energy = singular.square().cumsum(0)
    return (energy / energy[-1]).float()


def rank_for_energy(cumulative: torch.Tensor, threshold: float) -> int:
    """The smallest k whose top-k directions capture at least ``threshold`` of the energy."""
    return int(torch.searchsorted(cumulative, torch.tensor(threshold - 1e-9)).item()) + 1


def layer_spectra(w_query: torch.Tensor, w_key: torch.Tensor) -> dict[str, torch.Tensor]:
    """Cumulative energy of the stacked queries, keys and concatenated head products of one layer."""
    heads, head_dim, d_in = w_query.shape
    products = head_products(w_query.double(), w_key.double())  # (heads, d_in, d_in)
    return {
        "query": cumulative_energy(w_query.reshape(heads * head_dim, d_in)),
        "key": cumulative_energy(w_key.reshape(heads * head_dim, d_in)),
        "products": cumulative_energy(products.permute(1, 0, 2).reshape(d_in, heads * d_in)),
    }


@torch.no_grad()
def model_spectra(model: nn.Module) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """``layer_spectra`` for every self-attention layer of a BERT, RoBERTa, DistilBERT or ALBERT model."""
    family = family_of(model.config)
    spectra = []
    for name, module in attention_modules(model, family):
        w_query, w_key, _, _ = family.head_weights(module)
        spectra.append((name, layer_spectra(w_query, w_key)))
    return spectra
