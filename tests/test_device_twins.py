"""CPU twins of the paths that tests/test_cuda.py exercises on a GPU (skipped without one), so that CI checks what
can be checked without it:

1. a decomposition on a named device (``reparametrize(..., device=...)``, ``decompose_heads(..., device=...)``):
   named as ``"cpu"`` or ``torch.device("cpu")`` it is the conversion of ``device=None`` bit for bit, and the
   factors come back on that device;
2. calibration statistics computed per batch in float32, as on a GPU (``collect_calibration``'s default there),
   against float64, the CPU's default: the same statistics to float32 rounding, and conversions calibrated with
   either give the same ranks and errors within a stated tolerance.

What only a GPU shows (CUDA kernels, bf16 autocast, moving models and caches between devices) stays in
tests/test_cuda.py, which experiments/gpu_queue.sh runs (job ``test``) whenever a GPU is lent.
"""

import copy
import dataclasses
import math

import pytest
import torch
from conftest import SENTENCES, random_batch, small_model
from transformers import AutoModel

from collab_attn import decompose_heads, reparametrize
from collab_attn.fitting.calibration import (
    Calibration,
    accumulation_dtype,
    calibration_from_texts,
    collect_calibration,
)

CPU = torch.device("cpu")
NAMED = pytest.mark.parametrize("device", ["cpu", CPU], ids=["str", "torch.device"])


