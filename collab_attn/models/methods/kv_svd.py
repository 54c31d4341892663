"""``kv-svd``: multi-head latent attention from one joint SVD of the key and value projections (the MLA form of
MHA2MLA and TransMLA, without their rotary part: these families have none). The stacked keys and values of all
heads, ``[Wk; Wv] ~= U S V^T`` cut to ``rank`` directions, give one latent per token ``c = Y V S^{1/2}`` of width
``rank`` (all that is cached) and the per-head up-projections ``W_uk``, ``W_uv`` (the rows of ``U S^{1/2}``). The
queries and the output projection stay; in decoding ``W_uk`` is absorbed into the queries and ``W_uv`` applied after
attention (``LatentAttention``). Exact once ``rank`` reaches the rank of ``[Wk; Wv]`` (at most d_in: half of the
original cache where heads x head_dim = d_in). The key bias is dropped (one constant per softmax row), the value
bias folded into the output bias (attention rows sum to one). With a calibration the SVD is whitened by the inputs'
raw second moments (the values' means reach the output).

On rotary-position models (Llama, Qwen2, Mistral) it is MHA2MLA whole: ``rope_pairs`` rotary frequency pairs per
key/value group stay rotary and are cached as they are, the rest of the keys and the values share the latent
(``collab_attn.models.methods.rotary_kv_svd``; the ``rotary-mla`` layer): ``2 rope_pairs kv_heads + rank`` numbers per
token and layer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from collab_attn.decomposition.truncation import shared_subspace
from collab_attn.models.methods.base import CacheSizes, ConversionMethod, LayerSizes, register, uniform_layout
from collab_attn.models.methods.rotary_kv_svd import partial_rope_layout, plan_partial_rope
from collab_attn.models.methods.subspace import SOLVER, calibration_summary, input_whitening
from collab_attn.models.plan import LayerPlan, Plan, Request

NAME = "kv-svd"


@dataclass(frozen=True)
class KvSvdOptions:
    """``rope_pairs`` (rotary-position models only; MHA2MLA's r): the rotary frequency pairs each key/value group
    keeps, 0 .. head_dim/2; None: an eighth of each head's dimensions, ``head_dim // 16`` pairs (at least one), the
    paper's share. A model without rotary positions has no pairs to keep: giving it one is refused."""

    rope_pairs: int | None = None

    def __post_init__(self):
        if self.rope_pairs is not None and (type(self.rope_pairs) is not int or self.rope_pairs < 0):
            raise ValueError(f"rope_pairs must be a non-negative integer (rotary pairs kept per key/value group) or "
                             f"None, got {self.rope_pairs!r}")


def plan_kv_svd(request: Request) -> Plan:
    if request.rotary:
        return plan_partial_rope(request, NAME)
    if request.options.rope_pairs is not None:
        raise ValueError(f"rope_pairs={request.options.rope_pairs} applies to rotary-position models (Llama, Qwen2, "
                         "Mistral) only: this model has no rotary pairs to keep; leave rope_pairs unset")
    layers = []
    progress = tqdm(request.weights, desc=NAME, disable=not request.progress)
    for index, (layer, values, rank) in enumerate(zip(progress, request.values, request.ranks)):
        start = time.perf_counter()
        keys = layer.w_key.flatten(0, 1)
        joint = torch.cat([keys, values.w_value.flatten(0, 1)])
        fit = shared_subspace(joint, rank, input_whitening(request, index, layer, values=True))
        up_key, up_value = fit.up.split([keys.shape[0], joint.shape[0] - keys.shape[0]])
        state = {"query.weight": layer.w_query.flatten(0, 1), "key.weight": up_key, "latent.weight": fit.down,
                 **values.replaced_by(up_value, values.w_output.flatten(0, 1).T, value_bias=False)}
        if layer.b_query is not None:  # the latent's bias stays zero: the key bias is dropped, the value bias folded
            state |= {"query.bias": layer.b_query.flatten(), "latent.bias": fit.down.new_zeros(rank)}
        # the values were fitted jointly with the keys: no value error of their own
        layers.append(LayerPlan(state, fit.relative_error, fit.weighted_error, seconds=time.perf_counter() - start))
    return Plan(layers, {"rank": list(request.ranks)}, SOLVER, calibration=calibration_summary(request))


def kv_svd_sizes(budget: int, kv_heads: int, head_dim: int, rope_pairs: int) -> CacheSizes | None:
    """On rotary models (MHA2MLA's partial RoPE): ``rope_pairs`` rotating pairs per key/value group, cached with
    their rotation, and the rest of the budget for the latent."""
    latent = budget - 2 * rope_pairs * kv_heads
    return CacheSizes(latent, options={"rope_pairs": rope_pairs}) if latent > 0 else None


def _sized_layout(method: ConversionMethod, site, layers: int, sizes: LayerSizes):
    """On rotary models MHA2MLA's partial RoPE (``partial_rope_layout``), elsewhere a latent of ``sizes.rank``."""
    return (partial_rope_layout if site.rotary else uniform_layout)(method, site, layers, sizes)


KV_SVD = register(ConversionMethod(
    NAME, "latent attention (MLA): one latent of width rank per token from a joint SVD of keys and values",
    plan_kv_svd, layer="mla", options=KvSvdOptions, calibrated=True, reads_values=True, reports_products_error=False,
    rotary_layer="rotary-mla", sizes_within=kv_svd_sizes, sized_layout=_sized_layout,
))
