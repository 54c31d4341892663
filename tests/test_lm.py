"""Character-level language modelling (collab_attn/char_lm, scripts/train_lm.py, scripts/convert_lm.py,
scripts/summarize.py lm) on tiny models and a made-up text; the real Tiny Shakespeare where it is present."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from conftest import LM_TEXT as TEXT
from conftest import with_cache
from hydra import compose, initialize_config_dir
from matplotlib.figure import Figure
from omegaconf import OmegaConf
from transformers import default_data_collator

import collab_attn
from collab_attn.char_lm import data, models, runs, runs_summary
from collab_attn.char_lm.convert import validation_loss
from collab_attn.char_lm.sampling import sample_text
from collab_attn.stats import paired_comparison
from collab_attn.training import training_args

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "../shared/data/tinyshakespeare/input.txt"
TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "block_size=16", "eval_iters=2",
        "trainer.max_steps=6", "trainer.eval_steps=3", "trainer.logging_steps=3",
        "trainer.per_device_train_batch_size=4", "trainer.warmup_steps=1", "threads=1", "progress=false",
        "sample_chars=20", "checkpoint_every=null"]


def settings_for(primary: str, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_container(compose(primary, overrides=list(overrides)), resolve=True)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_prepare(text: str):
    """nanoGPT's data/shakespeare_char/prepare.py, verbatim in substance."""
    chars = sorted(list(set(text)))
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = len(text)
    return chars, [stoi[c] for c in text[: int(n * 0.9)]], [stoi[c] for c in text[int(n * 0.9):]]


def test_vocabulary_and_split_match_nanogpt_on_a_made_up_text():
    corpus = data.corpus_from_text(TEXT)
    chars, train, val = nanogpt_prepare(TEXT)
    assert corpus.chars == chars and corpus.train.tolist() == train and corpus.val.tolist() == val
    assert corpus.decode(corpus.encode("to be")) == "to be"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        corpus.encode("Z")
    with pytest.raises(ValueError, match="at least 20"):
        data.corpus_from_text("short")


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="Tiny Shakespeare is not beside the project")
def test_vocabulary_and_split_match_nanogpt_on_tiny_shakespeare():
    corpus = data.load_corpus(SHAKESPEARE)
    chars, train, val = nanogpt_prepare(SHAKESPEARE.read_text())
    assert corpus.chars == chars and corpus.vocab_size == 65
    assert (len(corpus.train), len(corpus.val)) == (1_003_854, 111_540)  # what nanoGPT's prepare.py prints
    assert corpus.train[:1000].tolist() == train[:1000] and corpus.val[-1000:].tolist() == val[-1000:]


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path"):
        data.load_corpus(tmp_path / "nope.txt")


def test_blocks_are_seeded_and_targets_are_the_next_characters():
    corpus = data.corpus_from_text(TEXT)
    a, b, c = (data.train_blocks(corpus, 16, 4, 5, seed) for seed in (0, 0, 1))
    assert len(a) == 20 and torch.equal(a.offsets, b.offsets) and not torch.equal(a.offsets, c.offsets)
    item = a[3]
    start = int(a.offsets[3])
    assert item["input_ids"].tolist() == corpus.train[start : start + 16].tolist()
    assert item["shift_labels"].tolist() == corpus.train[start + 1 : start + 17].tolist()
    val = data.val_blocks(corpus, 16, 4, 2)
    assert torch.equal(val.offsets, data.val_blocks(corpus, 16, 4, 2).offsets) and int(val.offsets.max()) < len(
        corpus.val) - 16


@pytest.mark.parametrize("kind, key", [("concat", 16), ("concat", 8), ("collab", 4)])
def test_every_variant_gets_the_same_batches_with_their_targets(text_file, tmp_path, kind, key):
    """The Trainer's batches are the seeded blocks in order, next-character targets included (the Trainer drops
    keys that are not forward() arguments unless told not to)."""
    settings = settings_for("train_lm", *TINY, f"data.path={text_file}", f"output_dir={tmp_path}")
    corpus = data.load_corpus(text_file)
    model = models.build_model(models.gpt_config(corpus.vocab_size, 16, 1, 2, 16, kind=kind, rank=key), 0)
    blocks = data.train_blocks(corpus, 16, 4, 6, seed=0)
    args = training_args(tmp_path / "ck", 0, runs.trainer_fields(settings, False))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=blocks, data_collator=default_data_collator,
                                   eval_dataset=blocks)
    first = next(iter(trainer.get_train_dataloader()))
    expected = default_data_collator([blocks[i] for i in range(4)])
    assert set(first) == set(expected) and all(torch.equal(first[k], expected[k]) for k in expected)


