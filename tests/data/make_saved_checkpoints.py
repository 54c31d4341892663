"""Write tests/data/saved_checkpoints/: one tiny converted checkpoint of each layer kind, with the outputs it gave
when it was saved (``outputs.safetensors``: ``input_ids`` and ``logits``), so that tests/test_saved_checkpoints.py
can check that checkpoints saved by earlier versions of collab_attn load and compute the same.

The committed folder was written by collab_attn at commit 504d074 (before layer kinds became classes), except
the rotary ones: ``llama-cp`` (at 4b0a067) and ``llama-kv-svd``, ``llama-merge-kv``, ``llama-key-svd-values`` (the
kinds ``rotary-mla``, ``rotary-gqa`` and ``rotary-shared-key``, when they were added; ``scratch-rope-tpa``, the kind
``rotary-tpa``, likewise). Run again, this script
writes what the current code saves (into the folder given, default the committed one; only the checkpoints named, if
any):

    python tests/data/make_saved_checkpoints.py [FOLDER [NAME ...]]
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

import collab_attn
from collab_attn.char_lm.models import build_model, gpt_config

FOLDER = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "saved_checkpoints"
ONLY = set(sys.argv[2:])
TINY = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
            max_position_embeddings=24)
GPT = dict(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=24)

# name: (family, conversion keywords); every method of collab_attn.models.methods at one reduced size, keys only and
# with the values cut where the method can
CONVERSIONS = {
    "bert-cp": ("bert", dict(rank=6, method="cp")),
    "bert-tucker-values": ("bert", dict(rank=6, method="tucker", value_rank=6, tucker_core_size=3)),
    "bert-svd-values": ("bert", dict(rank=8, method="svd", value_rank=8)),
    "bert-prune": ("bert", dict(rank=6, method="prune")),
    "bert-key-svd": ("bert", dict(rank=6, method="key-svd")),
    "bert-kv-svd": ("bert", dict(rank=6, method="kv-svd")),
    "gpt2-cp-values": ("gpt2", dict(rank=6, method="cp", value_rank=5)),
    "gpt2-tucker": ("gpt2", dict(rank=6, method="tucker", tucker_core_size=3)),
    "gpt2-svd": ("gpt2", dict(rank=8, method="svd")),
    "gpt2-prune": ("gpt2", dict(rank=6, method="prune")),
    "gpt2-key-svd": ("gpt2", dict(rank=6, method="key-svd")),
    "gpt2-kv-svd": ("gpt2", dict(rank=6, method="kv-svd")),
    "llama-cp": ("llama", dict(rank=12, method="cp")),
    "llama-kv-svd": ("llama", dict(rank=9, method="kv-svd", rope_pairs=1)),
    "llama-merge-kv": ("llama", dict(rank=4, method="merge-kv")),
    "llama-key-svd-values": ("llama", dict(rank=4, method="key-svd", value_rank=6)),
}
# name: gpt_config keywords of a model built from a config (no conversion)
SCRATCH = {
    "scratch-collab": dict(kind="collab", rank=6, mixing_init="random"),
    "scratch-collab-values": dict(kind="collab", rank=6, value_rank=6),
    "scratch-concat": dict(kind="concat", rank=8),
    "scratch-gqa": dict(kind="gqa", rank=8),
    "scratch-mla": dict(kind="mla", rank=6),
    "scratch-rope-tpa": dict(kind="tpa", rank=2, value_rank=1, query_rank=3, positions="rope"),
}


def model_of(family: str):
    torch.manual_seed(0)
    if family == "bert":
        config = transformers.BertConfig(**TINY)
        return transformers.BertForMaskedLM(config).eval()
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=32, max_position_embeddings=24)
        return transformers.LlamaForCausalLM(config).eval()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT)).eval()


def randomize_biases(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)


def save(model, name: str) -> None:
    folder = FOLDER / name
    model.save_pretrained(folder)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        logits = model(input_ids).logits
    save_file({"input_ids": input_ids, "logits": logits.contiguous()}, str(folder / "outputs.safetensors"))
    (folder / "class.txt").write_text(type(model).__name__ + "\n")


for name, (family, keywords) in CONVERSIONS.items():
    if ONLY and name not in ONLY:
        continue
    model = model_of(family)
    randomize_biases(model)
    if keywords["method"] == "prune":
        keywords = {**keywords, "importance": [torch.arange(4.0), torch.arange(4.0).flip(0)]}
    collab_attn.reparametrize(model, progress=False, **keywords)
    save(model, name)
for name, keywords in SCRATCH.items():
    if ONLY and name not in ONLY:
        continue
    config = gpt_config(vocab_size=40, block_size=24, n_layer=2, n_head=4, n_embd=16, dropout=0.0, **keywords)
    model = build_model(config, seed=0).eval()
    randomize_biases(model)
    save(model, name)
print(f"wrote {len(ONLY) or len(CONVERSIONS) + len(SCRATCH)} checkpoints to {FOLDER}")
