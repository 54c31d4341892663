"""Checkpoints saved by earlier versions of collab_attn load through the Auto classes and compute what they computed
when saved: one tiny checkpoint of each layer kind and method (tests/data/make_saved_checkpoints.py; the committed
ones were written before layer kinds became classes and before configs recorded the layer kind; the rotary ones,
``llama-*``, after: ``llama-cp`` with the rotary kind, the other three with theirs)."""

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import collab_attn  # noqa: F401  (registers the converted classes)
from collab_attn.kinds import LAYER_KINDS, ConvertedSelfAttention

SAVED = Path(__file__).parent / "data" / "saved_checkpoints"
FOLDERS = sorted(p.name for p in SAVED.iterdir() if p.is_dir())
# the layer kind each old checkpoint's layers must be rebuilt as
KINDS = {"cp": "collaborative", "tucker": "collaborative", "svd": "concatenated", "prune": "kept-heads",
         "key-svd": "shared-key", "kv-svd": "mla", "collab": "collaborative", "concat": "concatenated",
         "gqa": "gqa", "mla": "mla", "llama-cp": "rotary-collaborative", "llama-kv-svd": "rotary-mla",
         "llama-merge-kv": "rotary-gqa", "llama-key-svd-values": "rotary-shared-key", "rope-tpa": "rotary-tpa"}


def kind_of(name: str) -> str:
    return KINDS.get(name) or KINDS[name.split("-", 1)[1].removesuffix("-values")]


def test_every_layer_kind_has_a_saved_checkpoint():
    assert len(FOLDERS) == 22
    kinds = {kind_of(name) for name in FOLDERS}
    assert kinds == set(LAYER_KINDS)


@pytest.mark.parametrize("name", FOLDERS)
def test_a_checkpoint_saved_before_loads_and_computes_the_same(name):
    folder = SAVED / name
    auto = transformers.AutoModelForMaskedLM if name.startswith("bert") else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(folder).eval()
    assert type(model).__name__ == "Collab" + (folder / "class.txt").read_text().strip().removeprefix("Collab")
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    assert len(layers) == 2 and {m.kind for m in layers} == {kind_of(name)}
    saved = load_file(str(folder / "outputs.safetensors"))
    with torch.no_grad():
        logits = model(saved["input_ids"]).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=0, atol=1e-6)