def test_the_trained_loss_is_the_next_character_loss(text_file, tmp_path):
    settings = settings_for("train_lm", *TINY, f"data.path={text_file}", f"output_dir={tmp_path}")
    corpus = data.load_corpus(text_file)
    model = models.build_model(models.gpt_config(corpus.vocab_size, 16, 1, 2, 16), 0)
    val = data.val_blocks(corpus, 16, 4, 2)
    batch = default_data_collator([val[i] for i in range(len(val))])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten())
    assert validation_loss(model, val, 4, bf16=False) == pytest.approx(float(expected), rel=1e-5)
    run, tokens = runs.train_model(settings, corpus, model, 0, tmp_path / "ck", progress=False)
    curve = runs.learning_curve(run.history)
    assert curve[0]["step"] == 0 and curve[0]["val_loss"] == pytest.approx(float(expected), rel=1e-4)
    assert tokens == 6 * 4 * 16


def test_a_tiny_model_learns(text_file, tmp_path):
    settings = settings_for("train_lm", *TINY, f"data.path={text_file}", f"output_dir={tmp_path}",
                            "trainer.max_steps=40", "trainer.eval_steps=20", "trainer.learning_rate=3e-3")
    corpus = data.load_corpus(text_file)
    model = models.build_model(models.gpt_config(corpus.vocab_size, 16, 1, 2, 16, kind="collab", rank=8), 0)
    run, _ = runs.train_model(settings, corpus, model, 0, tmp_path / "ck", progress=False)
    curve = runs.learning_curve(run.history)
    assert curve[-1]["val_loss"] < curve[0]["val_loss"] - 0.5


