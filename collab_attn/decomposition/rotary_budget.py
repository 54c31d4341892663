"""Budgets on rotary models: how many shared pairs each frequency band of each layer gets.

A rotary conversion (``cp``'s complex CP per band, ``key-svd``'s per-band SVD) spends its key width pair by pair, and
a pair serves one band of one layer. Per band the error that ``R`` pairs leave is bounded (equal, for the SVD) by the
tail of a spectrum: the eigenvalues of the band's head Gram (``collab_attn.decomposition.rotary_cp.band_spectra``) for
``cp``, the squared singular values of its key forms for ``key-svd``; whitened by the layer's inputs with a
calibration. Dividing each layer's spectra by its total energy makes the tails relative squared errors, the
quantity per-layer ranks minimize on the other families (``collab_attn.decomposition.rank_selection``), so:

- ``"mean:R"``: the key width of ``R`` numbers (``R / 2`` pairs) in every layer, spread differently: the
  ``layers x R / 2`` pairs with the largest relative eigenvalues across all bands of all layers, every layer
  keeping at least one. Each spectrum is descending, so this minimizes the sum over layers of the bounds;
- ``"energy:E"``: in each layer, the fewest pairs whose eigenvalues hold a fraction ``E`` of its energy.

One split for every layer (``shared_pairs``): a standard checkpoint has one list of rotary frequencies for all its
layers, so a conversion meant for export gives every layer the same pairs per band. With ``c_i`` pairs in band ``i``
for all layers, the summed bound is ``sum_i sum_l tail_li(c_i)``: per band the tail of the layers' summed relative
spectra, still descending. The greedy split of the summed spectra (``allocate_key_pairs``) therefore minimizes the
sum over layers of the bounds among all shared splits.
"""

from __future__ import annotations

import torch

from collab_attn.decomposition.rank_selection import RankBudget
from collab_attn.decomposition.rotary_keys import allocate_key_pairs

ROTARY_BUDGETS = ("mean", "energy")


def relative_spectra(spectra: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's (bands, k) spectrum divided by its total: what a pair's eigenvalue removes from the layer's
    squared relative error."""
    return [s.double() / s.double().sum().clamp_min(1e-300) for s in spectra]


def check_rotary_budget(budget: RankBudget | str) -> RankBudget:
    """The budget, parsed, or a ValueError saying why it cannot size a rotary conversion."""
    budget = RankBudget.parse(budget)
    if budget.rule not in ROTARY_BUDGETS:
        raise ValueError(f"a {budget} budget does not apply to rotary models: it counts query/key parameters, "
                         f"and a rotary conversion is sized by its key cache; use {' or '.join(ROTARY_BUDGETS)} "
                         "(e.g. 'mean:96': the key width 96 in every layer, spread over bands and layers)")
    if budget.step is not None or budget.min_rank is not None:
        raise ValueError(f"budget {budget}: step and min_rank do not apply to rotary models (pairs are spread one "
                         "by one and every layer keeps at least one); leave them out")
    if budget.rule == "mean" and int(budget.value) % 2:
        raise ValueError(f"budget {budget}: a rotary key width counts each shared pair twice; give an even width")
    return budget


def shared_pairs(spectra: list[torch.Tensor], pairs: int) -> list[int]:
    """Pairs per band, the same for every layer (module doc): ``pairs`` of them split by the layers' summed relative
    spectra (each (bands, k), descending rows)."""
    relative = relative_spectra(spectra)
    width = max(layer.shape[1] for layer in relative)
    summed = sum(torch.nn.functional.pad(layer, (0, width - layer.shape[1])) for layer in relative)
    capacity = min(layer.numel() for layer in relative)
    if not 1 <= pairs <= capacity:
        raise ValueError(f"{pairs} shared pairs: every layer holds from 1 to {capacity} pairs; give an even rank "
                         f"from 2 to {2 * capacity}")
    return allocate_key_pairs(summed, pairs)


def allocate_budget(spectra: list[torch.Tensor], budget: RankBudget | str) -> list[list[int]]:
    """Pairs per band for every layer (module doc) from each layer's (bands, k) spectrum, each row descending."""
    budget = check_rotary_budget(budget)
    relative = relative_spectra(spectra)
    if budget.rule == "energy":
        pairs = []
        for layer in relative:
            kept = layer.flatten().sort(descending=True).values.cumsum(0)
            count = int((kept < budget.value - 1e-12).sum()) + 1
            pairs.append(allocate_key_pairs(layer, min(count, layer.numel())))
        return pairs
    width = int(budget.value)
    capacity = min(layer.numel() for layer in relative)
    if not 2 <= width <= 2 * capacity:
        raise ValueError(f"budget mean:{width}: every layer holds at most {capacity} pairs; give an even width from "
                         f"2 to {2 * capacity}")
    total = len(relative) * width // 2
    # every layer keeps its largest pair, then the rest go by value across all layers
    firsts = [int(layer.flatten().argmax()) for layer in relative]
    pool = torch.cat([layer.flatten().clone().index_fill_(0, torch.tensor([first]), float("inf"))
                      for layer, first in zip(relative, firsts)])
    order = pool.argsort(descending=True, stable=True)[:total]
    sizes = [layer.numel() for layer in relative]
    owner = torch.repeat_interleave(torch.arange(len(relative)), torch.tensor(sizes))
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
    pairs = []
    for index, layer in enumerate(relative):
        mine = order[owner[order] == index] - starts[index]
        pairs.append(torch.bincount(mine // layer.shape[1], minlength=layer.shape[0]).tolist())
    return pairs
