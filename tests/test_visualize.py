"""Attention views and plots (collab_attn.analysis.views and .plots, scripts/visualize.py) on the packaged MiniLM."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from collab_attn.analysis import plots
from collab_attn.analysis.views import (
    attention_maps,
    collaborative_copy,
    comparison_page,
    load_for_viewing,
    sentence_attention,
)
from collab_attn.models.settings import MethodSettings

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "visualize.py"
_spec = importlib.util.spec_from_file_location("visualize_script", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

SENTENCE, PAIR = "The animal didn't cross the street because it was too tired.", "It had walked all day."
EXACT = MethodSettings.from_config(dict(method="cp", rank=384))
LOW_RANK = MethodSettings.from_config(dict(method="cp", rank=24, init="random", n_iter_max=2))


@pytest.fixture(scope="module")
def original():
    return load_for_viewing("minilm")


@pytest.fixture(scope="module")
def exact(original):
    return collaborative_copy(original[0], EXACT, progress=False)[0]


@pytest.fixture(scope="module")
def low(original):
    return collaborative_copy(original[0], LOW_RANK, progress=False)[0]


def bertviz_params(page: str) -> list[dict]:
    """The parameters each BertViz view on the page was rendered with (its attention data among them)."""
    return [json.loads(found) for found in re.findall(r"const params = (.*?); // HACK", page)]


def test_padded_batch_is_sliced_to_real_tokens(original, exact, real_batch):
    model, tokenizer = original
    lengths = real_batch["attention_mask"].sum(1).tolist()
    with torch.no_grad():
        raw = model(**real_batch, output_attentions=True).attentions
    pads = ~real_batch["attention_mask"].bool()
    keys = pads[:, None, None, :].expand_as(raw[0])
    assert max(layer[keys].max().item() for layer in raw) < 1e-6  # no attention to padding
    for converted in (model, exact):
        per_sequence = attention_maps(converted, tokenizer, real_batch)
        for maps, length, sentence in zip(per_sequence, lengths, ["The cat sat on the mat.", None, "It rained.", None]):
            assert len(maps.tokens) == length and maps.tokens[0] == "[CLS]" and maps.tokens[-1] == "[SEP]"
            assert "[PAD]" not in maps.tokens and maps.sentence_b_start is None
            assert all(layer.shape == (12, length, length) for layer in maps.layers) and len(maps.layers) == 6
            assert all(torch.allclose(layer.sum(-1), torch.ones(12, length), atol=1e-5) for layer in maps.layers)
            if sentence is not None:  # the same as running the sentence alone
                alone = sentence_attention(converted, tokenizer, sentence)
                assert alone.tokens == maps.tokens
                assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(alone.layers, maps.layers))


def test_full_rank_attention_is_the_original(original, exact):
    model, tokenizer = original
    before, after = (sentence_attention(m, tokenizer, SENTENCE, PAIR) for m in (model, exact))
    assert before.tokens == after.tokens and before.tokens[before.sentence_b_start - 1] == "[SEP]"
    assert before.tokens[before.sentence_b_start:] == ["it", "had", "walked", "all", "day", ".", "[SEP]"]
    assert plots.attention_difference(before, after).max() < 1e-4


def test_page_holds_both_models_attention(original, low):
    model, tokenizer = original
    maps = {"original": sentence_attention(model, tokenizer, SENTENCE, PAIR),
            "collaborative": sentence_attention(low, tokenizer, SENTENCE, PAIR)}
    assert plots.attention_difference(maps["original"], maps["collaborative"]).max() > 0.01
    for view in ("head", "model"):
        page = comparison_page(list(maps.items()), view, "title <&>", "intro")
        assert page.count("require.min.js") == 1 and "title &lt;&amp;&gt;" in page
        assert "<h2>original</h2>" in page and "<h2>collaborative</h2>" in page
        params = bertviz_params(page)
        assert len(params) == 2 and params[0]["root_div_id"] != params[1]["root_div_id"]
        for shown, expected in zip(params, maps.values()):
            everything = shown["attention"][0]  # the "All" filter; the others are sentence A/B slices
            assert everything["left_text"] == everything["right_text"] == expected.tokens
            assert len(shown["attention"]) == 5  # a sentence pair: All, A->A, B->B, A->B, B->A
            assert np.allclose(everything["attn"], torch.stack(expected.layers).numpy(), atol=1e-4)
    with pytest.raises(ValueError, match="same tokens"):
        comparison_page([("a", maps["original"]), ("b", sentence_attention(model, tokenizer, "Other words."))])


def test_causal_models_attend_only_to_the_past(minilm_path):
    model, tokenizer = load_for_viewing(minilm_path, causal=True)
    converted = collaborative_copy(model, EXACT, progress=False)[0]
    for viewed in (model, converted):
        maps = sentence_attention(viewed, tokenizer, SENTENCE)
        assert all(layer.triu(1).abs().max() < 1e-6 for layer in maps.layers)
        assert maps.layers[0][:, 1, :2].sum(-1).min() > 0.999  # the second token attends to the first two only


def test_head_statistics_and_mixing(original, exact, low):
    model, _ = original
    full = plots.head_statistics(model, exact)
    assert full["relative_error"].shape == (6, 12) and full["relative_error"].max() < 1e-4
    assert np.allclose(full["original_effective_rank"], full["collaborative_effective_rank"], rtol=1e-3)
    assert (full["original_effective_rank"] <= 32 + 1e-3).all() and np.allclose(full["energy_share"].sum(1), 1)
    reduced = plots.head_statistics(model, low)
    assert (reduced["collaborative_effective_rank"] <= 24 + 1e-3).all() and reduced["relative_error"].min() > 0
    weights = plots.mixing_weights(plots.collaborative_layers(exact)[0])
    assert weights.shape == (12, 384) and ((weights != 0).sum(0) == 1).all()  # full rank: one head per dimension


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="visualize", overrides=list(overrides))


PLOTS = ("plot_mixing", "plot_head_statistics", "plot_attention_difference", "plot_worst_head")


def record_plots(monkeypatch) -> dict:
    """Each ``plots.plot_*`` call from now on, by function name: its arguments and the figure it returned."""
    drawn = {}

    def recording(name, real):
        def recorded(*args):
            drawn[name] = (args, real(*args))
            return drawn[name][1]
        return recorded

    for name in PLOTS:
        monkeypatch.setattr(plots, name, recording(name, getattr(plots, name)))
    return drawn


def image_axes(fig) -> list:
    """The panels of a figure that show an image (not their colour bars), in the order they were made."""
    return [ax for ax in fig.axes if ax.get_images()]


def image(ax) -> np.ndarray:
    (shown,) = ax.get_images()
    return np.asarray(shown.get_array())


def assert_mixing_drawn(fig, model) -> None:
    """One heatmap per collaborative layer holding that layer's mixing weights, columns grouped by their dominant
    head (strongest first within a group), on a colour scale symmetric around zero."""
    layers = plots.collaborative_layers(model)
    panels = image_axes(fig)
    assert len(panels) == len(layers)
    for index, (ax, layer) in enumerate(zip(panels, layers)):
        weights, shown = plots.mixing_weights(layer), image(ax)
        assert shown.shape == weights.shape == (layer.num_heads, layer.rank)
        assert np.array_equal(shown[:, np.lexsort(shown)], weights[:, np.lexsort(weights)])  # the same columns
        dominant, strength = np.abs(shown).argmax(0), np.abs(shown).max(0)
        assert (np.diff(dominant) >= 0).all()
        assert all((np.diff(strength[dominant == head]) <= 0).all() for head in range(layer.num_heads))
        limit = np.abs(weights).max()
        assert ax.get_images()[0].get_clim() == pytest.approx((-limit, limit))
        assert ax.get_ylabel() == f"layer {index}\nhead" and list(ax.get_yticks()) == list(range(layer.num_heads))
    assert panels[-1].get_xlabel() == "shared key/query dimension (grouped by the head that uses it most)"
    assert fig.get_suptitle() == f"CP mixing m_h[r] |q_r| |k_r| (heads x rank), rank {layers[0].rank}"


def assert_head_statistics_drawn(fig, stats: dict, rank: int) -> None:
    """Four layers x heads heatmaps of the statistics, each cell written out, the effective ranks on one scale."""
    shown = [("original_effective_rank", "effective rank of Wq_h^T Wk_h (original)", ".0f"),
             ("collaborative_effective_rank", "effective rank of Wq~ M_h Wk~^T (collaborative)", ".0f"),
             ("relative_error", "relative error |T_h - T~_h| / |T_h|", ".2f"),
             ("energy_share", "share of the layer's energy |T_h|^2 / sum |T_g|^2", ".2f")]
    panels = image_axes(fig)
    assert len(panels) == len(shown)
    top = max(stats["original_effective_rank"].max(), stats["collaborative_effective_rank"].max())
    for ax, (key, title, fmt) in zip(panels, shown):
        assert ax.get_title() == title and (ax.get_xlabel(), ax.get_ylabel()) == ("head", "layer")
        assert np.array_equal(image(ax), stats[key])
        assert [text.get_text() for text in ax.texts] == [format(value, fmt) for value in stats[key].flat]
        if key.endswith("effective_rank"):
            assert ax.get_images()[0].get_clim() == pytest.approx((0, top))
    assert fig.get_suptitle() == f"Per-head bilinear forms T_h = Wq_h^T Wk_h, collaborative rank {rank}"


def assert_attention_difference_drawn(fig, original, collaborative) -> None:
    """A layers x heads grid of |original - collaborative| attention, heads named on top, layers and their mean
    difference on the left."""
    difference = np.stack([(a - b).abs().numpy() for a, b in zip(original.layers, collaborative.layers)])
    layers, heads = difference.shape[:2]
    panels = image_axes(fig)
    assert len(panels) == layers * heads
    for (layer, head), ax in zip(np.ndindex(layers, heads), panels):
        assert np.allclose(image(ax), difference[layer, head], atol=1e-7)
        assert ax.get_images()[0].get_clim() == pytest.approx((0, difference.max() or 1.0), abs=1e-7)
        assert ax.get_title() == (f"head {head}" if layer == 0 else "")
        assert ax.get_ylabel() == (f"layer {layer}\nmean {difference[layer].mean():.3f}" if head == 0 else "")
    assert fig.get_suptitle() == (f"|original - collaborative| attention on {len(original.tokens)} tokens "
                                  f"(max {difference.max():.3f}, mean {difference.mean():.4f})")


def assert_worst_head_drawn(fig, original, collaborative) -> None:
    """The head whose attention changed most in total: its original, collaborative and |difference| maps, with
    the tokens on both axes."""
    totals = [[float((a - b).abs().sum()) for a, b in zip(before, after)]
              for before, after in zip(original.layers, collaborative.layers)]
    layer, head = np.unravel_index(np.argmax(totals), np.shape(totals))
    before, after = original.layers[layer][head].numpy(), collaborative.layers[layer][head].numpy()
    panels = image_axes(fig)
    assert [ax.get_title() for ax in panels] == ["original", "collaborative", "|difference|"]
    for ax, values in zip(panels, (before, after, np.abs(before - after))):
        assert np.allclose(image(ax), values, atol=1e-7)
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("key", "query")
        assert [t.get_text() for t in ax.get_xticklabels()] == [t.get_text() for t in ax.get_yticklabels()] \
            == original.tokens
    assert fig.get_suptitle() == f"layer {layer}, head {head}: the head whose attention changed most"


def test_plots_draw_what_they_are_given(original, low, tmp_path):
    """The four plots of a low-rank conversion (nothing exact, so every panel has something to show), from the
    figures the plot functions return beside the PNGs they write."""
    model, tokenizer = original
    maps = [sentence_attention(m, tokenizer, SENTENCE, PAIR) for m in (model, low)]
    stats = plots.head_statistics(model, low)
    assert_mixing_drawn(plots.plot_mixing(low, tmp_path / "mixing.png"), low)
    assert_head_statistics_drawn(plots.plot_head_statistics(stats, tmp_path / "stats.png", 24), stats, 24)
    assert_attention_difference_drawn(plots.plot_attention_difference(*maps, tmp_path / "difference.png"), *maps)
    assert_worst_head_drawn(plots.plot_worst_head(*maps, tmp_path / "worst.png"), *maps)
    for png in tmp_path.iterdir():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_script_writes_views_and_plots(tmp_path, monkeypatch):
    out = tmp_path / "views"
    drawn = record_plots(monkeypatch)
    summary = script.run(config("collab.rank=384", f"output_dir={out}", 'sentence="Is the museum open?"',
                                'sentence_pair="It opens at ten."'))
    assert sorted(p.name for p in out.iterdir()) == sorted(["index.html", *script.FILES])
    assert [p.name for p in tmp_path.iterdir()] == ["views"]  # no temporary directory left behind
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the figures drawn into them: the converted model's mixing, the statistics and maps of the summary
    (converted, _), figure = drawn["plot_mixing"]
    assert_mixing_drawn(figure, converted)
    (stats, _, rank), figure = drawn["plot_head_statistics"]
    assert rank == 384 and {name: values.tolist() for name, values in stats.items()} == summary["head_statistics"]
    assert_head_statistics_drawn(figure, stats, 384)
    (before, after, _), figure = drawn["plot_attention_difference"]
    assert before.tokens == after.tokens == summary["tokens"]
    assert_attention_difference_drawn(figure, before, after)
    (*maps, _), figure = drawn["plot_worst_head"]
    assert maps[0] is before and maps[1] is after
    assert_worst_head_drawn(figure, before, after)
    for name in ("head_view.html", "model_view.html"):
        params = bertviz_params((out / name).read_text())
        assert len(params) == 2 and all(p["attention"][0]["left_text"] == summary["tokens"] for p in params)
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["tokens"][summary["sentence_b_start"]:] == ["it", "opens", "at", "ten", ".", "[SEP]"]
    assert summary["max_attention_difference"] < 1e-4 and len(summary["layers"]) == 6  # full rank is exact
    assert np.array(summary["head_statistics"]["relative_error"]).max() < 1e-4
    index = (out / "index.html").read_text()
    assert all(f'href="{name}"' in index for name in script.FILES)


def test_script_fits_on_calibration_texts(tmp_path, monkeypatch):
    texts = tmp_path / "texts.txt"
    texts.write_text("The museum opens at ten.\nIt rained all day.\nIs it open on Mondays?\nThey walked home.\n")
    seen = []
    real = script.calibrate
    monkeypatch.setattr(script, "calibrate", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    summary = script.run(config("collab.rank=96", "collab.n_iter_max=2", f"collab.calibration={texts}",
                                "collab.calibration_samples=3", f"output_dir={tmp_path / 'out'}"))
    assert seen and seen[0] is not None and summary["config"]["collab"]["calibration"] == str(texts)
    assert (tmp_path / "out" / "index.html").is_file() and summary["mean_relative_error"] > 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["collab.rank=999"], "rank 999"),
        (["collab.rank=[24,24]"], "collab.rank must be one integer"),
        (["collab.budget=mean:128"], "collab.rank must be one integer (and collab.budget null)"),
        (["collab=svd"], "collab.method=svd has no collaborative heads to show"),
        (["collab.calibration=task"], "collab.calibration=task means the task's training texts"),
        (["+collab.importance=3"], "unknown key collab.importance"),
        (["sentence=[a,b]"], "sentence must be a non-empty string"),
        (["sentence_pair=''"], "sentence_pair must be a non-empty string"),
        (["model=/no/such/checkpoint"], "no checkpoint at"),
    ],
)
def test_errors_write_nothing(tmp_path, overrides, message):
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        script.run(config(*overrides, f"output_dir={tmp_path / 'out'}"))
    assert list(tmp_path.iterdir()) == []


def test_non_empty_output_dir_needs_overwrite(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="overwrite=true"):
        script.run(config(f"output_dir={tmp_path}"))


def test_cli_bad_input_exits_2(tmp_path, monkeypatch, capsys):
    """The script's command line (its ``main``, in this process: the script as a real process refusing bad input is
    tests/test_entry_points.py::test_a_process_refuses_in_one_line_and_writes_nothing[visualize into a file])."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "collab=svd", f"output_dir={tmp_path / 'out'}",
                                      f"hydra.run.dir={tmp_path}/h"])
    with pytest.raises(SystemExit) as stop:
        script.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: collab.method=svd has no")
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # neither the output nor Hydra's folder


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    """A small random GPT-2 saved with a character tokenizer: a decoder checkpoint to view."""
    import transformers
    from conftest import character_tokenizer

    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=30, n_positions=64,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    character_tokenizer().save_pretrained(path)
    return path