def test_concat_and_collab_at_full_rank_with_block_mixing_compute_the_same_logits():
    concat = models.build_model(models.gpt_config(30, 16, 2, 4, 32), 0).eval()
    ids = torch.randint(0, 30, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = concat(input_ids=ids).logits
        collab_attn.reparametrize(concat, 32, method="cp", progress=False)  # at full rank: block mixing, exact
        after = concat(input_ids=ids).logits
    assert models.key_size_of(concat) == 32 and torch.allclose(before, after, atol=1e-5)


def test_configs_sizes_and_refusals():
    plain = models.build_model(models.gpt_config(65, 64, 4, 4, 128), 0)
    assert type(plain).__name__ == "GPT2LMHeadModel" and plain.lm_head.weight is plain.transformer.wte.weight
    assert plain.config.activation_function == "gelu" and plain.config.attn_pdrop == 0.0
    narrow = models.build_model(models.gpt_config(65, 64, 4, 4, 128, kind="concat", rank=32), 0)
    collab = models.build_model(models.gpt_config(65, 64, 4, 4, 128, kind="collab", rank=16,
                                                  mixing_init="ones"), 0)
    assert models.cache_bytes(plain) == 4 * 2 * 128 * 2
    assert models.cache_bytes(collab) == 4 * (16 + 4 + 128) * 2
    counts = [models.parameter_counts(m)["query_key_params"] for m in (plain, narrow, collab)]
    assert counts[0] > counts[1] > counts[2]
    for layer in collab.transformer.h:
        assert torch.equal(layer.attn.mixing, torch.ones_like(layer.attn.mixing))
        assert float(layer.attn.output.weight.detach().std()) == pytest.approx(0.02 / 8 ** 0.5, rel=0.1)
    for bad, message in [({"kind": "mlp"}, "unknown attention"), ({"rank": 0}, "rank"),
                         ({"rank": 30}, "multiple of n_head"), ({"kind": "collab", "mixing_init": "x"},
                                                                    "mixing_init")]:
        with pytest.raises(ValueError, match=message):
            models.gpt_config(65, 64, 4, 4, 128, **bad)


def test_samples_longer_than_the_context_use_the_cache(one_thread):
    """Sampled in chunks of half a block, each prefilled from the last half block into the cache: the text equals
    sampling that recomputes the whole context at every step. The model is trained for a moment (2 s) first: a
    random one samples nearly the same text whatever its attention computes, so a wrong cache would pass."""
    corpus = data.corpus_from_text(TEXT)
    model = models.build_model(models.gpt_config(corpus.vocab_size, 8, 1, 2, 16, kind="collab", rank=4), 0)
    ids, g = torch.tensor(corpus.encode(TEXT)), torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        batch = torch.stack([ids[s:s + 8] for s in torch.randint(0, len(ids) - 8, (16,), generator=g)])
        optimizer.zero_grad()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
    text = sample_text(model, corpus, 40, seed=3)
    assert len(text) == 40 and set(text) <= set(corpus.chars) and "to be" in text
    assert text == sample_text(model, corpus, 40, seed=3, use_cache=False)
    assert text != sample_text(model, corpus, 40, seed=4)


def test_the_script_writes_each_run_once_and_a_rerun_skips_it(text_file, tmp_path, capsys):
    script = load_script("train_lm")
    out = tmp_path / "out"
    overrides = [*TINY, f"data.path={text_file}", f"output_dir={out}", "mode=sweep", "kinds=[concat,collab]",
                 "ranks=[16,4]", "seeds=[0]"]
    cfg = compose_cfg("train_lm", overrides)
    first = script.run(cfg)
    names = sorted(p.stem for p in (out / "runs").glob("*.json"))
    assert names == ["collab-k16-seed0", "collab-k4-seed0", "concat-k16-seed0", "concat-k4-seed0"]
    record = json.loads((out / "runs" / "collab-k4-seed0.json").read_text())
    assert record["rank"] == 4 and "key_size" not in record  # the new name
    assert record["best_val_loss"] == min(p["val_loss"] for p in record["curve"]) and record["tokens_per_second"] > 0
    assert [p["step"] for p in record["curve"]] == [0, 3, 6] and len(record["sample"]) == 20
    assert (out / "models" / "concat-k16-seed0" / "config.json").is_file()
    second = script.run(cfg)
    assert second == first and capsys.readouterr().out.count("skipping") == 4
    with pytest.raises(ValueError, match="different settings"):
        script.run(compose_cfg("train_lm", [*overrides, "trainer.learning_rate=0.01"]))
    with pytest.raises(ValueError, match="unknown mode"):
        script.run(compose_cfg("train_lm", [*overrides, "mode=nope"]))


def compose_cfg(primary: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(primary, overrides=overrides)


def saved_figures(monkeypatch) -> list:
    """Every matplotlib figure saved from now on (its file is still written)."""
    saved, savefig = [], Figure.savefig

    def save(fig, *args, **kwargs):
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save)
    return saved


def errorbars(ax) -> dict[str, tuple[list, list, list]]:
    """Each labelled error-bar series of ``ax``: its x, its y and the half-heights of its bars."""
    series = {}
    for container in ax.containers:
        data, _, (bars,) = container.lines
        spans = [(top[1] - bottom[1]) / 2 for bottom, top in bars.get_segments()]
        series[container.get_label()] = (list(data.get_xdata()), list(data.get_ydata()), spans)
    return series


def test_conversion_and_summary_run_on_a_tiny_trained_model(text_file, tmp_path, capsys, monkeypatch):
    train_dir = tmp_path / "shakespeare_char" / "cpu"
    load_script("train_lm").run(compose_cfg("train_lm", [*TINY, f"data.path={text_file}", f"output_dir={train_dir}",
                                                          "trainer.max_steps=10"]))
    convert = compose_cfg("convert_lm", [
        f"data.path={text_file}", f"train_dir={train_dir}", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
        "block_size=16", "eval_iters=2", "trainer.max_steps=10", "trainer.per_device_train_batch_size=4",
        "trainer.warmup_steps=1", "ranks=[4]", "calibration_blocks=8", "importance_samples=8",
        "retrain_fraction=0.2", "threads=1", "progress=false", "sample_chars=12", "checkpoint_every=null",
    ])
    records = load_script("convert_lm").run(convert)
    assert [r["name"] for r in records] == ["none-k16", "cp-k4", "cp-aware-k4", "svd-k4", "prune-k4"]
    none, cp4 = records[0], records[1]
    assert none["converted_val_loss"] == pytest.approx(none["original_val_loss"], rel=1e-5)
    assert cp4["parameters"]["query_key_params"] < none["parameters"]["query_key_params"]
    assert all(r["retrain_curve"][-1]["step"] == 2 and len(r["retrained_sample"]) == 12 for r in records)
    assert load_script("convert_lm").run(convert) == records  # a rerun skips every result
    stored = train_dir / "convert" / "runs" / "svd-k4.json"
    svd = stored.read_text()
    assert json.loads(svd)["rank"] == 4 and "key_size" not in json.loads(svd)  # new runs write the new name
    old = {("key_size" if k == "rank" else k): v for k, v in json.loads(svd).items()}
    stored.write_text(json.dumps(old))  # as a run stored before the rename: still reused
    assert load_script("convert_lm").run(convert) == records
    stored.write_text(json.dumps({**json.loads(svd), "rank": 8}))  # not what a run named svd-k4 makes
    with pytest.raises(ValueError, match=r"svd-k4.json was made with different settings \(rank\)"):
        load_script("convert_lm").run(convert)
    stored.write_text(svd)

    saved = saved_figures(monkeypatch)
    results = runs_summary.write_summary(tmp_path / "shakespeare_char")
    assert results == tmp_path / "shakespeare_char" / "results.md"  # README.md stays the hand-written answer
    assert not (tmp_path / "shakespeare_char" / "README.md").exists()
    text = results.read_text()
    assert runs_summary.RESULTS_BEGIN in text and "| cp-aware | 4 |" in text and "| concat | 16 |" in text
    # what was trained, on how many tokens: every weight from scratch, 10 steps x 4 x 16; the re-training 2 steps
    assert "| 10 x 4 x 16 = 640 |" in text and "| 2 x 4 x 16 = 128 |" in text
    assert "![learning curves](curves_cpu.png)" in text and (tmp_path / "shakespeare_char" / "curves_cpu.png").is_file()
    # the one run's validation curve (step 0 left out) and its best loss, beside nanoGPT's for the cpu recipe
    run = json.loads((train_dir / "runs" / "concat-k16-seed0.json").read_text())
    ((left, right),) = [fig.axes for fig in saved]
    curve, reference = left.get_lines()
    assert (curve.get_label(), curve.get_linestyle()) == ("concat 16", "-")
    assert list(curve.get_xdata()) == [p["step"] for p in run["curve"] if p["step"]] == [3, 6, 9, 10]
    assert list(curve.get_ydata()) == [p["val_loss"] for p in run["curve"] if p["step"]]
    assert reference.get_label() == "nanoGPT 1.88" and list(reference.get_ydata()) == [1.88, 1.88]
    assert errorbars(right) == {"concat": ([16], [run["best_val_loss"]], [0.0])}
    results.write_text("# notes\n\nkept\n\n" + text)
    assert runs_summary.write_summary(tmp_path / "shakespeare_char").read_text().count(runs_summary.RESULTS_BEGIN) == 1
    assert "kept" in results.read_text()
    # a page written before the one summarize script: its section is replaced, not written again beside it
    results.write_text(text.replace(runs_summary.RESULTS_BEGIN, runs_summary.EARLIER_BEGINS[0]))
    assert runs_summary.write_summary(tmp_path / "shakespeare_char").read_text() == text


def test_long_enough_compares_the_last_tenth_of_training_with_the_spread_over_seeds():
    """The issue's criterion: the last 10% of the steps (the last evaluation against the last one at or before 90%)
    moved the validation loss, averaged over seeds, by less than the standard deviation of the best loss."""
    def run(losses, steps=(0, 80, 90, 100)):
        return {"curve": [{"step": s, "val_loss": v} for s, v in zip(steps, losses, strict=True)],
                "best_val_loss": min(losses)}

    settled = [run([4.0, 2.0, 1.50, 1.49]), run([4.0, 2.1, 1.60, 1.59])]  # moved 0.01, spread 0.071
    assert runs_summary.late_change(settled[0]) == pytest.approx(-0.01)
    assert runs_summary.long_enough(settled) == "yes"
    falling = [run([4.0, 2.0, 1.60, 1.50]), run([4.0, 2.1, 1.65, 1.55])]  # moved 0.10, spread 0.035
    assert runs_summary.long_enough(falling) == "no"
    assert runs_summary.late_change(run([4.0, 2.0, 1.6, 1.5], steps=(0, 85, 95, 100))) == pytest.approx(-0.5)  # from 85
    assert runs_summary.long_enough(settled[:1]) == "one seed"


def test_learning_curves_are_means_over_seeds(tmp_path, monkeypatch):
    """``plot_curves`` on made-up runs: per (attention, key size) the mean validation loss over seeds at the steps
    every seed has (step 0 left out), colour by key size and style by attention; on the right the best losses'
    mean and standard deviation against the key size; nanoGPT's loss where the recipe is one of its own."""
    def run(kind, key, seed, losses, steps=(0, 5, 10), mixing="random"):
        curve = [{"step": step, "val_loss": loss} for step, loss in zip(steps, losses, strict=True)]
        return {"attention": kind, "rank": key, "seed": seed, "mixing_init": mixing, "curve": curve,
                "best_val_loss": min(losses)}

    records = [run("concat", 16, 0, [4.0, 3.0, 2.0]), run("concat", 16, 1, [4.0, 2.5, 2.2, 1.5], (0, 5, 10, 15)),
               run("collab", 4, 0, [4.0, 3.5, 3.0]), run("collab", 4, 1, [4.0, 3.3, 3.1]),
               run("collab", 16, 0, [4.0, 3.0, 2.5], mixing="ones")]
    saved = saved_figures(monkeypatch)
    assert runs_summary.plot_curves(records, "cpu", tmp_path / "cpu.png") == tmp_path / "cpu.png"
    runs_summary.plot_curves(records, "mine", tmp_path / "mine.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.png", "mine.png"]
    (left, right), (other_left, other_right) = (fig.axes for fig in saved)
    drawn = [(line.get_label(), line.get_linestyle(), line.get_color(), list(line.get_xdata()),
              pytest.approx(list(line.get_ydata()))) for line in left.get_lines()]
    assert drawn == [("collab (ones) 16", ":", "C0", [5, 10], [3.0, 2.5]),
                     ("concat 16", "-", "C0", [5, 10], [2.75, 2.1]),  # step 15: one seed only
                     ("collab 4", "--", "C1", [5, 10], [3.4, 3.05]),
                     ("nanoGPT 1.88", ":", "grey", [0, 1], [1.88, 1.88])]
    assert (left.get_xlabel(), left.get_ylabel(), left.get_title()) == (
        "iteration", "validation loss", "cpu recipe: validation loss, mean over seeds")
    assert [text.get_text() for text in left.get_legend().get_texts()] == [label for label, *_ in drawn]
    assert errorbars(right) == {"concat": ([16], [pytest.approx(1.75)], [pytest.approx(0.5 / 2**0.5)]),
                                "collab": ([4], [pytest.approx(3.05)], [pytest.approx(0.1 / 2**0.5)]),
                                "collab (ones)": ([16], [2.5], [0.0])}
    assert (right.get_xlabel(), right.get_ylabel(), right.get_title(), right.get_xscale()) == (
        "query/key size", "best validation loss", "best validation loss, mean ± std", "log")
    assert list(right.get_xticks()) == [16, 4] and [t.get_text() for t in right.get_xticklabels()] == ["16", "4"]
    assert [line.get_label() for line in right.get_lines() if not line.get_label().startswith("_")] == ["nanoGPT 1.88"]
    # a recipe nanoGPT has no number for: no reference line
    assert [line.get_label() for line in other_left.get_lines()] == ["collab (ones) 16", "concat 16", "collab 4"]
    assert other_left.get_title() == "mine recipe: validation loss, mean over seeds"
    assert list(errorbars(other_right)) == ["concat", "collab", "collab (ones)"]


def test_bad_settings_fail_before_training(text_file, tmp_path):
    script = load_script("train_lm")
    base = [*TINY, f"data.path={text_file}", f"output_dir={tmp_path}"]
    for extra, message in [(["attention=mlp"], "unknown attention"), (["trainer.max_steps=0"], "max_steps"),
                           (["+model.bias=false"], "unknown model settings"),
                           ([f"data.path={tmp_path / 'none.txt'}"], "no text"),
                           (["attention=gqa", "rank=6"], "attention=gqa needs rank = kv_heads x"),
                           (["attention=mqa", "rank=16"], "attention=mqa has one key/value head"),
                           (["attention=mla", "rank=0"], "rank must be a positive integer")]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            script.run(compose_cfg("train_lm", [*base, *extra]))
    assert not (tmp_path / "runs").exists()


def test_wandb_runs_go_online_only_when_a_key_is_set(monkeypatch, tmp_path):
    import wandb

    modes = []

    class Run:
        summary = {}

        def log(self, *args, **kwargs):
            pass

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: modes.append(kwargs["mode"]) or Run())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    record = {"recipe": "r", "name": "n", "signature": {}, "curve": [{"step": 1, "val_loss": 2.0}],
              "best_val_loss": 2.0, "tokens_per_second": 1.0, "cache_bytes_per_token_bf16": 4}
    settings = {"logger": {"name": "wandb"}, "output_dir": tmp_path}
    runs.log_to_tracker(settings, record)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    runs.log_to_tracker(settings, record)
    runs.log_to_tracker({**settings, "logger": {"name": "wandb", "mode": "disabled"}}, record)
    assert modes == ["offline", "online", "disabled"]


