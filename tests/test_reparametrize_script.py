"""Tests for scripts/reparametrize.py, its Hydra configs and collab_attn.models.checkpoints (packaged MiniLM)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import character_tokenizer, dense_products_error
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import collab_attn
import collab_attn.glue.calibrate as calibrate_module
from collab_attn import cli
from collab_attn.decomposition.cp_als import DEFAULT_TOL
from collab_attn.models.checkpoints import load_model_and_tokenizer, resolve_model
from collab_attn.models.hf import forward_inputs
from collab_attn.models.settings import CalibrationSettings, MethodSettings
from collab_attn.texts import windows

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SCRIPT = ROOT / "scripts" / "reparametrize.py"

_spec = importlib.util.spec_from_file_location("reparametrize_script", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="reparametrize", overrides=list(overrides))


@pytest.fixture(scope="module")
def minilm_path() -> str:
    return resolve_model("minilm")


# ---------------------------------------------------------------------------------------------------
# Configs


def test_default_config_composes_and_resolves():
    cfg = config()
    assert cfg.model == "minilm" and cfg.overwrite is False and cfg.seed == 0
    # the default conversion stops by the solver's own rule (tol 5e-4); only collab=cp_legacy keeps tol 1e-8
    assert dict(cfg.collab) == {
        "method": "cp", "rank": 192, "value_rank": None, "init": "svd", "n_iter_max": 100, "tol": DEFAULT_TOL,
        "budget": None, "solver": "implicit", "calibration": None, "calibration_samples": None,
        "calibration_max_length": None, "fit_steps": None, "e2e_steps": None, "e2e_texts": None, "distill_steps": None,
        "bands": None,
    }
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["output_dir"].startswith("outputs/reparametrized/cp-")
    sentences = resolved["compare_sentences"]
    assert len(sentences) >= 5
    assert any(isinstance(s, list) and len(s) == 2 for s in sentences)  # sentence pairs
    assert len({len(" ".join(s) if isinstance(s, list) else s) for s in sentences}) == len(sentences)


@pytest.mark.parametrize(
    "overrides, method, rank",
    [
        (["collab.rank=128"], "cp", 128),
        (["collab=tucker"], "tucker", 96),
        (["collab=tucker", "collab.rank=64", "collab.tucker_core_size=6"], "tucker", 64),
        (["collab.rank=[384,256,256,192,192,128]"], "cp", [384, 256, 256, 192, 192, 128]),
        (["collab=none"], "none", None),
        (["collab=svd"], "svd", 192),
        (["collab=prune"], "prune", 192),
    ],
)
def test_config_overrides(overrides, method, rank):
    collab = OmegaConf.to_container(config(*overrides).collab)
    assert collab["method"] == method
    assert collab.get("rank") == rank


# ---------------------------------------------------------------------------------------------------
# run(cfg)


def test_full_rank_is_exact_and_reloads(tmp_path, minilm_path):
    out = tmp_path / "out"
    result = script.run(config("collab.rank=384", f"output_dir={out}"))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "reparam_report.json", "tokenizer_config.json"} <= names
    assert "tokenizer.json" in names or "vocab.txt" in names
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left behind

    report = json.loads((out / "reparam_report.json").read_text())
    assert report == json.loads(json.dumps(result))
    assert report["model"] == "minilm" and report["rank"] == 384 and report["method"] == "cp"
    assert report["seed"] == 0 and len(report["layers"]) == 6
    comparison = report["comparison"]
    assert comparison["max_abs_diff"] <= 1e-4 and comparison["padding_tokens"] > 0
    assert comparison["model_params_before"] == 22_713_216

    reloaded = AutoModel.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "CollabBertModel"
    converted = AutoModel.from_pretrained(minilm_path).eval()
    collab_attn.reparametrize(converted, 384, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["A short one.", "A somewhat longer sentence to force some padding here."],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        expected, got = converted(**batch).last_hidden_state, reloaded(**batch).last_hidden_state
    assert torch.allclose(expected, got, rtol=0, atol=1e-6)


def check_reported_errors(result: dict, out: Path, minilm_path: str) -> None:
    """The errors the script reports (returned and in ``reparam_report.json``) are those of the head products the
    saved checkpoint holds, recomputed densely against MiniLM."""
    original, saved = AutoModel.from_pretrained(minilm_path), AutoModel.from_pretrained(out)
    written = json.loads((out / "reparam_report.json").read_text())["layers"]
    for layer, stored, before, after in zip(result["layers"], written, original.encoder.layer, saved.encoder.layer):
        expected = dense_products_error(before.attention.self, after.attention.self)
        assert 0.05 < layer["relative_error"] == pytest.approx(expected, abs=1e-5)
        assert stored["relative_error"] == layer["relative_error"]


def test_low_rank(tmp_path, minilm_path):
    out = tmp_path / "out"
    result = script.run(config("collab.rank=128", "collab.n_iter_max=5", f"output_dir={out}"))
    check_reported_errors(result, out, minilm_path)
    assert all(layer["rank"] == 128 for layer in result["layers"])
    assert result["comparison"]["max_abs_diff"] > 0
    assert result["attention_params_after"] < result["attention_params_before"]
    assert json.loads((out / "config.json").read_text())["collab_ranks"] == [128] * 6
    assert result["wall_seconds"]["own_text"] is None and result["wall_seconds"]["before_saving"] > 0


def test_svd_writes_a_checkpoint_like_cp(tmp_path, minilm_path):
    out = tmp_path / "out"
    result = script.run(config("collab=svd", "collab.rank=96", f"output_dir={out}"))
    assert result["method"] == "svd" and result["rank"] == 96 and len(result["layers"]) == 6
    check_reported_errors(result, out, minilm_path)
    assert result["attention_params_after"] < result["attention_params_before"]
    assert {"config.json", "model.safetensors", "reparam_report.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "reparam_report.json").read_text())["config"]["collab"] == {
        "method": "svd", "rank": 96, "value_rank": None}

    reloaded = AutoModel.from_pretrained(out).eval()
    converted = AutoModel.from_pretrained(minilm_path).eval()
    collab_attn.reparametrize(converted, 96, "svd", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["A short one.", "A longer sentence that pads the first."], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected, got = converted(**batch).last_hidden_state, reloaded(**batch).last_hidden_state
    assert torch.allclose(expected, got, rtol=0, atol=1e-6)


def test_a_decoder_is_compared_on_greedy_continuations(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=40, n_positions=64,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(checkpoint)
    character_tokenizer().save_pretrained(checkpoint)
    prompts = "compare_prompts=[the cat sat,once upon a time]"
    exact = script.run(config_for_decoder(checkpoint, tmp_path / "exact", "collab.rank=48", prompts))
    assert [row["same_tokens_before_first_difference"] for row in exact["comparison"]["prompts"]] == [20, 20]
    assert exact["comparison"]["max_abs_diff"] < 1e-4
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "exact")).__name__ == "CollabGPT2LMHeadModel"

    reduced = script.run(config_for_decoder(checkpoint, tmp_path / "reduced", "collab.rank=12", prompts))
    rows = reduced["comparison"]["prompts"]
    assert len(rows) == 2 and all(0 <= row["same_tokens_before_first_difference"] <= 20 for row in rows)
    assert reduced["comparison"]["max_abs_diff"] > 1e-4 and rows[0]["original"] and rows[0]["converted"]


SMALL_BERT = {"hidden_size": 48, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 64,
              "vocab_size": 40}


def test_inputs_the_model_does_not_take_are_not_passed(tmp_path):
    """A Llama checkpoint saved with a tokenizer that returns ``token_type_ids`` (a BERT-style tokenizer beside a
    decoder): Llama's forward has no such input, and ``generate`` refuses unused model kwargs, so the comparison
    used to end in a traceback after the conversion. Only the inputs the forward names are passed."""
    torch.manual_seed(0)
    checkpoint = tmp_path / "llama"
    config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      num_hidden_layers=2, intermediate_size=64, vocab_size=40,
                                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(checkpoint)
    tokenizer, names = character_tokenizer(), ["input_ids", "token_type_ids", "attention_mask"]
    tokenizer.model_input_names = tokenizer.init_kwargs["model_input_names"] = names  # saved with the tokenizer
    tokenizer.save_pretrained(checkpoint)
    assert "token_type_ids" in AutoTokenizer.from_pretrained(checkpoint)("the cat")
    prompts = "compare_prompts=[the cat sat,once upon a time]"
    result = script.run(config_for_decoder(checkpoint, tmp_path / "out", "collab.rank=48", "max_new_tokens=5", prompts))
    rows = result["comparison"]["prompts"]
    assert [row["same_tokens_before_first_difference"] for row in rows] == [5, 5]
    assert result["comparison"]["max_abs_diff"] < 1e-4 and (tmp_path / "out" / "reparam_report.json").is_file()
    batch = {"input_ids": 1, "token_type_ids": 2, "attention_mask": 3}
    llama = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert forward_inputs(llama, batch) == {"input_ids": 1, "attention_mask": 3}
    assert forward_inputs(transformers.BertModel(transformers.BertConfig(**SMALL_BERT)), batch) == batch


def test_key_svd_shares_the_values_of_a_rotary_model(tmp_path):
    """collab=key-svd collab.value_rank=V on a Llama: the saved model caches rank + V numbers per token and layer
    (keys and values read from a real cache after loading it back), where the values alone used to stay full width;
    exact at the full widths. A model without rotary positions refuses the value rank before anything is written."""
    torch.manual_seed(0)
    checkpoint = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_hidden_layers=2,
        intermediate_size=64, vocab_size=40, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)).save_pretrained(checkpoint)
    character_tokenizer().save_pretrained(checkpoint)
    prompts = ("compare_prompts=[the cat sat]", "max_new_tokens=3")
    for rank, value_rank, out in ((8, 12, "cut"), (24, 24, "exact")):  # 2 groups x 12 is the full width
        result = script.run(config(f"model={checkpoint}", f"output_dir={tmp_path / out}", "collab=key-svd",
                                   f"collab.rank={rank}", f"collab.value_rank={value_rank}", "collab.fit_steps=0",
                                   *prompts))
        assert result["config"]["collab"]["value_rank"] == value_rank
        model = AutoModelForCausalLM.from_pretrained(tmp_path / out)
        with torch.no_grad():
            cache = model(torch.tensor([[3, 4, 5]]), use_cache=True).past_key_values
        assert [(layer.keys[0, :, 0].numel(), layer.values[0, :, 0].numel()) for layer in cache.layers] == \
            [(rank, value_rank)] * 2
    assert result["comparison"]["max_abs_diff"] < 1e-4
    with pytest.raises(ValueError, match="method='key-svd' shares the values on rotary models only"):
        script.run(config(f"model={tiny_gpt2(tmp_path / 'gpt2')}", f"output_dir={tmp_path / 'gpt2-out'}",
                          "collab=key-svd", "collab.rank=12", "collab.value_rank=12", *prompts))
    assert not (tmp_path / "gpt2-out").exists()


def config_for_decoder(checkpoint, out, *overrides):
    """A conversion of the decoder at ``checkpoint``; without a fitting setting among ``overrides``, unfitted
    (collab.fit_steps=0: no general recipe)."""
    fits = any(o.split("=")[0].removeprefix("collab.") in script.FIT_KEYS for o in overrides)
    return config(f"model={checkpoint}", f"output_dir={out}", "collab.n_iter_max=3",
                  *(() if fits else ("collab.fit_steps=0",)), *overrides)


def tiny_gpt2(checkpoint):
    """A 2-layer GPT-2 with a character tokenizer, saved at ``checkpoint``."""
    torch.manual_seed(0)
    config_ = transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=40, n_positions=64,
                                      initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.GPT2LMHeadModel(config_).save_pretrained(checkpoint)
    character_tokenizer().save_pretrained(checkpoint)
    return checkpoint


def test_calibration_texts_from_a_file(tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("The museum opens at ten.\nIt rained all day.\nIs it open on Mondays?\nThey walked home.\n")
    out = tmp_path / "out"
    plain = script.run(config("collab.rank=128", "collab.n_iter_max=2", f"output_dir={tmp_path / 'plain'}"))
    aware = script.run(config("collab.rank=128", "collab.n_iter_max=2", f"collab.calibration={texts}",
                              "collab.calibration_samples=3", f"output_dir={out}"))
    assert aware["config"]["collab"]["calibration"] == str(texts) and (out / "config.json").is_file()
    errors = [[layer["relative_error"] for layer in result["layers"]] for result in (plain, aware)]
    assert errors[0] != errors[1]


def test_fit_steps_fit_the_converted_layers_on_the_calibration_texts(tmp_path):
    """``collab.fit_steps``: after the conversion each layer is trained on the calibration windows (a decoder reads
    its text file as windows) to give the original's attention output; the report gives each layer's error before and
    after, the saved model is the fitted one, and it is closer to the original than the same conversion without the
    fit."""
    checkpoint = tiny_gpt2(tmp_path / "gpt2")
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"{w} the cat sat on the mat and {w} ran home\n" for w in ("one", "two", "six", "ten")
                             * 12))
    common = ("collab.rank=12", "collab.value_rank=12", f"collab.calibration={texts}", "compare_prompts=[the cat sat]",
              "collab.calibration_max_length=16")
    plain = script.run(config_for_decoder(checkpoint, tmp_path / "plain", *common))
    fitted = script.run(config_for_decoder(checkpoint, tmp_path / "fitted", *common, "collab.fit_steps=30"))
    assert plain["fit"] is None and fitted["config"]["collab"]["fit_steps"] == 30
    layers = fitted["fit"]["layers"]
    assert [layer["name"] for layer in layers] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert all(layer["kept_fit"] and layer["error_after"] < layer["error_before"] for layer in layers)
    assert fitted["comparison"]["max_abs_diff"] < plain["comparison"]["max_abs_diff"]
    original = AutoModelForCausalLM.from_pretrained(checkpoint)
    rows = windows(character_tokenizer(), texts.read_text(), 16, 64)  # what the fits read

    def errors(*names):
        with torch.no_grad():
            return [(AutoModelForCausalLM.from_pretrained(tmp_path / name)(rows).logits - original(rows).logits).norm()
                    for name in names]

    assert errors("fitted") < errors("plain")
    # collab.e2e_steps: then all the layers together, to the original's output; kept only where it lowers the loss
    assert fitted["fit"]["tokens"] == 64 * 16  # the first 64 windows: the default calibration of a decoder's file
    both = script.run(config_for_decoder(checkpoint, tmp_path / "both", *common, "collab.fit_steps=30",
                                         "collab.e2e_steps=20"))
    assert fitted["end_to_end"] is None and both["config"]["collab"]["e2e_steps"] == 20
    report = both["end_to_end"]
    assert report["steps"] == 20 and report["kept_fit"] and report["loss_after"] < report["loss_before"]
    assert [x["error_after"] for x in both["fit"]["layers"]] == pytest.approx([x["error_after"] for x in layers])
    assert errors("both") < errors("fitted")


def test_the_end_to_end_fit_trains_on_its_own_texts(tmp_path):
    """collab.e2e_texts: the end-to-end fit reads 16 texts of that file per step (one pass over fresh text; all of
    them when the file holds fewer), not the calibration windows; the layer fit still reads the calibration windows.
    Without it the end-to-end fit reads 4 windows of the calibration file a step, from the first."""
    checkpoint = tiny_gpt2(tmp_path / "gpt2")
    calibration = tmp_path / "calibration.txt"  # windows of 64 tokens: all the positions the model reads
    calibration.write_text("".join(f"{w} the cat sat on the mat\n" for w in ("one", "two", "six", "ten") * 16))
    fresh = tmp_path / "fresh.txt"  # every line 12 characters: the tokens count the texts drawn
    fresh.write_text("".join(f"a dog ran {i:02d}\n" for i in range(40)))
    per_text = len(character_tokenizer()("a dog ran 00")["input_ids"])
    common = ("collab.rank=12", "collab.value_rank=12", f"collab.calibration={calibration}",
              "compare_prompts=[the cat sat]", "collab.fit_steps=5")
    plain = script.run(config_for_decoder(checkpoint, tmp_path / "plain", *common, "collab.e2e_steps=2"))
    fresh_run = script.run(config_for_decoder(checkpoint, tmp_path / "fresh", *common, "collab.e2e_steps=2",
                                              f"collab.e2e_texts={fresh}"))
    assert fresh_run["config"]["collab"]["e2e_texts"] == str(fresh)
    assert fresh_run["end_to_end"]["tokens"] == 2 * 16 * per_text  # 32 of the 40 texts
    assert plain["end_to_end"]["tokens"] == 2 * 4 * 64  # 2 steps of 4 windows
    held = len(character_tokenizer()(calibration.read_text())["input_ids"]) // 63
    assert held < 64 and fresh_run["fit"]["tokens"] == plain["fit"]["tokens"] == held * 64  # all it holds
    many = script.run(config_for_decoder(checkpoint, tmp_path / "many", *common, "collab.e2e_steps=4",
                                         f"collab.e2e_texts={fresh}"))
    assert many["end_to_end"]["tokens"] == 40 * per_text  # fewer texts than the steps take: all of them


def test_distill_steps_train_every_weight_toward_the_original(tmp_path):
    """collab.distill_steps: after the conversion (and any fit), every weight of the decoder trained on the original's
    next-token distributions, 4 windows of collab.calibration_max_length tokens a step drawn from the windows the
    file holds: the KL to the original on the file's windows falls, and weights the conversion does not touch
    move."""
    checkpoint = tiny_gpt2(tmp_path / "gpt2")
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("".join(f"the {w} cat sat on the mat and then it ran home\n" for w in ("red", "old", "big")
                                   * 8))
    common = ("collab.rank=12", "collab.value_rank=12", f"collab.calibration={calibration}",
              "collab.calibration_max_length=32", "compare_prompts=[the cat sat]")
    plain = script.run(config_for_decoder(checkpoint, tmp_path / "plain", *common))
    both = script.run(config_for_decoder(checkpoint, tmp_path / "distilled", *common, "collab.distill_steps=6"))
    assert plain["distillation"] is None and both["config"]["collab"]["distill_steps"] == 6
    assert both["distillation"]["windows"] == 24 and both["distillation"]["tokens"] == 24 * 32
    assert any("loss" in row for row in both["distillation"]["history"])
    rows = windows(character_tokenizer(), calibration.read_text(), 32, 24)
    original = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    models = {name: AutoModelForCausalLM.from_pretrained(tmp_path / name).eval() for name in ("plain", "distilled")}
    with torch.no_grad():
        target = original(rows).logits.log_softmax(-1)
        kl = {name: torch.nn.functional.kl_div(m(rows).logits.log_softmax(-1), target, log_target=True,
                                               reduction="batchmean").item() for name, m in models.items()}
    assert kl["distilled"] < kl["plain"]
    embeddings = [m.transformer.wte.weight for m in (models["plain"], models["distilled"])]
    assert torch.equal(embeddings[0], original.transformer.wte.weight)  # the conversion leaves them
    assert not torch.equal(embeddings[1], embeddings[0])  # the distillation trains them


def test_a_decoder_s_text_file_is_cut_into_windows_as_it_is_in_a_drawn_order(tmp_path):
    """A text file read as windows (a decoder's, scripts/reparametrize.py): its text as it is, indentation and blank
    lines kept (code reads as code), cut one after another, every window of the file in an order drawn with the seed;
    the calibration asking for more windows than the file holds reads all of them."""
    path = tmp_path / "code.txt"
    text = "def f():\n    return 1\n\n\nclass a:\n    pass\n" * 8
    path.write_text(text)
    method = dataclasses.replace(MethodSettings.from_config({"method": "key-svd", "rank": 8, "fit_steps": 2}),
                                 calibration=CalibrationSettings(str(path), 1000, 9, windows=True))
    rows = calibrate_module.file_windows(character_tokenizer(), method, seed=0)
    in_order = windows(character_tokenizer(), text, 9, len(text) // 8)
    assert rows.shape == in_order.shape == (len(text) // 8, 9)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, in_order.tolist()))
    assert not torch.equal(rows, in_order)
    assert torch.equal(rows, calibrate_module.file_windows(character_tokenizer(), method, seed=0))


def test_own_text_holds_the_distillation_windows(monkeypatch):
    """With own text, the original is sampled once for every fit: the distillation's windows too (the first
    collab.distill_steps x 4, those the end-to-end fit reads)."""
    asked = []
    monkeypatch.setattr(calibrate_module, "own_windows",
                        lambda model, tokenizer, length, count, seed, text: asked.append((count, text))
                        or torch.zeros(count, length))
    group = {"method": "key-svd", "rank": 8, "fit_steps": 5}
    for extra, count in (({}, 64), ({"e2e_steps": 20}, 96), ({"distill_steps": 40}, 160),
                         ({"e2e_steps": 20, "distill_steps": 10}, 96)):
        method = MethodSettings.from_config({**group, **extra})
        own = calibrate_module.fitting_windows(None, None, method, seed=0)
        assert asked[-1] == (count, "own")  # the model's own distribution when no calibration is named
        if method.distill_steps:
            assert len(calibrate_module.distill_windows(None, method, 0, own)) == 4 * method.distill_steps


@pytest.mark.parametrize("extra, message", [
    (["collab.distill_steps=400", "collab.calibration=TEXTS", "collab.calibration_max_length=32"],
     "collab.distill_steps=400 reads 1600 windows of 32 tokens .* which holds 2: give fewer steps or more text"),
    (["collab.fit_steps=2", "collab.e2e_steps=4", "collab.calibration=TEXTS", "collab.calibration_max_length=8"],
     "collab.e2e_steps=4 reads 32 windows of 8 tokens .* which holds 13: give fewer steps or more text"),
    (["collab.fit_steps=2", "collab.calibration=TEXTS", "collab.calibration_max_length=8",
      "collab.calibration_samples=20"],  # given, not the default (which reads all 13)
     "collab.calibration_samples=20: .* holds 13 windows of 8 tokens; give collab.calibration_samples=13 or fewer, "
     "or more text"),
    (["collab.fit_steps=2", "collab.calibration=TEXTS", "collab.calibration_max_length=128"],
     "collab.calibration_max_length=128: windows of that many tokens are longer than the 64 positions gpt2 reads; "
     "give collab.calibration_max_length=64 or fewer"),
    (["collab.fit_steps=2", "collab.calibration=SHORT", "collab.calibration_max_length=64"],
     "collab.calibration=.* holds fewer tokens than one window of 64: give more text or a shorter "
     "collab.calibration_max_length"),
    (["collab.distill_steps=-1"], "collab.distill_steps must be a number of optimizer steps"),
])
def test_distill_settings_are_checked_before_anything_is_written(tmp_path, extra, message):
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n" * 4)
    (tmp_path / "short.txt").write_text("the cat sat\n")
    checkpoint = tiny_gpt2(tmp_path / "gpt2")
    cfg = config_for_decoder(checkpoint, tmp_path / "out", "collab.rank=12", "collab.value_rank=12",
                             *[e.replace("TEXTS", str(texts)).replace("SHORT", str(tmp_path / "short.txt"))
                               for e in extra])
    with pytest.raises((ValueError, cli.BadInput), match=message):
        script.run(cfg)
    assert not (tmp_path / "out").exists()


def test_an_encoder_is_not_distilled(tmp_path, minilm_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("The museum opens at ten.\n" * 4)
    cfg = config("collab.rank=128", f"collab.calibration={texts}", "collab.distill_steps=2",
                 f"output_dir={tmp_path / 'out'}")
    with pytest.raises(cli.BadInput, match="collab.distill_steps=2 distils the original's next-token distributions, "
                                           "which bert, an encoder, does not give"):
        script.run(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, error, message", [
    (["collab.e2e_texts=TEXTS"], ValueError, "collab.e2e_texts=.* is what the end-to-end fit and the distillation "
                                             "train on: set collab.e2e_steps or collab.distill_steps too"),
    (["collab.e2e_steps=3", "collab.e2e_texts=/no/fresh.txt"], FileNotFoundError,
     "collab.e2e_texts=/no/fresh.txt: no such file"),
    (["collab.e2e_steps=3", "collab.e2e_texts=FOLDER"], ValueError, "collab.e2e_texts=.* is a folder"),
    (["collab.e2e_steps=3", "collab.e2e_texts=EMPTY"], ValueError, "collab.e2e_texts=.* holds no texts"),
])
def test_end_to_end_texts_are_checked_before_anything_is_written(tmp_path, extra, error, message):
    texts = tmp_path / "texts.txt"
    texts.write_text("The museum opens at ten.\nIt rained all day.\n")
    (tmp_path / "empty.txt").write_text("\n \n")
    paths = {"TEXTS": str(texts), "FOLDER": str(tmp_path), "EMPTY": str(tmp_path / "empty.txt")}
    overrides = []
    for item in extra:
        for key, path in paths.items():
            item = item.replace(key, path)
        overrides.append(item)
    with pytest.raises(error, match=message):
        script.run(config(f"collab.calibration={texts}", *overrides, f"output_dir={tmp_path / 'out'}"))
    assert not (tmp_path / "out").exists()


def test_tucker_with_per_layer_ranks(tmp_path):
    ranks = [384, 384, 256, 192, 128, 64]
    out = tmp_path / "out"
    cfg = config("collab=tucker", f"collab.rank=[{','.join(map(str, ranks))}]", "collab.n_iter_max=2",
                 f"output_dir={out}")
    result = script.run(cfg)
    assert result["method"] == "tucker" and result["rank"] == ranks
    assert [layer["rank"] for layer in result["layers"]] == ranks
    errors = [layer["relative_error"] for layer in result["layers"]]
    assert errors[:2] == [0.0, 0.0] and all(0 < e < 1 for e in errors[2:])
    assert json.loads((out / "config.json").read_text())["collab_ranks"] == ranks


# ---------------------------------------------------------------------------------------------------
# Errors: raised before anything is written


def test_non_empty_output_dir_needs_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="overwrite=true"):
        script.run(config("collab.rank=384", f"output_dir={out}"))
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    script.run(config("collab.rank=384", f"output_dir={out}", "overwrite=true"))
    assert not (out / "keep.txt").exists() and (out / "reparam_report.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["collab.rank=0"], ValueError, "rank 0"),
        (["collab.rank=999"], ValueError, "rank 999"),
        (["collab.value_rank=999"], ValueError, r"collab.value_rank=999: value_rank: rank 999 .* \[1, 384\]"),
        (["collab.rank=[384,384]"], ValueError, "got 2 ranks"),
        (["collab.rank=abc"], ValueError, "collab.rank must be an integer"),
        (["collab=none"], ValueError, "collab=none"),
        (["collab=prune"], ValueError, r"collab=prune .* python scripts/train_glue.py task=<task> collab=prune"),
        (["collab.method=svd"], ValueError, r"collab.budget does not apply to collab.method=svd|collab.solver"),
        (["collab=svd", "collab.rank=100"], ValueError, "not a multiple of the 12 heads"),
        (["collab.calibration=task"], ValueError, "only for the GLUE pipeline"),
        (["collab.calibration=/no/texts.txt"], FileNotFoundError, "collab.calibration=/no/texts.txt: no such file"),
        (["collab.fit_steps=10"], ValueError, "collab.calibration=own .* samples the model's own text, which bert, "
                                              "an encoder, does not write: set collab.calibration"),
        (["collab.fit_steps=-1"], ValueError, r"collab.fit_steps must be a number of steps per layer \(0 or null"),
        (["collab.e2e_steps=10"], ValueError, "collab.calibration=own .* which bert, an encoder, does not write"),
        (["collab.e2e_steps=-1"], ValueError, r"collab.e2e_steps must be a number of optimizer steps \(0 or null"),
        (["+collab.importance_data=x.tsv"], ValueError, "unknown key collab.importance_data"),
        (["model=/no/such/checkpoint"], FileNotFoundError, "no checkpoint at /no/such/checkpoint"),
        (["model=./missing-checkpoint"], FileNotFoundError, "no checkpoint at"),
        (["model=nobody-has-this-model-xyz"], FileNotFoundError, "HF_HUB_OFFLINE"),
    ],
)
def test_errors_write_nothing(tmp_path, overrides, error, message):
    with pytest.raises(error, match=message):
        script.run(config(*overrides, f"output_dir={tmp_path / 'out'}"))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# collab_attn.models.checkpoints


def test_resolve_model_checks_local_checkpoints(tmp_path, minilm_path):
    assert resolve_model("minilm") == minilm_path
    assert resolve_model(minilm_path) == minilm_path
    assert resolve_model("bert-base-uncased") == "bert-base-uncased"
    assert resolve_model("google-bert/bert-base-uncased") == "google-bert/bert-base-uncased"
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        resolve_model(str(tmp_path / "config.json"))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        resolve_model("~/definitely/not/here")


def test_load_keeps_task_head(tmp_path, minilm_path):
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=3).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(tmp_path)
    model, _ = load_model_and_tokenizer(str(tmp_path), model_class=None)
    assert type(model).__name__ == "BertForSequenceClassification"
    model, _ = load_model_and_tokenizer(str(tmp_path))
    assert type(model).__name__ == "BertModel"

    out = tmp_path.parent / f"{tmp_path.name}-converted"
    result = script.run(config(f"model={tmp_path}", "collab.rank=384", f"output_dir={out}"))
    assert result["comparison"]["logits_max_abs_diff"] <= 1e-4
    assert json.loads((out / "config.json").read_text())["architectures"] == ["CollabBertForSequenceClassification"]


# ---------------------------------------------------------------------------------------------------
# The command line


def _cli(warm_python, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run(
        [warm_python(env), str(SCRIPT), *args, f"hydra.run.dir={cwd / 'hydra'}"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )


def _main(*args: str, cwd: Path, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """The command line through the script's ``main`` in this process, for input it refuses before Hydra runs the
    job (the script as a real process: ``_cli``)."""
    from test_entry_points import script

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["reparametrize", *args, f"hydra.run.dir={cwd / 'hydra'}"])
    with pytest.raises(SystemExit) as stop:
        script("reparametrize").main()
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, stop.value.code, captured.out, captured.err)


def test_cli_end_to_end(tmp_path, warm_python):
    """The script as a real process, from the command line to the saved model."""
    out = tmp_path / "model"
    done = _cli(warm_python, "model=minilm", "collab.rank=384", f"output_dir={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "| total |" in done.stdout and "max" in done.stdout
    assert json.loads((out / "reparam_report.json").read_text())["comparison"]["max_abs_diff"] <= 1e-4


def test_cli_bad_rank_exits_2(tmp_path, monkeypatch, capsys):
    out = tmp_path / "model"
    done = _main("collab.rank=999", f"output_dir={out}", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert done.returncode == 2
    assert "error: collab.rank=999: rank 999" in done.stderr and "Traceback" not in done.stderr + done.stdout
    assert not out.exists()


# Progress bars (loading the weights) also go to stderr; without them an error must be all that is there.
QUIET = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}


def test_cli_nan_in_a_query_weight_is_one_error_line_and_writes_nothing(tmp_path, minilm_path, warm_python):
    """A checkpoint whose weights only the conversion can judge (a NaN in layer 2's query projection): the
    conversion's refusal is bad input like the checks before it: exit status 2, its message as the one line on stderr,
    no traceback, no output folder (nor a temporary one beside it). The script as a real process."""
    checkpoint = tmp_path / "minilm-nan"
    model = AutoModel.from_pretrained(minilm_path)
    with torch.no_grad():
        model.encoder.layer[2].attention.self.query.weight[7, 11] = float("nan")
    model.save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(checkpoint)
    out = tmp_path / "model"
    done = _cli(warm_python, f"model={checkpoint}", f"output_dir={out}", cwd=tmp_path, **QUIET)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "encoder.layer.2.attention.self: the query weights contain NaN or Inf" in lines[0], lines[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hydra", "minilm-nan"]  # Hydra's log of the run, no output


def test_generation_comparison_survives_a_model_that_ends_its_answer_first():
    """One model ends with end-of-sequence after 2 new tokens, the other goes on: the comparison counts the tokens
    they share, over the shorter continuation (it used to stop with a shape error on SmolLM2)."""

    class Scripted(torch.nn.Module):
        def __init__(self, continuation):
            super().__init__()
            self.continuation = torch.tensor(continuation)

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return transformers.modeling_outputs.CausalLMOutput(logits=torch.zeros(*input_ids.shape, 5))

        def generate(self, input_ids, attention_mask=None, **settings):
            return torch.cat([input_ids, self.continuation[None]], dim=1)

    class Tokenizer:
        pad_token_id, eos_token_id = 0, 0

        def __call__(self, prompt, return_tensors):
            return {"input_ids": torch.tensor([[3, 4]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)}

        def decode(self, tokens):
            return " ".join(map(str, tokens.tolist()))

    result = script.compare_generation(Scripted([1, 2, 0]), Scripted([1, 2, 3, 4, 1]), Tokenizer(), ["p"], 5)
    row = result["prompts"][0]
    assert row["same_tokens_before_first_difference"] == 2 and row["new_tokens"] == 3
    assert row["original"] == "1 2 0" and row["converted"] == "1 2 3 4 1"
    shorter = script.compare_generation(Scripted([1, 2]), Scripted([1, 2, 3]), Tokenizer(), ["p"], 5)
    assert shorter["prompts"][0]["same_tokens_before_first_difference"] == 2


def tiny_llama(checkpoint):
    """A 2-layer Llama with grouped key/value heads (2 groups of 12) and a character tokenizer, saved at
    ``checkpoint``."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_hidden_layers=2,
        intermediate_size=64, vocab_size=40, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)).save_pretrained(checkpoint)
    character_tokenizer().save_pretrained(checkpoint)
    return checkpoint