def without_seconds(value):
    """A report's dict without its timings (the only fields a second run may change)."""
    if isinstance(value, dict):
        return {k: without_seconds(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [without_seconds(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------
# 1. A decomposition on a named device


CONVERSIONS = {
    "cp": ("cp", {}),
    "tucker": ("tucker", {"tucker_core_size": 2}),
    "cp shared values": ("cp", {"value_rank": 24}),
    "cp calibrated": ("cp", {"calibrated": True}),
    "tucker calibrated shared values": ("tucker", {"calibrated": True, "value_rank": 24}),
}


@NAMED
@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_reparametrize_on_a_named_cpu_device_is_the_conversion_of_device_none(one_thread, conversion, device):
    method, options = CONVERSIONS[conversion]
    options = dict(options)
    calibrated = options.pop("calibrated", False)
    models, reports = [], []
    for where in (None, device):
        model = small_model("bert")
        calibration = collect_calibration(model, [random_batch()]) if calibrated else None
        reports.append(reparametrize(model, 24, method, seed=3, device=where, n_iter_max=5, calibration=calibration,
                                     progress=False, **options))
        models.append(model)
    assert without_seconds(reports[1].to_dict()) == without_seconds(reports[0].to_dict())
    assert all(0 < layer.relative_error < 1 for layer in reports[0].layers)  # a real fit, not the exact copy
    expected, got = (m.state_dict() for m in models)
    assert list(got) == list(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected), [
        name for name in expected if not torch.equal(got[name], expected[name])]
    assert {p.device for p in models[1].parameters()} == {CPU}  # the converted model stays where it was


@NAMED
@pytest.mark.parametrize("method", ["cp", "tucker"])
@pytest.mark.parametrize("whitened", [False, True], ids=["plain", "whitened"])
def test_decompose_heads_on_a_named_cpu_device_returns_its_factors_there(one_thread, method, whitened, device):
    g = torch.Generator().manual_seed(0)
    w_query, w_key = torch.randn(4, 12, 48, generator=g), torch.randn(4, 12, 48, generator=g)
    inputs = torch.randn(200, 48, generator=g) @ torch.randn(48, 48, generator=g)
    covariance = inputs.T.double() @ inputs.double() / len(inputs) if whitened else None
    fits = [decompose_heads(w_query, w_key, 16, method, seed=1, n_iter_max=6, covariance=covariance, device=where)
            for where in (None, device)]
    for name in ("shared_query", "shared_key", "mixing", "core"):
        expected, got = (getattr(fit, name) for fit in fits)
        if expected is None:
            assert got is None and method == "cp"
            continue
        assert got.device == torch.device(device) and got.dtype == torch.float32, name
        assert torch.equal(got, expected), name
    for name in ("relative_error", "weighted_error", "n_iter"):
        assert getattr(fits[1], name) == getattr(fits[0], name), name
    assert (fits[0].weighted_error is not None) == whitened


# ---------------------------------------------------------------------------------------------------
# 2. Calibration statistics in float32 (a GPU) and float64 (the CPU)

# float32 keeps 24 bits: sums of a few hundred products of MiniLM's hidden states (outlier dimensions included)
# land within ~2e-7 of float64, relative to each matrix's norm; 1e-6 leaves a margin of five
STATISTICS_RTOL = 1e-6
# A fixed-rank conversion fitted to either. The fit magnifies what differs: after 2 ALS iterations from the SVD
# start, the 2e-7 of float32 moves MiniLM's first layers' errors by up to 4e-4 of their value (a random change of
# 1.3e-7 of the float64 statistics: up to 9e-5); halving a rank moves them by tens of percent.
ERROR_RTOL = 1e-3
TEXTS = [*SENTENCES, ("Is the museum open on Mondays?", "It is closed every Monday except on public holidays.")]


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return AutoModel.from_pretrained(minilm_path).eval()


@pytest.fixture(scope="module")
def calibrations(minilm, minilm_tokenizer) -> dict:
    """MiniLM's input statistics on real sentences in two batches (four with padding, then a pair) per batch in
    float64, in float32 and in the CPU's default."""
    return {dtype: calibration_from_texts(minilm, minilm_tokenizer, TEXTS, batch_size=4,
                                          dtype=None if dtype == "default" else dtype)
            for dtype in (torch.float64, torch.float32, "default")}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_default_accumulation_is_float64_on_the_cpu_and_float32_on_an_accelerator(calibrations):
    assert accumulation_dtype("cpu") == torch.float64 and accumulation_dtype(CPU) == torch.float64
    assert accumulation_dtype("cuda") == torch.float32 and accumulation_dtype("mps") == torch.float32
    default, float64 = calibrations["default"], calibrations[torch.float64]
    for name in ("second_moments", "centered_moments"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(default, name), getattr(float64, name)))


def test_statistics_accumulated_in_float32_match_float64(calibrations):
    float32, float64 = calibrations[torch.float32], calibrations[torch.float64]
    assert (float32.names, float32.tokens, float32.sequences) == (float64.names, float64.tokens, float64.sequences)
    assert float64.tokens > 50 and len(float64) == 6
    for name in ("second_moments", "centered_moments"):
        for layer, (got, expected) in enumerate(zip(getattr(float32, name), getattr(float64, name))):
            assert got.dtype == expected.dtype == torch.float64  # the running total is float64 either way
            assert 0 < relative(got, expected) < STATISTICS_RTOL, (name, layer, relative(got, expected))
            assert torch.equal(got, got.T)


def first_layers(model, calibration: Calibration, layers: int):
    """``model`` cut to its first ``layers`` layers, and their statistics (their inputs do not depend on the rest)."""
    model = copy.deepcopy(model)
    model.encoder.layer = model.encoder.layer[:layers]
    model.config.num_hidden_layers = layers
    cut = {name: getattr(calibration, name)[:layers] for name in ("names", "second_moments", "centered_moments")}
    return model, dataclasses.replace(calibration, **cut)


def test_a_conversion_calibrated_in_float32_matches_one_calibrated_in_float64(one_thread, minilm, calibrations):
    """Fixed ranks (one per layer, as a budget gives them), MiniLM's first two layers (the two most sensitive): the
    activation-aware fits agree in every layer."""
    ranks = [96, 144]
    reports = {}
    for dtype in (torch.float64, torch.float32):
        model, calibration = first_layers(minilm, calibrations[dtype], len(ranks))
        reports[dtype] = reparametrize(model, ranks, calibration=calibration, n_iter_max=2, progress=False)
    expected, got = reports[torch.float64], reports[torch.float32]
    assert [layer.rank for layer in got.layers] == [layer.rank for layer in expected.layers] == ranks
    assert got.calibration == expected.calibration
    for a, b in zip(got.layers, expected.layers):
        assert math.isclose(a.relative_error, b.relative_error, rel_tol=ERROR_RTOL), (a.name, a, b)
        assert math.isclose(a.weighted_error, b.weighted_error, rel_tol=ERROR_RTOL), (a.name, a, b)
        assert (a.params_after, a.query_key_params_after) == (b.params_after, b.query_key_params_after)