ROPE = "positions=rope"


@pytest.mark.parametrize("attention, rank, cached_per_layer, extra", [
    ("gqa", 8, 16, []),     # 2 key/value heads of 4 (of 4 query heads): keys and values, 2 x 8 numbers
    ("mqa", None, 8, []),   # one key/value head of 4: 2 x 4
    ("mla", 6, 6, []),      # one latent of 6
    ("collab", 6, 6 + 4 + 5, ["value_rank=5"]),  # shared key of 6, 4 content logits, one shared value of 5
    # rotary positions (issue 69): Llama models
    ("concat", None, 32, [ROPE]),                  # Llama's own attention: keys and values of 4 heads of 4
    ("gqa", 8, 16, [ROPE]),                        # Llama's grouped heads, 2 of 4
    ("mqa", None, 8, [ROPE]),
    ("collab", 6, 6 + 5, [ROPE, "value_rank=5"]),  # 3 rotating shared pairs (no content bias) and a value of 5
    ("collab", 4, 4 + 16, [ROPE]),                 # keys only: 2 rotating pairs, every head's value
    ("mla", 6, 6 + 2, [ROPE]),                     # a latent of 6 and DeepSeek-V2's rotary key of half a head
    ("mla", 6, 6 + 4, [ROPE, "rope_dim=4"]),
    ("tpa", 2, (2 + 1) * (4 + 4), [ROPE, "value_rank=1", "query_rank=3"]),  # factors of 4 heads + 4 dimensions
    ("tpa", None, (2 + 2) * (4 + 4), [ROPE]),      # ranks 2 and 2, queries of rank 6
])
def test_every_attention_option_trains_decodes_and_reloads(text_file, tmp_path, attention, rank,
                                                           cached_per_layer, extra):
    """train_lm.py with each race variant (issue 44): a run is written; the model's cache holds the numbers the
    accounting says, decoding with it equals recomputation, generate agrees with and without the (static) cache, and
    the saved model loads back through the Auto classes with identical logits."""
    script = load_script("train_lm")
    out = tmp_path / "out"
    size = [] if rank is None else [f"rank={rank}"]
    overrides = [*TINY, "model.n_head=4", f"data.path={text_file}", f"output_dir={out}", f"attention={attention}",
                 *size, *extra, f"save_models=[*{attention}-*]"]
    (record,) = script.run(compose_cfg("train_lm", overrides))
    assert record["attention"] == attention
    assert record["cache_bytes_per_token_bf16"] == cached_per_layer * 2  # one layer
    rope = ROPE in extra
    assert record["name"].startswith("rope-") == rope and record.get("positions") == ("rope" if rope else None)
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "models" / record["name"]).eval()
    assert models.cache_bytes(model) == cached_per_layer * 2
    assert ("Llama" in type(model).__name__) == rope
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = transformers.DynamicCache()
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        pieces = [model(ids[:, s:e], use_cache=True, **with_cache(model, cache)).logits
                  for s, e in [(0, 4)] + [(i, i + 1) for i in range(4, 9)]]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-4
    stored = sum(t[0, :, 0].numel() for layer in cache.layers for t in (layer.keys, layer.values))
    assert stored == cached_per_layer * model.config.num_hidden_layers
    maps = transformers.AutoModelForCausalLM.from_pretrained(out / "models" / record["name"],
                                                             attn_implementation="eager").eval()  # Llama's weights
    with torch.no_grad():
        seen = maps(ids, output_attentions=True, output_hidden_states=True)
        torch.testing.assert_close(seen.logits, full, atol=1e-5, rtol=1e-5)
    assert [a.shape for a in seen.attentions] == [(2, 4, 9, 9)] * model.config.num_hidden_layers
    first = seen.attentions[0]
    assert torch.allclose(first.sum(-1), torch.ones(2, 4, 9)) and first[0, :, 0, 1:].max() == 0  # causal rows
    assert len(seen.hidden_states) == model.config.num_hidden_layers + 1
    settings = {"max_new_tokens": 6, "do_sample": False}
    greedy = model.generate(ids[:, :5], **settings)
    assert torch.equal(model.generate(ids[:, :5], use_cache=False, **settings), greedy)
    assert torch.equal(model.generate(ids[:, :5], cache_implementation="static", **settings), greedy)


