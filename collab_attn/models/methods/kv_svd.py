"""``kv-svd``: multi-head latent attention from one joint SVD of the key and value projections (the MLA form of
MHA2MLA and TransMLA, without their rotary part: these families have none). The stacked keys and values of all
heads, ``[Wk; Wv] ~= U S V^T`` cut to ``rank`` directions, give one latent per token ``c = Y V S^{1/2}`` of width
``rank`` (all that is cached) and the per-head up-projections ``W_uk``, ``W_uv`` (the rows of ``U S^{1/2}``). The
queries and the output projection stay; in decoding ``W_uk`` is absorbed into the queries and ``W_uv`` applied after
attention (``LatentAttention``). Exact once ``rank`` reaches the rank of ``[Wk; Wv]`` (at most d_in: half of the
original cache where heads x head_dim = d_in). The key bias is dropped (one constant per softmax row), the value
bias folded into the output bias (attention rows sum to one). With a calibration the SVD is whitened by the inputs'
raw second moments (the values' means reach the output)."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from collab_attn.decomposition.truncation import shared_subspace
from collab_attn.models.hf import Layout
from collab_attn.models.methods.base import ConversionMethod, register
from collab_attn.models.methods.subspace import SOLVER, calibration_summary, input_whitening
from collab_attn.models.plan import LayerPlan, Plan, Request, ValuePlan

NAME = "kv-svd"


def plan_kv_svd(request: Request) -> Plan:
    layers = []
    progress = tqdm(request.weights, desc=NAME, disable=not request.progress)
    for index, (layer, values, rank) in enumerate(zip(progress, request.values, request.ranks)):
        start = time.perf_counter()
        keys = layer.w_key.flatten(0, 1)
        joint = torch.cat([keys, values.w_value.flatten(0, 1)])
        fit = shared_subspace(joint, rank, input_whitening(request, index, layer, values=True))
        up_key, up_value = fit.up.split([keys.shape[0], joint.shape[0] - keys.shape[0]])
        value_side = ValuePlan(up_value, values.w_output.flatten(0, 1).T, None, values.output_bias(),
                               relative_error=None)  # fitted jointly with the keys
        layers.append(LayerPlan(
            layer.w_query.flatten(0, 1), up_key, latent=fit.down, values=value_side,
            query_bias=None if layer.b_query is None else layer.b_query.flatten(),
            relative_error=fit.relative_error, weighted_error=fit.weighted_error, seconds=time.perf_counter() - start,
        ))
    return Plan(Layout(NAME, list(request.ranks)), layers, SOLVER, calibration_summary(request))


KV_SVD = register(ConversionMethod(
    NAME, "latent attention (MLA): one latent of width rank per token from a joint SVD of keys and values",
    plan_kv_svd, layer="mla", calibrated=True, reads_values=True, reports_products_error=False,
))