def test_script_views_a_decoder_causally(tmp_path, gpt2_checkpoint, monkeypatch):
    out = tmp_path / "out"
    drawn = record_plots(monkeypatch)
    summary = script.run(config(f"model={gpt2_checkpoint}", "collab.rank=24", "collab.n_iter_max=3",
                                'sentence="the cat sat"', f"output_dir={out}"))
    assert summary["causal"] is True and summary["tokens"] == list("the cat sat")
    page = (out / "head_view.html").read_text()
    params = bertviz_params(page)
    assert len(params) == 2  # original and collaborative
    for shown in params:
        attention = np.array(shown["attention"][0]["attn"])  # (layers, heads, tokens, tokens)
        assert attention.shape == (2, 4, 11, 11)
        assert np.abs(np.triu(attention, 1)).max() == 0  # every token attends only to the past
    assert (out / "model_view.html").is_file()
    (converted, _), figure = drawn["plot_mixing"]
    assert [image(ax).shape for ax in image_axes(figure)] == [(4, 24)] * 2  # 2 layers of 4 heads, rank 24
    assert_mixing_drawn(figure, converted)
    (before, after, _), figure = drawn["plot_worst_head"]
    assert_worst_head_drawn(figure, before, after)
    assert all(np.triu(image(ax)[:], 1).max() == 0 for ax in image_axes(figure)[:2])  # causal maps drawn


def test_a_decoder_cannot_be_viewed_bidirectionally(tmp_path, gpt2_checkpoint):
    with pytest.raises(ValueError, match="causal=false: gpt2 is a decoder and always causal"):
        script.run(config(f"model={gpt2_checkpoint}", "collab.rank=24", "causal=false",
                          f"output_dir={tmp_path / 'out'}"))
    assert list(tmp_path.iterdir()) == []