@pytest.mark.parametrize("overrides, expected", [
    (["attention=gqa", "kv_heads=2"], ("gqa", 2 * 32)),       # the cpu recipe: two key/value heads of 128 / 4
    (["attention=gqa", "kv_heads=2", "rank=64"], ("gqa", 64)),
    (["attention=mla", "latent_size=48"], ("mla", 48)),
    (["attention=collab", "rank=96"], ("collab", 96)),
])
def test_kv_heads_and_latent_size_name_the_rank(overrides, expected):
    settings = OmegaConf.to_container(compose_cfg("train_lm", ["seed=2", *overrides]), resolve=True)
    assert runs.runs_of(settings) == [(*expected, 2)]


@pytest.mark.parametrize("overrides, message", [
    (["attention=mla", "kv_heads=2"], "kv_heads=2 is a size of attention=gqa, not of attention=mla"),
    (["attention=concat", "latent_size=48"], "latent_size=48 is a size of attention=mla"),
    (["attention=gqa", "kv_heads=2", "rank=96"], "kv_heads=2 means rank=64, but rank=96 is set"),
    (["attention=gqa", "kv_heads=0"], "kv_heads"),
])
def test_size_aliases_refuse_what_they_cannot_mean(overrides, message):
    settings = OmegaConf.to_container(compose_cfg("train_lm", overrides), resolve=True)
    with pytest.raises(ValueError, match=message):
        runs.runs_of(settings)