@pytest.mark.parametrize("overrides, recipe", [
    ([], True),  # a decoder caching 12 + 12 numbers a token and layer of 2 x 2 x 12, no fitting setting: the recipe
    (["collab.fit_steps=0"], False),  # any fitting setting, 0 included, turns it off
    (["collab.e2e_steps=8"], False),
    (["collab.distill_steps=4"], False),
    (["collab.calibration=TEXTS"], False),
    (["collab.rank=24", "collab.value_rank=24"], False),  # the keys and values of both groups: exact
    (["collab.rank=24", "collab.value_rank=null"], False),
    (["collab.rank=24", "collab.value_rank=12"], True),  # the values cut: 36 numbers of 48
    (["collab.calibration_samples=64"], True),  # not a fitting setting: the recipe, with the windows given
])
def test_the_general_recipe_fits_a_decoder_given_no_fitting_setting(tmp_path, overrides, recipe):
    """scripts/reparametrize.py with a decoder, a size that caches less than the original and no texts runs the recipe
    README times (GENERAL_RECIPE: 150 layer steps on 128 windows of the model's own samples, then every weight
    distilled 32 steps on them); the report's collab group says so, and windows the user gives are kept."""
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n")
    checkpoint = tiny_llama(tmp_path / "llama")
    given = [o.replace("TEXTS", str(texts)) for o in overrides]
    sizes = [] if any(o.startswith("collab.rank=") for o in given) else ["collab.rank=12", "collab.value_rank=12"]
    settings = script.settings_of(config(f"model={checkpoint}", f"output_dir={tmp_path / 'out'}", "collab=key-svd",
                                         *sizes, *given))
    method, _ = script.check(settings)
    assert script.GENERAL_RECIPE == {"fit_steps": 150, "distill_steps": 32, "calibration_samples": 128}
    if recipe:
        assert (method.fit_steps, method.distill_steps, method.e2e_steps) == (150, 32, None)
        assert method.calibration.from_own and method.to_group()["calibration"] == "own"
        assert method.calibration.samples == (64 if "collab.calibration_samples=64" in given else 128)
    else:
        given_method = script.method_settings(settings["collab"])
        assert dataclasses.replace(method, calibration=given_method.calibration) == given_method  # as given
        if method.calibration is not None:  # a decoder's windows: no longer than the 64 positions the model reads
            assert method.calibration.max_length == 64 and method.calibration.from_windows
            assert method.calibration.windows == ("collab.calibration=TEXTS" in overrides)


