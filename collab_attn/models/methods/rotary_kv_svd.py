"""``kv-svd`` on rotary-position models (Llama, Qwen2, Mistral): MHA2MLA's partial RoPE and joint key/value SVD
(Ji et al. 2025, "Towards Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in Any
Transformer-based LLMs"), the planner of the ``rotary-mla`` layer (``collab_attn.kinds.rotary_mla``).

1. Partial RoPE, per key/value group ``g``: keep the ``r`` frequency pairs (of ``head_dim/2``) that contribute most
   to its logits, by MHA2MLA's 2-norm criterion computed from the weights alone (the paper averages the norms of
   query and key activations over calibration text; here a calibration fits the latent, step 2, not this choice):
   ``score_g(i) = sum_{h in g} ||Wq_h[i, i + d_h/2]|| ||Wk_g[i, i + d_h/2]||``, each norm over the pair's two rows
   with the bias as one more input column. Those key dimensions stay rotary and are cached per group as they are;
   each query head rotates the same pairs of its query.
2. The other key dimensions ("nope", no rotation) and the values of all groups are compressed jointly: one SVD of
   ``[Wk_nope; Wv]`` (stacked over the groups) cut to the latent width D_c = ``rank`` (``shared_subspace``), as the
   non-rotary ``kv-svd``: ``c = W_down y`` is cached, ``k_nope = W_uk c + bk_nope`` and ``v = W_uv c``. With a
   calibration (``reparametrize(..., calibration=...)``) the SVD is whitened by the layer's inputs' raw second
   moments (``shared_subspace``): the latent keeps the directions the inputs visit, not those of the raw weights.

Cache per token and layer: ``2 r G + D_c`` numbers (the original's ``2 G d_h``). Biases: the query bias stays; a key
bias on the kept dimensions stays on them (it rotates with the key); on the nope dimensions it becomes the
up-projection's bias (exact; it does not rotate); the value bias is folded into the output bias (attention rows sum
to one). Exact at ``r = d_h/2`` (every pair kept) with ``D_c = G d_h`` (the values whole, up to a basis); at
``r = 0`` with D_c the rank of ``[Wk; Wv]`` the latent is exact too, but no key dimension rotates.

The error a plan reports (``relative_error``) is that of the query/key logit forms per rotary band, the measure the
rotary ``cp`` reports (``collab_attn.kinds.forms.BandForms``): band ``i`` of head ``h`` scores ``Re(x^T M_hi y
e^(j (p - s) theta_i))`` with the complex form ``M_hi = P + jQ``; a kept band gives it back exactly; a dropped
band gives the static real form ``N`` (its two query rows against the reconstructed nope key rows), compared as
``N + 0j``: ``||P - N||^2 + ||Q||^2``, i.e. the logit and its slope in the relative angle at distance 0 (the
rotation lost costs at least ``||Q||^2``, more at long distances). ``value_error``: that of the value-output
products ``Wv_g(h)^T Wo_h^T``. Both are measured again on the installed layer (``kinds/forms.py``).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from collab_attn.decomposition.truncation import shared_subspace
from collab_attn.kinds.rotary_mla.rotary_mla_attention import default_rope_pairs, dimension_order
from collab_attn.models.families import AttentionSite
from collab_attn.models.hf import Layout
from collab_attn.models.methods.base import LayerSizes
from collab_attn.models.methods.rotary_collab import with_bias_column
from collab_attn.models.methods.subspace import SOLVER, calibration_summary, input_whitening
from collab_attn.models.plan import LayerPlan, LayerWeights, Plan, Request, ValueWeights


def max_latent_size(d_in: int, kv_heads: int, head_dim: int, rope_pairs: int) -> int:
    """The widest useful latent: the rank bound of the stacked nope keys and values, ``min(G (2 d_h - 2r), d_in)``."""
    return min(kv_heads * (2 * head_dim - 2 * rope_pairs), d_in)


def partial_rope_layout(method, site: AttentionSite, layers: int, sizes: LayerSizes) -> Layout | None:
    """The layout of a rotary model of ``layers`` layers like ``site`` converted by ``method`` (``kv-svd``) with a
    latent of width ``sizes.rank`` and ``sizes.rope_pairs`` (None: ``default_rope_pairs``); None where the latent
    would be wider than ``max_latent_size`` (what the sizing of the cache race asks)."""
    pairs = default_rope_pairs(site.head_dim) if sizes.rope_pairs is None else sizes.rope_pairs
    if sizes.rank > max_latent_size(site.d_in, site.kv_heads, site.head_dim, pairs):
        return None
    return Layout.uniform(method.name, method.layer_for(True), layers, rank=sizes.rank, rope_pairs=pairs)


def pair_scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """MHA2MLA's 2-norm score of every band for every key/value group, (G, d_h/2): ``sum_{h in g} ||q_h,i||
    ||k_g,i||`` from the (H, d_h, d) query and (G, d_h, d) key rows (band ``i``: rows ``i`` and ``i + d_h/2``)."""
    def pair_norms(rows: torch.Tensor) -> torch.Tensor:
        half = rows.shape[1] // 2
        return (rows[:, :half].square().sum(-1) + rows[:, half:].square().sum(-1)).sqrt()

    groups = key.shape[0]
    return pair_norms(query).view(groups, -1, query.shape[1] // 2).sum(1) * pair_norms(key)


def kept_bands(scores: torch.Tensor, rope_pairs: int) -> torch.Tensor:
    """The ``rope_pairs`` best-scoring bands of each group, (G, r) in increasing order (ties: the lower band)."""
    best = scores.argsort(dim=1, descending=True, stable=True)[:, :rope_pairs]
    return best.sort(dim=1).values


def dropped_bands_error(query: torch.Tensor, key: torch.Tensor, installed_key: torch.Tensor,
                        bands: torch.Tensor) -> float:
    """The relative error of the logit forms (module doc) when the (G, d_h, d') key rows become ``installed_key``
    and only ``bands`` (G, r) keep rotating: kept bands are exact; a dropped band of head ``h`` costs ``||A^T E||^2
    + ||Q||^2`` with ``A`` its two query rows, ``E`` the two key rows' change and ``Q = q2 k1^T - q1 k2^T``."""
    query, key, change = query.double(), key.double(), (key - installed_key).double()
    heads, head_dim, _ = query.shape
    half, group = head_dim // 2, heads // key.shape[0]
    key, change = key.repeat_interleave(group, 0), change.repeat_interleave(group, 0)

    def products(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per head and band: a1.b1, a2.b2, a1.b2 (a1, a2: rows i and i + d_h/2)."""
        a1, a2, b1, b2 = a[:, :half], a[:, half:], b[:, :half], b[:, half:]
        return (a1 * b1).sum(-1), (a2 * b2).sum(-1), (a1 * b2).sum(-1)

    q11, q22, q12 = products(query, query)
    k11, k22, k12 = products(key, key)
    e11, e22, e12 = products(change, change)
    energy = ((q11 + q22) * (k11 + k22)).sum()
    dropped = torch.ones(bands.shape[0], half, dtype=torch.bool)
    dropped.scatter_(1, bands, False)
    dropped = dropped.repeat_interleave(group, 0)
    cost = q11 * e11 + q22 * e22 + 2 * q12 * e12 + q22 * k11 + q11 * k22 - 2 * q12 * k12
    return float((cost[dropped].sum().clamp_min(0) / energy.clamp_min(1e-300)).sqrt())


def value_products_error(w_value: torch.Tensor, installed_value: torch.Tensor, w_output: torch.Tensor) -> float:
    """The relative error of the value-output products ``Wv_g(h)^T Wo_h^T`` when the (G, d_h, d) group values become
    ``installed_value``; ``w_output``: (H, d_h, d_out)."""
    group = w_output.shape[0] // w_value.shape[0]
    out = w_output.double() @ w_output.double().mT  # (H, d_h, d_h)

    def energy(rows: torch.Tensor) -> torch.Tensor:
        return ((rows @ rows.mT).repeat_interleave(group, 0) * out).sum()

    return float((energy(w_value.double() - installed_value.double()).clamp_min(0)
                  / energy(w_value.double()).clamp_min(1e-300)).sqrt())


def _plan_layer(layer: LayerWeights, values: ValueWeights, rank: int, rope_pairs: int, index: int,
                whitening=None) -> LayerPlan:
    start = time.perf_counter()
    kv_heads, head_dim, d_in = layer.w_key.shape[0], layer.head_dim, layer.d_in
    widest = max_latent_size(d_in, kv_heads, head_dim, rope_pairs)
    if rank > widest:
        raise ValueError(
            f"rank {rank} for layer {index}: the latent holds the stacked nope keys and values of {kv_heads} key/value "
            f"groups, {kv_heads} x (2 x {head_dim} - 2 x {rope_pairs}) rows of input width {d_in}, so a latent wider "
            f"than {widest} only caches zeros; choose a rank of at most {widest}"
        )
    query = with_bias_column(layer.w_query, layer.b_query)
    key = with_bias_column(layer.w_key, layer.b_key)
    bands = kept_bands(pair_scores(query, key), rope_pairs)
    order = dimension_order(bands, head_dim)
    ordered = key.gather(1, order[..., None].expand_as(key))  # (G, d_h, d'): kept dimensions first
    width = 2 * rope_pairs
    rope_rows, nope_rows = ordered[:, :width], ordered[:, width:]
    w_value = values.w_value[::layer.heads // kv_heads]  # (G, d_h, d): given per head, read per group
    nope = nope_rows[..., :d_in].flatten(0, 1)
    fit = shared_subspace(torch.cat([nope, w_value.flatten(0, 1)]), rank, whitening)
    up_key, up_value = fit.up.split([nope.shape[0], fit.up.shape[0] - nope.shape[0]])
    state = {"query.weight": layer.w_query.flatten(0, 1), "rope_key.weight": rope_rows[..., :d_in].flatten(0, 1),
             "latent.weight": fit.down, "nope_key.weight": up_key, "rope_bands": bands,
             **values.replaced_by(up_value, values.w_output.flatten(0, 1).T, value_bias=False)}
    installed_nope = (up_key @ fit.down).view(kv_heads, head_dim - width, d_in)
    if layer.b_query is not None:
        state |= {"query.bias": layer.b_query.flatten(), "rope_key.bias": rope_rows[..., d_in].flatten(),
                  "nope_key.bias": nope_rows[..., d_in].flatten()}
        installed_nope = torch.cat([installed_nope, nope_rows[..., d_in:]], dim=-1)
    installed = ordered.clone()
    installed[:, width:] = installed_nope
    installed = torch.empty_like(key).scatter_(1, order[..., None].expand_as(key), installed)  # original order
    return LayerPlan(
        state, dropped_bands_error(query, key, installed, bands), fit.weighted_error,
        value_error=value_products_error(w_value, (up_value @ fit.down).view_as(w_value), values.w_output),
        seconds=time.perf_counter() - start,
    )


def plan_partial_rope(request: Request, method: str) -> Plan:
    """The ``rotary-mla`` plan of every layer (module doc); ``request.options.rope_pairs`` (None: the default
    share, ``default_rope_pairs``) pairs kept per key/value group, ``rank`` the latent width."""
    head_dim = request.weights[0].head_dim
    rope_pairs = request.options.rope_pairs
    rope_pairs = default_rope_pairs(head_dim) if rope_pairs is None else rope_pairs
    if rope_pairs > head_dim // 2:
        raise ValueError(f"rope_pairs={rope_pairs}: a head of {head_dim} dimensions has {head_dim // 2} rotary pairs; "
                         f"keep at most {head_dim // 2} (all of them: the keys' positions exactly)")
    progress = tqdm(request.weights, desc=f"{method} (partial RoPE, {rope_pairs} pairs)", disable=not request.progress)
    layers = [_plan_layer(layer, values, rank, rope_pairs, index, input_whitening(request, index, layer, values=True))
              for index, (layer, values, rank) in enumerate(zip(progress, request.values, request.ranks))]
    return Plan(layers, {"rank": list(request.ranks), "rope_pairs": [rope_pairs] * len(layers)}, SOLVER,
                calibration=calibration_summary(request))