def test_value_rank_is_for_collaborative_heads_only():
    with pytest.raises(ValueError, match="value_rank=4 needs attention=collab"):
        models.gpt_config(65, 16, 1, 4, 16, kind="mqa", value_rank=4)
    with pytest.raises(ValueError, match="value_rank=32 needs attention=collab and a width in 1..n_embd=16"):
        models.gpt_config(65, 16, 1, 4, 16, kind="collab", rank=8, value_rank=32)
    config = models.gpt_config(65, 16, 2, 4, 16, kind="collab", rank=8, value_rank=6)
    assert config.collab_value_ranks == [6, 6]
    assert models.cache_bytes(models.build_model(config, 0)) == 2 * (8 + 4 + 6) * 2  # two layers, bf16


def test_cache_race_plot_draws_loss_against_cache_per_variant(tmp_path, monkeypatch):
    def run(kind, key, seed, loss, cache, values=None):
        return {"attention": kind, "rank": key, "seed": seed, "best_val_loss": loss,
                "cache_bytes_per_token_bf16": cache, **({} if values is None else {"value_rank": values})}

    race = [run("mqa", 32, 0, 1.90, 512), run("mqa", 32, 1, 1.92, 512),
            run("collab", 30, 0, 1.95, 512, values=30), run("collab", 14, 0, 2.05, 256, values=14)]
    grid = [run("concat", 128, 0, 1.88, 2048), run("concat", 64, 0, 1.93, 1536)]
    figures = saved_figures(monkeypatch)
    runs_summary.plot_cache_race(race, tmp_path / "cache.png", grid)
    (figure,) = figures
    bars = errorbars(figure.axes[0])
    assert bars["mqa"] == ([512], [pytest.approx(1.91)], [pytest.approx(0.0141421, rel=1e-4)])
    assert bars["collab (values)"] == ([256, 512], [2.05, 1.95], [0.0, 0.0])  # both value sizes on one line
    assert bars["concat"] == ([1536, 2048], [1.93, 1.88], [0.0, 0.0])
    assert figure.axes[0].get_xlabel() == "key/value cache, bytes per token (bf16, all layers)"
    assert (tmp_path / "cache.png").is_file()