def test_own_text_without_a_beginning_of_text_token_is_one_clear_error(tmp_path):
    """The general recipe samples the model's own text, which starts from the beginning-of-text token: a tokenizer
    without one is bad input (one error line), and nothing is written."""
    checkpoint = tiny_llama(tmp_path / "llama")
    tokenizer = character_tokenizer()
    tokenizer.bos_token = None
    tokenizer.save_pretrained(checkpoint)
    with pytest.raises(cli.BadInput, match="no beginning-of-text token"):
        script.run(config(f"model={checkpoint}", f"output_dir={tmp_path / 'out'}", "collab=key-svd", "collab.rank=12",
                          "collab.value_rank=12", "collab.calibration_max_length=16"))
    assert not (tmp_path / "out").exists()


def test_the_general_recipe_leaves_encoders_and_methods_that_do_not_fit(tmp_path, minilm_path):
    minilm, _ = script.check(script.settings_of(config(f"output_dir={tmp_path / 'a'}", "collab.rank=64")))
    assert (minilm.fit_steps, minilm.distill_steps, minilm.calibration) == (None, None, None)  # an encoder
    checkpoint = tiny_llama(tmp_path / "llama")
    merged, _ = script.check(script.settings_of(config(f"model={checkpoint}", f"output_dir={tmp_path / 'b'}",
                                                       "collab=drop-kv", "collab.rank=12")))
    assert merged.fit_steps is None and merged.distill_steps is None  # drop-kv fits nothing


