"""The cache race end to end on a tiny trained model: ``convert_lm.py cache_fractions=...`` sizes every method for
each budget (keys and values together where the method cuts both), skips the methods that cannot get there,
re-trains plain or distilled from the original, and ``summarize.py race`` tabulates and draws the runs."""

import json

import pytest
import torch
from test_lm import TINY, compose_cfg, errorbars, load_script, saved_figures

from collab_attn import cli
from collab_attn.char_lm import race_summary
from collab_attn.char_lm.convert import check
from collab_attn.cli import settings_of
from collab_attn.distillation import DistillSettings, distillation_loss

CONVERT = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "block_size=16", "eval_iters=2",
           "trainer.max_steps=10", "trainer.per_device_train_batch_size=4", "trainer.warmup_steps=1",
           "retrain_fraction=0.2", "threads=1", "progress=false", "sample_chars=8", "checkpoint_every=null",
           "calibration_blocks=8", "importance_samples=8"]


@pytest.fixture
def trained(text_file, tmp_path):
    train_dir = tmp_path / "race" / "tiny"
    load_script("train_lm").run(compose_cfg("train_lm", [*TINY, f"data.path={text_file}", f"output_dir={train_dir}",
                                                          "trainer.max_steps=10"]))
    return train_dir


def convert(text_file, train_dir, variant, *extra):
    cfg = compose_cfg("convert_lm", [*CONVERT, f"data.path={text_file}", f"train_dir={train_dir}",
                                     f"output_dir={train_dir}/{variant}/seed0", *extra])
    return load_script("convert_lm").run(cfg)


def test_the_race_sizes_every_method_for_each_budget_and_is_summarized(text_file, trained, capsys, monkeypatch):
    methods = "methods=[none,cp,kv-svd,key-svd,svd]"
    records = convert(text_file, trained, "convert", methods, "cache_fractions=[0.5,0.25]")
    # 1 layer, 2 heads of 8: the original caches 2 x 16 numbers; cp 7 + 2 + 7, kv-svd a latent of 16, svd 2 x 3 keys
    # + 2 content logits + 2 x 3 values = 14 <= 16; at a quarter 3/3, 8, 2 x 1 + 2 + 2 x 1 = 6 <= 8
    assert [r["name"] for r in records] == ["none-k16", "cp-k7-v7", "cp-k3-v3", "kv-svd-k16", "kv-svd-k8",
                                            "svd-k6-v6", "svd-k2-v2"]
    assert "key-svd at 0.5 of the cache: no size of the method fits" in capsys.readouterr().out
    for record in records[1:]:
        assert record["cache_bytes_per_token_bf16"] <= record["cache_fraction"] * 64
        assert record["retrain_curve"][-1]["step"] == 2
    kv_half = records[3]
    assert kv_half["converted_val_loss"] == pytest.approx(kv_half["original_val_loss"], abs=1e-4)  # exact at d
    assert convert(text_file, trained, "convert", methods, "cache_fractions=[0.5,0.25]") == records  # resumes

    distilled = convert(text_file, trained, "convert_distill", "methods=[cp]", "cache_fractions=[0.25]",
                        "distill={alpha:0.5,temperature:2.0}")
    assert distilled[0]["distill"] == {"alpha": 0.5, "temperature": 2.0}
    plain = records[2]
    assert distilled[0]["converted_val_loss"] == plain["converted_val_loss"]  # the same conversion ...
    assert distilled[0]["retrained_val_loss"] != plain["retrained_val_loss"]  # ... re-trained another way

    saved = saved_figures(monkeypatch)
    results = race_summary.write_summary(trained.parent)
    assert results.name == "results.md"  # README.md stays the hand-written answer
    text = results.read_text()
    assert "| 2 x 4 x 16 = 128 |" in text  # re-trained: every weight, 2 steps x batch 4 x block 16 per seed
    assert "### `tiny/convert`" in text and "### `tiny/convert_distill`" in text
    plain_part = text.split("### `tiny/convert_distill`")[0]
    plain_table = plain_part.split("Per budget and stage")[0]
    rows = {line.split(" | ")[1]: line for line in plain_table.splitlines() if line.startswith("| 0.25 |")}
    assert set(rows) == {"cp", "kv-svd", "svd"}
    assert f"| {plain['converted_val_loss']:.4f} ± 0.0000 | {plain['retrained_val_loss']:.4f} ± 0.0000 |" in rows["cp"]
    best = min(records[1:], key=lambda r: r["converted_val_loss"] if r["cache_fraction"] == 0.25 else 9)
    assert f"| 0.25 | converted | 0 | {best['method']} ({best['converted_val_loss']:.4f}) |" in text
    # the paired rule with one seed: never a verdict, every method tied with the best
    verdicts = plain_part.split("Per budget and stage")[1].split("Per method and budget")[0]
    (verdict,) = [line for line in verdicts.splitlines() if line.startswith("| 0.25 | converted | ")]
    assert f"| 0.25 | converted | {best['method']} ({best['converted_val_loss']:.4f}) |" in verdict
    cp_versus_original = plain["converted_val_loss"] - plain["original_val_loss"]
    assert f"| 0.25 | cp | {cp_versus_original:+.4f}, 1 seed: tie |" in plain_part
    kv_quarter = records[4]
    cp_versus_mla = plain["converted_val_loss"] - kv_quarter["converted_val_loss"]
    assert f"| 0.25 | converted | {cp_versus_mla:+.4f}, 1 seed: tie | - | - | - |" in plain_part  # no aware runs here
    assert ", 1 seed: tie |" in verdict and verdict.count(",") >= 2
    converted_panel, retrained_panel = saved[0].axes
    series = errorbars(converted_panel)
    assert set(series) == {"cp", "kv-svd", "svd"}
    cp_points = sorted((r["cache_bytes_per_token_bf16"], r["converted_val_loss"]) for r in records[1:3])
    assert list(zip(series["cp"][0], series["cp"][1])) == cp_points
    labels = [line.get_label() for line in retrained_panel.get_lines() if not line.get_label().startswith("_")]
    assert f"none, re-trained {records[0]['retrained_val_loss']:.4f}" in labels