def test_the_verdicts_table_ranks_each_budget_by_the_paired_rule():
    """A race folder: per cache budget the best by the mean, the paired rule against the runner-up and against the
    folder's own original (concatenated at its largest key size, the same hardware and precision as the rest)."""
    def run(kind, key, seed, loss, cache, values=None):
        return {"attention": kind, "rank": key, "seed": seed, "best_val_loss": loss,
                "cache_bytes_per_token_bf16": cache, **({} if values is None else {"value_rank": values})}

    race = [run("concat", 128, s, loss, 2048) for s, loss in enumerate((1.900, 1.905, 1.910))]
    race += [run("mqa", 32, s, loss, 512) for s, loss in enumerate((1.904, 1.908, 1.914))]  # +0.004, +0.003, +0.004
    race += [run("collab", 30, s, loss, 512, values=30) for s, loss in enumerate((1.944, 1.948, 1.941))]
    race += [run("mla", 32, s, loss, 256) for s, loss in enumerate((2.03, 2.02, 2.03))]
    race += [run("collab", 14, s, loss, 256, values=14) for s, loss in enumerate((1.98, 2.01, 2.00))]  # mixed: a tie
    lines = runs_summary.verdicts_table(race).splitlines()
    assert lines[0].startswith("| cache B/token | best (mean) | runner-up (mean) |")
    # the last column: what a larger cache buys, its best against the best of the next size down
    down = paired_comparison([1.900, 1.905, 1.910], [1.904, 1.908, 1.914])
    assert lines[2] == f"| 2,048 | concat 128 (1.9050) | - | - | - | - | vs mqa 32: {down.describe()} |"
    mqa = paired_comparison([1.904, 1.908, 1.914], [1.944, 1.948, 1.941])
    original = paired_comparison([1.904, 1.908, 1.914], [1.900, 1.905, 1.910])
    assert original.verdict == "worse"  # 0.003 to 0.004 behind on every seed, little spread
    smaller = paired_comparison([1.904, 1.908, 1.914], [1.98, 2.01, 2.00])
    assert lines[3] == (f"| 512 | mqa 32 (1.9087) | collab 30/30 (1.9443) | {mqa.describe()} | none (ahead of all) "
                        f"| {original.describe()} | vs collab 14/14: {smaller.describe()} |")
    assert lines[4].startswith("| 256 | collab 14/14 (1.9967) | mla 32 (2.0267) |") and "| mla 32 |" in lines[4]
    assert lines[4].endswith(" | - |")  # nothing smaller
    grid = [run("concat", 16, 0, 1.95, 1184), run("collab", 16, 0, 1.94, 1184)]
    assert runs_summary.verdicts_table(grid).splitlines()[2] == (
        "| 16 | collab 16 (1.9400) | concat 16 (1.9500) | -0.0100, 1 seed: tie | concat 16 | -0.0100, 1 seed: tie "
        "| - |")


