"""Bad input that only the loaded checkpoint shows, met by every script that converts: a NaN in one query weight is
refused by the conversion (``collab_attn.decomposition.decompose.check_finite``), and the script ends as it does on
any bad input (collab_attn/cli.py): exit status 2, the conversion's message as the one line on stderr, no traceback,
and no result, job folder or half-written file left in the folder it ran in (Hydra's log goes elsewhere here). A
real error in the work keeps its traceback. scripts/reparametrize.py runs as a real process in
tests/test_reparametrize_script.py; here each script's ``main`` runs in this process with its command line, the
path a process takes once the interpreter has started (Hydra's ``run_and_report`` prints the tracebacks)."""

import json
import shutil
import sys
from pathlib import Path

import datasets
import pytest
import torch
from test_entry_points import script  # the scripts, each loaded once
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel
from transformers.utils import logging as hf_logging

from collab_attn import cli
from collab_attn.char_lm import data, models

ROOT = Path(__file__).resolve().parents[1]
TEXT = "".join(f"{w} to be, or not to be: that is the question {i % 7}.\n" for i, w in enumerate(["To", "Or"] * 40))
MRPC = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"] + [
    f"{i % 2}\t{100 + i}\t{200 + i}\tThe company said its profit rose {i} percent .\tProfit at the firm grew by {i} %"
    for i in range(8)
]
NAN_LAYER = "encoder.layer.2.attention.self: the query weights contain NaN or Inf"


def tiny_bert(model_class, folder: Path, tokenizer_path: str, value: float = float("nan")) -> Path:
    """A random 3-layer BERT (hidden 32, 4 heads) with MiniLM's tokenizer and ``value`` (NaN) in layer 2's query
    weight."""
    torch.manual_seed(0)
    model = model_class(BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37))
    encoder = model.bert.encoder if hasattr(model, "bert") else model.encoder
    with torch.no_grad():
        encoder.layer[2].attention.self.query.weight[5, 3] = value
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def template(tmp_path_factory, minilm_path) -> Path:
    """What the cases name: tiny BERTs with the NaN (a base model, a sequence classifier), a GLUE folder with a few
    MRPC rows, a character text and a character model with a NaN in its query weights."""
    root = tmp_path_factory.mktemp("template")
    tiny_bert(BertModel, root / "bert-nan", minilm_path)
    tiny_bert(BertModel, root / "bert", minilm_path, value=0.5)
    tiny_bert(BertForSequenceClassification, root / "classifier-nan", minilm_path)
    (root / "glue" / "MRPC").mkdir(parents=True)
    for split in ("train", "dev"):
        (root / "glue" / "MRPC" / f"{split}.tsv").write_text("\n".join(MRPC) + "\n")
    (root / "text.txt").write_text(TEXT)
    corpus = data.corpus_from_text(TEXT)
    lm = models.build_model(models.gpt_config(corpus.vocab_size, 16, 1, 2, 16), 0)
    with torch.no_grad():
        lm.transformer.h[0].attn.c_attn.weight[3, 2] = float("nan")  # c_attn's first n_embd columns: the queries
    lm.save_pretrained(root / "lm" / "model")
    (root / "lm" / "model" / "vocab.json").write_text(json.dumps(corpus.chars))
    return root


@pytest.fixture(autouse=True)
def quiet():
    """No progress bars (loading weights, tokenizing, predicting) on stderr, as with HF_HUB_DISABLE_PROGRESS_BARS=1,
    HF_DATASETS_DISABLE_PROGRESS_BARS=1 and TRANSFORMERS_VERBOSITY=error: what remains there is the error alone."""
    bars, datasets_bars = hf_logging.is_progress_bar_enabled(), not datasets.utils.are_progress_bars_disabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(verbosity)
    if bars:
        hf_logging.enable_progress_bar()
    if datasets_bars:
        datasets.enable_progress_bars()


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def run_main(name: str, args: list[str], template: Path, tmp_path: Path, monkeypatch, capsys):
    """``main()`` of ``scripts/<name>.py`` with ``args`` in a copy of ``template``, Hydra's run folder outside it;
    returns the exit status, stdout, stderr and the copy's files before and after."""
    cwd = tmp_path / "work"
    shutil.copytree(template, cwd)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [name, *args, f"hydra.run.dir={tmp_path / 'hydra'}"])
    module = script(name)
    # as `python scripts/<name>.py` runs it: Hydra finds the configs beside the script of a task in __main__
    monkeypatch.setattr(module.main.__wrapped__, "__module__", "__main__")
    before = snapshot(cwd)
    with pytest.raises(SystemExit) as stop:
        module.main()
    out, err = capsys.readouterr()
    return stop.value.code, out, err, before, snapshot(cwd)