def test_export_writes_the_standard_checkpoint_beside_the_converted_model(tmp_path):
    """export=transformers: <output_dir>/standard is a plain LlamaForCausalLM with one key/value head of the shared
    width, whose logits are the converted model's: after a distillation too, which moved every weight."""
    checkpoint = tiny_llama(tmp_path / "llama")
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat and then it ran home\n" * 12)
    out = tmp_path / "out"
    result = script.run(config(f"model={checkpoint}", f"output_dir={out}", "collab=key-svd", "collab.rank=12",
                               "collab.value_rank=12", "collab.bands=shared", "export=transformers",
                               f"collab.calibration={texts}", "collab.calibration_max_length=32",
                               "collab.distill_steps=2", "compare_prompts=[the cat sat]", "max_new_tokens=3"))
    assert result["export"] == "standard" and result["distillation"]["windows"] == 8
    standard = AutoModelForCausalLM.from_pretrained(out / "standard")
    converted = AutoModelForCausalLM.from_pretrained(out)
    embeddings = [m.model.embed_tokens.weight for m in (standard, converted, AutoModelForCausalLM.from_pretrained(
        checkpoint))]
    assert torch.equal(embeddings[0], embeddings[1]) and not torch.equal(embeddings[1], embeddings[2])
    assert type(standard).__name__ == "LlamaForCausalLM" and standard.config.num_key_value_heads == 1
    assert standard.config.head_dim == 12
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(standard(tokens).logits, converted(tokens).logits, atol=1e-5, rtol=1e-4)
    assert AutoTokenizer.from_pretrained(out / "standard").get_vocab() == AutoTokenizer.from_pretrained(
        checkpoint).get_vocab()


