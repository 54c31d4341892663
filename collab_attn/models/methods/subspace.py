"""What the shared-subspace conversions (``key-svd``, ``kv-svd``) share: the whitening of a layer's inputs for their
activation-aware fits, and how their plans name the fit."""

from __future__ import annotations

from collab_attn.decomposition.whitening import whitening_pair
from collab_attn.models.plan import LayerWeights, Request

SOLVER = "truncated-svd"  # what the report names the fit (collab_attn.decomposition.truncation.shared_subspace)


def input_whitening(request: Request, index: int, layer: LayerWeights, values: bool = False):
    """(S, S^-1) of layer ``index``'s inputs (``collab_attn.decomposition.whitening``), or None without a
    calibration: from the key statistics (centered by default: a key's mean only shifts whole softmax rows), or with
    ``values`` from the raw second moments (a value's mean reaches the output)."""
    if request.calibration is None:
        return None
    raw, keys = request.calibration.covariance(index)
    return whitening_pair((raw, raw if values else keys), layer.d_in, request.calibration.eps)[1]


def calibration_summary(request: Request) -> dict | None:
    return None if request.calibration is None else request.calibration.summary()