CASES = {
    "train_glue": ["task=mrpc", "model=classifier-nan", "finetune=false", "data.glue_dir=glue", "logger=none",
                   "refit=none", "collab.rank=16", "output_root=results"],
    "convert_lm": ["data.path=text.txt", "train_dir=lm", "model_dir=lm/model", "output_dir=lm/convert", "methods=[cp]",
                   "ranks=[4]", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "block_size=16",
                   "eval_iters=2", "trainer.max_steps=4", "trainer.per_device_train_batch_size=4", "threads=1"],
    "visualize": ["model=bert-nan", "collab.rank=16", "output_dir=views"],
}
LAYERS = {"train_glue": "bert." + NAN_LAYER, "convert_lm": "transformer.h.0.attn: the query weights contain NaN or Inf",
          "visualize": NAN_LAYER}


@pytest.mark.parametrize("name", CASES)
def test_a_nan_query_weight_is_one_error_line_and_writes_nothing(template, tmp_path, monkeypatch, capsys, name):
    code, out, err, before, after = run_main(name, CASES[name], template, tmp_path, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert LAYERS[name] in lines[0] and lines[0].endswith("fix or retrain the checkpoint first"), lines[0]
    assert "Traceback" not in out + err
    assert after == before, sorted(set(after) ^ set(before))  # no results, job folder or temporary file


def test_a_real_error_in_the_work_keeps_its_traceback(template, tmp_path, monkeypatch, capsys):
    """Only the conversion's refusals become one line: a ValueError raised elsewhere in the work (a bug) is reported
    by Hydra with its traceback and exit status 1."""
    def broken(*args, **kwargs):
        raise ValueError("a bug in the comparison")

    monkeypatch.setattr(script("reparametrize"), "compare", broken)
    code, out, err, _, after = run_main("reparametrize", ["model=bert", "collab.rank=16", "collab.n_iter_max=2",
                                                          "output_dir=out"], template, tmp_path, monkeypatch, capsys)
    assert code == 1 and "Traceback" in err and "ValueError: a bug in the comparison" in err, err
    assert "error: " not in err and "out" not in after


def test_as_bad_input_makes_value_errors_bad_input_and_passes_the_rest():
    with pytest.raises(cli.BadInput, match="^layer 3: the key weights contain NaN or Inf$") as caught, \
            cli.as_bad_input():
        raise ValueError("layer 3: the key weights contain NaN or Inf")
    assert type(caught.value.__cause__) is ValueError  # the original, for a debugger
    missing = cli.Missing("no such file")
    with pytest.raises(cli.Missing) as kept, cli.as_bad_input():
        raise missing
    assert kept.value is missing
    with pytest.raises(RuntimeError, match="shape mismatch"), cli.as_bad_input():
        raise RuntimeError("shape mismatch")
    with cli.as_bad_input():
        pass


def test_bad_input_from_the_work_exits_2_and_anything_else_goes_through(capsys):
    def work():
        raise cli.BadInput("encoder.layer.0.attention.self: the query weights contain NaN or Inf")

    with pytest.raises(SystemExit) as stop:
        cli.exit_on_bad_input(work, bad=cli.BadInput)
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: encoder.layer.0.attention.self: the query weights contain NaN or Inf\n"
    with pytest.raises(KeyError):
        cli.exit_on_bad_input(lambda: {}["n_embd"], bad=cli.BadInput)
    assert capsys.readouterr().err == ""