def test_rotary_models_keep_nanogpts_sizes_and_refuse_what_they_cannot_build():
    """positions=rope: a Llama model with GPT-2's MLP parameter count, tied embeddings, no position embedding, the
    residual projections initialized as GPT-2's; each attention option refuses what has no rotary form."""
    learned = models.build_model(models.gpt_config(65, 64, 4, 4, 128), 0)
    rope = models.build_model(models.gpt_config(65, 64, 4, 4, 128, positions="rope"), 0)
    assert type(rope).__name__ == "LlamaForCausalLM" and rope.lm_head.weight is rope.model.embed_tokens.weight
    mlp = sum(p.numel() for p in rope.model.layers[0].mlp.parameters())
    gpt2_mlp = sum(p.numel() for p in learned.transformer.h[0].mlp.parameters())
    assert mlp == 3 * 128 * 344 and abs(mlp / gpt2_mlp - 1) < 0.01
    positions = learned.transformer.wpe.weight.numel()
    attention = [models.parameter_counts(m)["attention_params"] for m in (rope, learned)]
    assert attention[0] == attention[1] - 4 * (3 * 128 + 128)  # Llama's attention has no biases
    assert abs(models.parameter_counts(rope)["total"] - models.parameter_counts(learned)["total"] + positions) < 5000
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        weight = rope.model.layers[0].get_submodule(name).weight
        assert float(weight.detach().std()) == pytest.approx(0.02 / 8 ** 0.5, rel=0.1)
    mla = models.gpt_config(65, 64, 4, 4, 128, kind="mla", rank=48, positions="rope")
    layer = models.build_model(mla, 0).model.layers[0].self_attn
    assert (layer.kv_heads, layer.rope_pairs, layer.rope_key.out_features) == (1, 8, 16)  # one rotary key, shared
    collab = models.build_model(models.gpt_config(65, 64, 4, 4, 128, kind="collab", rank=62, value_rank=62,
                                                  positions="rope"), 0).model.layers[0].self_attn
    assert collab.pair_bands.tolist() == list(range(16)) + list(range(15))  # 31 pairs over the 16 bands
    assert not torch.equal(collab.mixing, torch.ones_like(collab.mixing))  # random mixing, as without RoPE
    for bad, message in [
        ({"kind": "concat", "rank": 64}, "full width only"),
        ({"kind": "collab", "rank": 7}, "rank must be even"),
        ({"kind": "gqa", "rank": 48}, "kv_heads x 32"),
        ({"kind": "gqa", "rank": 64, "rope_dim": 8}, "rope_dim=8 is the decoupled rotary key of attention=mla"),
        ({"kind": "mla", "rank": 8, "rope_dim": 5}, "rope_dim must be an even number"),
        ({"kind": "mla", "rank": 8, "query_rank": 2}, "query_rank=2 is a size of attention=tpa"),
        ({"kind": "mqa", "value_rank": 4}, "value_rank=4 needs attention=collab or attention=tpa"),
        ({"kind": "concat", "rope_theta": -1.0}, "rope_theta must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            models.gpt_config(65, 64, 4, 4, 128, positions="rope", **bad)
    for bad, message in [({"kind": "tpa"}, "attention=tpa rotates its key factors: it needs positions=rope"),
                         ({"rope_dim": 4}, "rope_dim=4 is a size of rotary models"),
                         ({"rope_theta": 5e5}, "rope_theta=500000.0 needs positions=rope"),
                         ({"positions": "alibi"}, "unknown positions 'alibi'")]:
        with pytest.raises(ValueError, match=message):
            models.gpt_config(65, 64, 4, 4, 128, **bad)


def test_a_rotary_model_with_dropout_drops_where_gpt2_does():
    """Llama has attention dropout only; a rotary model trained with dropout also drops the embeddings and each
    block's attention and MLP outputs while training, and computes deterministically in eval mode."""
    model = models.build_model(models.gpt_config(30, 16, 2, 4, 32, dropout=0.5, positions="rope"), 0)
    ids = torch.randint(0, 30, (2, 16), generator=torch.Generator().manual_seed(0))
    hooked = [m for m in model.modules() if m._forward_hooks]
    assert len(hooked) == 1 + 2 * 2 and model.config.attention_dropout == 0.5
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(ids).logits)
        model.eval()
        assert torch.equal(model(ids).logits, model(ids).logits)
    plain = models.build_model(models.gpt_config(30, 16, 2, 4, 32, positions="rope"), 0)
    assert not any(m._forward_hooks for m in plain.modules())


def test_rotary_runs_are_named_and_stored_apart():
    settings = settings_for("train_lm", "positions=rope", "attention=mla", "latent_size=48")
    assert runs.name_of(settings, "mla", 48, 1) == "rope-mla-k48-r16-seed1"
    assert runs.name_of({**settings, "rope_dim": 8}, "mla", 48, 1) == "rope-mla-k48-r8-seed1"
    assert runs.name_of(settings, "tpa", 2, 0) == "rope-tpa-k2-v2-q6-seed0"
    assert runs.name_of({**settings, "positions": "learned"}, "mla", 48, 1) == "mla-k48-seed1"
    assert runs.signature(settings)["positions"] == {"rope_theta": 10000.0}
    assert "positions" not in runs.signature({**settings, "positions": "learned"})  # stored runs keep theirs
    assert runs.runs_of(settings_for("train_lm", "positions=rope", "attention=tpa")) == [("tpa", 2, 0)]


def test_a_rotary_race_is_labelled_and_measured_against_its_rotary_original():
    def run(kind, key, seed, loss, cache, rope=True, **sizes):
        return {"attention": kind, "rank": key, "seed": seed, "best_val_loss": loss,
                "cache_bytes_per_token_bf16": cache, **({"positions": "rope"} if rope else {}), **sizes}

    race = [run("concat", 128, s, 1.68 + s / 100, 2048) for s in range(3)]
    race += [run("concat", 128, s, 2.21 + s / 200, 2048, rope=False) for s in range(3)]  # learned positions
    race += [run("mla", 48, s, 1.71 + s / 90, 512, rope_dim=16) for s in range(3)]
    race += [run("tpa", 1, s, 1.75 + s / 80, 576, value_rank=1, query_rank=6) for s in range(3)]
    assert runs_summary.variant(race[6]) == "mla (rotary key 16, rope)" and runs_summary.family(race[6]) == "mla rope"
    assert runs_summary.variant(race[9]) == "tpa (values 1, queries 6, rope)"
    assert runs_summary.family(race[9]) == "tpa rope"
    assert runs_summary.variant(race[3]) == "concat" and runs_summary._short_label(race[6]) == "mla 48+16 rope"
    lines = runs_summary.verdicts_table(race).splitlines()
    assert lines[2].startswith("| 2,048 | concat 128 rope (1.6900) | concat 128 (2.2150) |")
    original = paired_comparison([1.75, 1.7625, 1.775], [1.68, 1.69, 1.70])
    assert lines[3].startswith("| 576 | tpa 1/1 q6 rope (1.7625) |") and f"| {original.describe()} |" in lines[3]