def test_a_merged_model_exports_as_grouped_query_attention(tmp_path):
    """export=transformers after collab=merge-kv: the source's two key/value heads merged into one, written as a plain
    LlamaForCausalLM with one key/value head of the source's head size (no bands or value rank to ask for)."""
    checkpoint = tiny_llama(tmp_path / "llama")
    out = tmp_path / "out"
    script.run(config(f"model={checkpoint}", f"output_dir={out}", "collab=merge-kv", "collab.rank=12",
                      "export=transformers", "compare_prompts=[the cat sat]", "max_new_tokens=3"))
    standard = AutoModelForCausalLM.from_pretrained(out / "standard")
    converted = AutoModelForCausalLM.from_pretrained(out)
    assert standard.config.num_key_value_heads == 1 and standard.config.head_dim == 12
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(standard(tokens).logits, converted(tokens).logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    (["collab=key-svd", "collab.rank=12", "collab.value_rank=12"], "needs collab.bands=shared"),
    (["collab=drop-kv", "collab.rank=[12,24]"], r"needs one collab.rank \(got rank \[12, 24\]\)"),
    (["collab=key-svd", "collab.rank=12", "collab.bands=shared"], "value_rank equal to it"),
    (["collab=key-svd", "collab.rank=12", "collab.value_rank=8", "collab.bands=shared"], "value_rank equal to it"),
    (["collab=kv-svd", "collab.rank=12"], "collab=kv-svd has no standard form"),
    (["collab=key-svd", "collab.rank=12", "collab.value_rank=12", "collab.bands=shared", "export=onnx"],
     "unknown export 'onnx'"),
    (["collab=key-svd", "collab.rank=12", "collab.value_rank=12", "collab.bands=shared", "export=gguf"],
     "set export_vocabulary"),
    (["collab=key-svd", "collab.rank=12", "collab.value_rank=12", "collab.bands=shared",
      "export_vocabulary=x.gguf"], "set export=gguf"),
])
def test_export_settings_are_refused_before_anything_is_loaded(tmp_path, overrides, message):
    checkpoint = tiny_llama(tmp_path / "llama")
    export = [] if any(o.startswith("export=") for o in overrides) or any(
        o.startswith("export_vocabulary") for o in overrides) else ["export=transformers"]
    with pytest.raises(ValueError, match=message):
        script.check(script.settings_of(config(f"model={checkpoint}", f"output_dir={tmp_path / 'out'}", *overrides,
                                               *export)))
    assert not (tmp_path / "out").exists()


def test_export_of_a_model_without_rotary_positions_is_refused(tmp_path, minilm_path):
    with pytest.raises(ValueError, match="has no standard rotary form"):
        script.check(script.settings_of(config(f"output_dir={tmp_path / 'out'}", "collab=key-svd",
                                               "collab.rank=12", "export=transformers")))