def test_a_budget_and_ranks_together_are_refused(text_file, trained):
    cfg = compose_cfg("convert_lm", [*CONVERT, f"data.path={text_file}", f"train_dir={trained}",
                                     "ranks=[4]", "cache_fractions=[0.5]"])
    with pytest.raises(cli.BadInput, match="ranks and cache_fractions both set"):
        check(settings_of(cfg))
    cfg = compose_cfg("convert_lm", [*CONVERT, f"data.path={text_file}", f"train_dir={trained}",
                                     "cache_fractions=[0.5,0]"])
    with pytest.raises(cli.BadInput, match="cache_fractions must be above 0"):
        check(settings_of(cfg))
    cfg = compose_cfg("convert_lm", [*CONVERT, f"data.path={text_file}", f"train_dir={trained}",
                                     "distill={alpha:2}"])
    with pytest.raises(cli.BadInput, match=r"distill.alpha=2 must lie in \[0, 1\]"):
        check(settings_of(cfg))
    assert not (trained / "convert").exists()  # nothing written


def test_the_summary_refuses_a_folder_without_race_runs(tmp_path, capsys):
    (tmp_path / "m" / "convert" / "seed0" / "runs").mkdir(parents=True)
    (tmp_path / "m" / "convert" / "seed0" / "runs" / "x.json").write_text(json.dumps({"method": "cp"}))
    assert run_summary(tmp_path, capsys) == 2
    assert run_summary(tmp_path / "empty", capsys) == 2


def run_summary(root, capsys) -> int:
    try:
        code = load_script("summarize").main(["race", str(root)])
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    if code == 2:
        assert err.startswith("error: ") and err.count("\n") == 1 and not out
    return code


def test_distillation_counts_every_position_of_a_language_model_as_one_example():
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 7, generator=generator), torch.randn(2, 5, 7, generator=generator)
    labels = torch.randint(0, 7, (2, 5), generator=generator)

    class Out:
        def __init__(self, logits):
            self.logits = logits

    settings = DistillSettings(alpha=0.3, temperature=2.0)
    sequence = distillation_loss(Out(student), Out(teacher), labels, settings, regression=False)
    flat = distillation_loss(Out(student.flatten(0, 1)), Out(teacher.flatten(0, 1)), labels.flatten(), settings,
                             regression=False)
    assert sequence["loss"] == pytest.approx(float(flat["loss"]))
    expected = torch.nn.functional.cross_entropy(student.flatten(0, 1), labels.flatten())
    assert sequence["label_loss"] == pytest.approx(float(expected))
