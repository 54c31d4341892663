"""The SmolLM2 cache race's parts on tiny random Llama models (the real model: scripts/race_smollm2.py): held-out text
that no fit reads, token windows, the comparison with the original (perplexity, KL, top-1) recomputed by hand, the
cache read from a real cache, resumable runs, the summary and the sizes each method gets at a budget."""

import copy
import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import GLUE_DIR

import collab_attn
from collab_attn.pretrained import distill, heldout, race

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_llama(seed=0, kv_heads=2):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=12,
                                      num_hidden_layers=2, intermediate_size=64, vocab_size=100,
                                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def rows(count=3, length=9, seed=0):
    ids = torch.randint(3, 100, (count, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 1
    return ids


@pytest.mark.skipif(not (GLUE_DIR / "QNLI").is_dir(), reason="needs ../shared/data/glue")
def test_fit_and_evaluation_text_share_nothing(tmp_path):
    shakespeare = tmp_path / "input.txt"
    shakespeare.write_text("".join(f"line {i}\n" + ("\n" if i % 10 == 9 else "") for i in range(80_000)))
    fit, validation, test = (heldout.texts("shakespeare", split, GLUE_DIR, shakespeare) for split in heldout.SPLITS)
    held = validation + test  # the evaluation text: validation, then test (tests/test_heldout_splits.py)
    assert fit + held == shakespeare.read_text() and len(held) == pytest.approx(0.1 * len(fit + held), rel=0.01)
    wiki_fit = heldout.texts("wikipedia", "fit", GLUE_DIR, shakespeare)
    wiki_eval = heldout.texts("wikipedia", "validation", GLUE_DIR, shakespeare)
    qnli = heldout._tsv_column(GLUE_DIR / "QNLI" / "dev.tsv", ["sentence"])
    assert wiki_eval.startswith(qnli[0]) and len(qnli) > 5000
    fitted = set(heldout._tsv_column(GLUE_DIR / "RTE" / "train.tsv", ["sentence1", "sentence2"]))
    assert len(fitted) > 2000 and qnli[0] not in wiki_fit and not fitted & set(qnli[:200])
    with pytest.raises(ValueError, match="domain='news'"):
        heldout.texts("news", "validation", GLUE_DIR, shakespeare)
    with pytest.raises(ValueError, match="split='dev'"):
        heldout.texts("wikipedia", "dev", GLUE_DIR, shakespeare)


class CharTokenizer:
    """A tokenizer of characters (ids 3 and up), with a beginning-of-text token 1."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [3 + ord(c) % 90 for c in text]})()


def test_windows_are_consecutive_and_start_with_the_beginning_of_text():
    text = "abcdefghijklmnopqrstuvwxyz"
    ids = heldout.windows(CharTokenizer(), text, length=5, count=3)
    assert ids.tolist() == [[1, *[3 + ord(c) % 90 for c in text[i * 4:(i + 1) * 4]]] for i in range(3)]
    with pytest.raises(ValueError, match="fewer than 7 windows of 5"):
        heldout.windows(CharTokenizer(), text, length=5, count=7)


def test_agreement_recomputes_by_hand():
    model, original, ids = tiny_llama(0), tiny_llama(1), rows()
    same = heldout.agreement(original, original, ids, batch=2)
    assert same.kl == pytest.approx(0, abs=1e-12) and same.top1 == 1 and same.perplexity == same.original_perplexity
    got = heldout.agreement(model, original, ids, batch=2)
    with torch.no_grad():
        logp = F.log_softmax(model(ids).logits[:, :-1].double(), -1)
        ref = F.log_softmax(original(ids).logits[:, :-1].double(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None]).mean()
    kl = F.kl_div(logp, ref, log_target=True, reduction="sum") / ids[:, 1:].numel()
    assert got.tokens == 3 * 8 and got.perplexity == pytest.approx(math.exp(nll), rel=1e-9)
    assert got.kl == pytest.approx(float(kl), rel=1e-9) and got.kl > 0.01
    assert got.top1 == pytest.approx(float((logp.argmax(-1) == ref.argmax(-1)).double().mean()))
    assert got.original_perplexity == pytest.approx(same.perplexity, rel=1e-12)


def test_agreement_keeps_each_windows_sums():
    model, original, ids = tiny_llama(0), tiny_llama(1), rows(count=5)
    got = heldout.agreement(model, original, ids, batch=2)
    assert len(got.windows) == 5 and all(w.tokens == 8 for w in got.windows)
    with torch.no_grad():
        logp = F.log_softmax(model(ids[3:4]).logits[:, :-1].double(), -1)
        ref = F.log_softmax(original(ids[3:4]).logits[:, :-1].double(), -1)
    fourth = got.windows[3]
    assert fourth.nll == pytest.approx(float(-logp.gather(-1, ids[3:4, 1:, None]).sum()), rel=1e-9)
    assert fourth.original_nll == pytest.approx(float(-ref.gather(-1, ids[3:4, 1:, None]).sum()), rel=1e-9)
    assert fourth.kl == pytest.approx(float(F.kl_div(logp, ref, log_target=True, reduction="sum")), rel=1e-9)
    assert fourth.top1 == int((logp.argmax(-1) == ref.argmax(-1)).sum())
    assert math.log(got.perplexity) == pytest.approx(sum(w.nll for w in got.windows) / got.tokens, rel=1e-12)
    assert got.top1 == sum(w.top1 for w in got.windows) / got.tokens
    again = heldout.agreement(original, original, ids, batch=3)  # the same windows: the same fingerprints
    assert [w.fingerprint for w in again.windows] == [w.fingerprint for w in got.windows]
    assert len({w.fingerprint for w in got.windows}) == 5
    assert got.as_dict()["windows"][3] == {"tokens": 8, "nll": fourth.nll, "original_nll": fourth.original_nll,
                                           "kl": fourth.kl, "top1": fourth.top1, "fingerprint": fourth.fingerprint}


def test_the_cache_is_read_from_a_real_cache():
    import collab_attn

    model = tiny_llama(kv_heads=2)
    assert race.mean_cache_numbers(model) == 2 * 2 * 12
    collab_attn.reparametrize(model, 16, value_rank=8, progress=False)
    assert race.mean_cache_numbers(model) == 16 + 8  # the rotated shared keys and the shared values


def test_a_run_is_written_once_and_read_back(tmp_path, monkeypatch):
    import collab_attn

    original = tiny_llama()
    windows = {domain: rows(seed=i) for i, domain in enumerate(heldout.DOMAINS)}
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: [f"answer {i}" for i in range(len(race.PROMPTS))])
    entry = race.Entry("cp", 16, 8, budget=0.5)
    assert entry.name == "cp-k16-v8" and race.Entry("none").name == "original"
    first = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48)
    assert first["cache_numbers"] == 24 and first["cache_fraction"] == 0.5 and first["mean_layer_error"] > 0
    assert set(first["domains"]) == set(heldout.DOMAINS) and first["domains"]["wikipedia"]["kl"] > 0
    with pytest.raises(ValueError, match="more than its budget 0.25 x 48"):
        race.run_entry(race.Entry("cp", 16, 8, budget=0.25), tiny_llama(), None, windows, tmp_path / "b", 48)
    assert not (tmp_path / "b").exists()
    monkeypatch.setattr(collab_attn, "reparametrize", lambda *a, **k: pytest.fail("converted again"))
    assert race.run_entry(entry, original, None, windows, tmp_path, original_cache=48) == first
    assert json.loads((tmp_path / "runs" / "cp-k16-v8.json").read_text()) == first

    baseline = race.run_entry(race.Entry("none"), original, None, windows, tmp_path, original_cache=48)
    text = race.summary_markdown(race.load_runs(tmp_path), "python scripts/race_smollm2.py", "setup")
    m = first["domains"]["shakespeare"]
    assert (f"| 0.5 | cp-k16-v8 | 24 | 0.500 | {m['perplexity']:.2f} | "
            f"{m['perplexity'] / m['original_perplexity']:.3f}x | {m['kl']:.4f} | {m['top1']:.3f} |") in text
    assert text.index("| original |") < text.index("| cp-k16-v8 |") and baseline["domains"]["wikipedia"]["kl"] == 0
    assert race.plot(race.load_runs(tmp_path), tmp_path / "p.png").stat().st_size > 10_000


def fake_run(method, nll, sample=0, windows=True, distill=0, budget=0.25):
    """A run file as run_entry writes it, 8 windows of 10 tokens per domain whose nll per token is ``nll`` plus a
    difficulty shared by every run (window i: 0.3 sin i)."""
    entry = race.Entry(method, 8, budget=budget, distill_tokens=distill, calibration_tokens=16,
                       calibration_sample=sample)
    records = [{"tokens": 10, "nll": 10 * (nll + 0.3 * math.sin(i)), "original_nll": 25.0, "kl": 1.0, "top1": 5,
                "fingerprint": f"{i:08x}"} for i in range(8)]
    measured = {"tokens": 80, "perplexity": math.exp(sum(w["nll"] for w in records) / 80),
                "original_perplexity": math.exp(2.5), "kl": 0.1, "top1": 0.5}
    return {"name": entry.name, "entry": dataclasses.asdict(entry), "cache_numbers": 24.0, "cache_fraction": budget,
            "mean_layer_error": 0.5, "domains": {d: dict(measured, **({"windows": records} if windows else {}))
                                                 for d in heldout.DOMAINS},
            "answers": [""] * len(race.PROMPTS)}


def test_the_summary_puts_an_interval_beside_every_verdict(tmp_path):
    from collab_attn.stats import window_bootstrap

    def table(results):
        return {tuple(c.strip() for c in line.split("|")[1:4]): line for line in race.verdicts_markdown(results)
                if line.startswith("| wikipedia")}

    cp, kv, tucker = fake_run("cp", 3.0), fake_run("kv-svd", 3.3), fake_run("tucker", 3.02)
    for i, w in enumerate(tucker["domains"]["wikipedia"]["windows"]):  # +-0.1 nats per token about 3.02: a tie
        w["nll"] += (-1) ** i
    distilled = fake_run("cp", 4.0, windows=False, distill=100)
    rows = table([kv, tucker, cp, distilled])
    best, peer = "cp-k8-calibrated16", "kv-svd-k8-calibrated16"
    assert set(rows) == {("wikipedia", best, "tucker-k8-calibrated16"), ("wikipedia", best, peer),
                         ("wikipedia", best, "cp-k8-calibrated16-distilled100"),
                         ("wikipedia", "tucker-k8-calibrated16", peer),
                         ("wikipedia", "cp-k8-calibrated16-distilled100", peer)}
    low, high = window_bootstrap(cp["domains"]["wikipedia"]["windows"], kv["domains"]["wikipedia"]["windows"]).interval
    assert rows["wikipedia", best, peer] == (f"| wikipedia | {best} | {peer} | {math.exp(-0.3):.3g}x "
                                             f"[{1 + low:.3g}x, {1 + high:.3g}x] ahead (sample 0, 8 windows) | "
                                             "one sample | **ahead** |")
    assert rows["wikipedia", best, "tucker-k8-calibrated16"].endswith("tie (sample 0, 8 windows) | one sample | tie |")
    assert rows["wikipedia", "tucker-k8-calibrated16", peer].endswith(
        "ahead (sample 0, 8 windows) | one sample | **ahead** |")
    assert rows["wikipedia", best, "cp-k8-calibrated16-distilled100"].endswith(
        f"| {math.exp(-1.0):.3g}x (sample 0, no per-window data) | one sample | one run, no per-window data: no "
        "verdict |")
    assert "Distilled runs: one run each" in "\n".join(race.verdicts_markdown([cp, distilled]))
    assert "Distilled runs" not in "\n".join(race.verdicts_markdown([cp, kv]))
    # a second calibration sample of each: sample 0's ratio beside its windows' interval, the geometric mean over
    # the samples beside the t-interval over them (never one sample's estimate beside the other's interval)
    from collab_attn.stats import compare_on_shared_seeds

    samples = [fake_run("cp", 3.05, sample=1, windows=False), fake_run("kv-svd", 3.4, sample=1, windows=False)]
    row = table([cp, kv, *samples])["wikipedia", best, peer]
    over = compare_on_shared_seeds({0: 3.0, 1: 3.05}, {0: 3.3, 1: 3.4})
    assert (f"| {math.exp(-0.3):.3g}x [{1 + low:.3g}x, {1 + high:.3g}x] ahead (sample 0, 8 windows) | "
            f"{math.exp(-0.325):.3g}x [{math.exp(over.interval[0]):.3g}x, {math.exp(over.interval[1]):.3g}x] ahead "
            "(geometric mean of 2 samples) | **ahead** |") in row
    close = [fake_run("cp", 3.35, sample=1, windows=False), samples[1]]  # sample 1 turns the order round: a tie
    assert table([cp, kv, *close])["wikipedia", best, peer].endswith("tie (geometric mean of 2 samples) | tie |")
    assert table([fake_run("cp", 3.0), fake_run("kv-svd", 3.0)])["wikipedia", best, peer].endswith(
        "| 1x [1x, 1x] tie (sample 0, 8 windows) | one sample | tie |")

    (tmp_path / "runs").mkdir()
    for r in (cp, kv):
        (tmp_path / "runs" / f"{r['name']}.json").write_text(json.dumps(r))
    (tmp_path / "summary.md").write_text(race.summary_markdown([cp], "python scripts/race_smollm2.py --x", "my setup"))
    written = race.rewrite_summary(tmp_path).read_text()
    assert written == race.summary_markdown([cp, kv], "python scripts/race_smollm2.py --x", "my setup")
    assert "## Verdicts" in written and written.index("## Verdicts") < written.index("## Answers")


def script():
    spec = importlib.util.spec_from_file_location("race_smollm2", ROOT / "scripts" / "race_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_method_is_sized_within_the_budget():
    race_script = script()
    assert race_script.entries_at("cp", 0.5, 4) == [race.Entry("cp", 96, 96, budget=0.5)]
    assert race_script.entries_at("cp", 0.125, 4) == [race.Entry("cp", 24, 24, budget=0.125)]
    assert race_script.entries_at("key-svd", 0.25, 4) == [race.Entry("key-svd", 48, 48, budget=0.25)]
    assert race_script.entries_at("kv-svd", 0.25, 4) == [race.Entry("kv-svd", 72, options={"rope_pairs": 4},
                                                                    budget=0.25)]
    assert race_script.entries_at("merge-kv", 0.5, 4) == [race.Entry("merge-kv", 64, budget=0.5)]
    assert race_script.entries_at("drop-kv", 0.25, 4) == []  # one group of 64 caches a third
    assert race_script.entries_at("drop-kv", 0.75, 4) == [race.Entry("drop-kv", 128, budget=0.75)]
    # merging: 2 groups of 64 would fit, but 2 does not divide 3
    assert race_script.entries_at("merge-kv", 0.75, 4) == [race.Entry("merge-kv", 64, budget=0.75)]
    # a model with 2 key/value heads of 12 (a cache of 48 numbers), distilled
    assert race_script.entries_at("kv-svd", 0.5, 2, kv_heads=2, head_dim=12, distill_tokens=100) == [
        race.Entry("kv-svd", 16, options={"rope_pairs": 2}, budget=0.5, distill_tokens=100)]
    assert race_script.entries_at("merge-kv", 0.5, 2, kv_heads=2, head_dim=12) == [race.Entry("merge-kv", 12,
                                                                                              budget=0.5)]
    assert race.Entry("cp", 8, 8, distill_tokens=100).name == "cp-k8-v8-distilled100"
    assert race_script.entries_at("key-svd", 0.25, 4, calibration_tokens=64) == [
        race.Entry("key-svd", 48, 48, budget=0.25, calibration_tokens=64)]
    assert race.Entry("kv-svd", 8, options={"rope_pairs": 2}, calibration_tokens=64).name == (
        "kv-svd-k8-rope_pairs2-calibrated64")


def test_the_distillation_starts_from_the_calibrated_conversion_when_both_are_asked_for():
    from types import SimpleNamespace

    race_script = script()
    args = SimpleNamespace(
        fit_text="mixed", distill_learning_rate=1e-4, distill_passes=1,
        methods=["kv-svd", "drop-kv"], budgets=[0.75, 0.25], distill_budgets=[0.25], rope_pairs=4,
                           distill_tokens=100, calibration_tokens=64, calibration_sample=0, pairs_by_budget=False,
                           fit_steps=0, allocate=False, bands="per-layer")
    extra = [race.Entry("key-svd", 192, 96), race.Entry("drop-kv", 128)]
    names = [entry.name for entry in race_script.race_entries(args, 3, 64, extra)]
    assert names == ["original", "kv-svd-k264-rope_pairs4", "drop-kv-k128", "kv-svd-k72-rope_pairs4",
                     "key-svd-k192-v96", "drop-kv-k128", "kv-svd-k72-rope_pairs4-calibrated64-distilled100",
                     "kv-svd-k264-rope_pairs4-calibrated64", "kv-svd-k72-rope_pairs4-calibrated64",
                     "key-svd-k192-v96-calibrated64"]
    args.methods, args.pairs_by_budget = ["key-svd", "kv-svd"], True  # the key width of key-svd as a budget
    assert [e.name for e in race_script.race_entries(args, 3, 64, [])][-2:] == [
        "key-svd-kmean144-v144-calibrated64", "key-svd-kmean48-v48-calibrated64"]
    args.methods, args.pairs_by_budget = ["kv-svd", "drop-kv"], False
    args.calibration_sample = 1  # another block of the fitting text: named for it, the plain runs unchanged
    names = [entry.name for entry in race_script.race_entries(args, 3, 64, [])]
    assert "kv-svd-k72-rope_pairs4-calibrated64s1" in names and "kv-svd-k72-rope_pairs4" in names
    args.calibration_tokens, args.calibration_sample = 0, 0  # no calibration: distilled from the weight fit
    assert "kv-svd-k72-rope_pairs4-distilled100" in [e.name for e in race_script.race_entries(args, 3, 64, [])]
    args.distill_learning_rate = 3e-4  # another peak rate names the distilled run, and only it
    names = [e.name for e in race_script.race_entries(args, 3, 64, [])]
    assert "kv-svd-k72-rope_pairs4-distilled100lr0.0003" in names and "kv-svd-k72-rope_pairs4" in names
    with pytest.raises(ValueError, match="distill_learning_rate=0.0003 sets the rate of a distillation"):
        race.Entry("kv-svd", 72, distill_learning_rate=3e-4)
    args.distill_passes = 2  # and more passes over its tokens
    names = [e.name for e in race_script.race_entries(args, 3, 64, [])]
    assert "kv-svd-k72-rope_pairs4-distilled100lr0.0003x2" in names
    with pytest.raises(ValueError, match="distill_passes=0: a distillation reads its tokens once or more"):
        race.Entry("kv-svd", 72, distill_tokens=100, distill_passes=0)


def test_fit_steps_add_a_fitted_run_of_every_calibrated_one_and_distil_from_it():
    from types import SimpleNamespace

    args = SimpleNamespace(
        fit_text="mixed", distill_learning_rate=1e-4, distill_passes=1,
        methods=["kv-svd", "drop-kv"], budgets=[0.75, 0.25], distill_budgets=[0.25], rope_pairs=4,
                           distill_tokens=100, calibration_tokens=64, calibration_sample=0, pairs_by_budget=False,
                           fit_steps=30, fit_target="layer", fit_solve_output=False, allocate=False, e2e_steps=0,
                           bands="per-layer")
    names = [entry.name for entry in script().race_entries(args, 3, 64, [race.Entry("key-svd", 192, 96)])]
    assert names == ["original", "kv-svd-k264-rope_pairs4", "drop-kv-k128", "kv-svd-k72-rope_pairs4",
                     "key-svd-k192-v96", "kv-svd-k72-rope_pairs4-calibrated64-fitted30-distilled100",
                     "kv-svd-k264-rope_pairs4-calibrated64", "kv-svd-k72-rope_pairs4-calibrated64",
                     "key-svd-k192-v96-calibrated64", "kv-svd-k264-rope_pairs4-calibrated64-fitted30",
                     "kv-svd-k72-rope_pairs4-calibrated64-fitted30", "key-svd-k192-v96-calibrated64-fitted30"]
    args.e2e_steps, args.e2e_learning_rate, args.e2e_tokens = 8, 3e-4, 0  # then each fitted one end to end too
    args.e2e_check_tokens = args.e2e_held_out_tokens = args.e2e_length = args.e2e_check_every = 0
    args.e2e_held_out_text, args.e2e_anchor = "", 0.0
    assert [entry.name for entry in script().race_entries(args, 3, 64, [])][-2:] == [
        "kv-svd-k264-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003",
        "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003"]
    args.e2e_tokens = 1024  # on fitting tokens of its own; the distilled ones start from the end-to-end fit
    names = [entry.name for entry in script().race_entries(args, 3, 64, [])]
    assert names[-1] == "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003on1024"
    assert "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003on1024-distilled100" in names
    args.e2e_check_tokens = 512  # judged on the first 512 of them
    assert script().race_entries(args, 3, 64, [])[-1].name == (
        "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003on1024check512")
    args.e2e_check_tokens, args.e2e_held_out_tokens = 0, 256  # or on the 256 fitting tokens after them
    assert script().race_entries(args, 3, 64, [])[-1].name == (
        "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003on1024held256")
    args.e2e_length = 2048  # in windows of 2,048 tokens
    assert script().race_entries(args, 3, 64, [])[-1].name == (
        "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003on1024held256len2048")
    args.e2e_check_every = 4  # its held-out loss every 4 steps too, the lowest's weights kept
    assert script().race_entries(args, 3, 64, [])[-1].name == (
        "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003on1024held256len2048stop4")
    args.e2e_held_out_text = "code"  # held out from code's fit split, which the fit does not read
    assert script().race_entries(args, 3, 64, [])[-1].name == (
        "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003on1024held256codelen2048stop4")
    args.e2e_anchor = 10.0  # each step's loss pulled toward the layer fit's weights
    assert script().race_entries(args, 3, 64, [])[-1].name == (
        "kv-svd-k72-rope_pairs4-calibrated64-fitted30-e2e8lr0.0003on1024held256codelen2048stop4anchor10")
    with pytest.raises(ValueError, match="e2e_anchor=10.0 weighs a pull in an end-to-end fit the entry does not make"):
        race.Entry("key-svd", 96, 96, calibration_tokens=64, fit_steps=3, e2e_anchor=10.0)
    for every in (8, -1):
        with pytest.raises(ValueError, match=f"e2e_check_every={every} checks an end-to-end fit every that many "
                                             "steps: give e2e_steps above it"):
            race.Entry("key-svd", 96, 96, calibration_tokens=64, fit_steps=3, e2e_steps=8, e2e_check_every=every)
    with pytest.raises(ValueError, match="e2e_check_tokens=512 names the tokens of an end-to-end fit the entry does"):
        race.Entry("key-svd", 96, 96, calibration_tokens=64, fit_steps=3, e2e_check_tokens=512)


def test_the_summary_describes_every_kind_of_run_its_folder_holds_not_the_last_command():
    import dataclasses

    base = race.Entry("key-svd", 96, 96, calibration_tokens=64)
    fitted = dataclasses.replace(base, fit_steps=100)
    long_fit = dataclasses.replace(base, fit_steps=600, fit_target="residual", e2e_steps=64, e2e_tokens=1024,
                                   e2e_check_tokens=256)
    entries = [dataclasses.asdict(e) for e in (race.Entry("none"), base, fitted, long_fit)]
    text = script().rows_described(entries, 4)
    for meaning in ("Calibrated rows (-calibrated<T>", "Fitted rows (-fitted<N>): then each converted attention "
                    "layer trained N Adam steps (batch 4)", "-fitted<N>residual: target residual", "-e2e<M> rows",
                    "with -e2e<M>on<T> on the first T fitting tokens", "...check<C>: its loss before and after"):
        assert meaning in text
    assert "600" not in text and "100" not in text  # the step counts are in the names of the rows, which differ
    assert "check<C>" not in script().rows_described(entries[:3], 4)
    held = dataclasses.replace(long_fit, e2e_check_tokens=0, e2e_held_out_tokens=256)
    assert "...held<H>: measured on the H fitting tokens after them" in script().rows_described(
        [dataclasses.asdict(held)], 4) and "held<H>" not in text
    longer = dataclasses.replace(long_fit, e2e_length=2048)
    assert "...len<L>: its fitting tokens in windows of L tokens" in script().rows_described(
        [dataclasses.asdict(longer)], 4) and "len<L>" not in text
    stopped = dataclasses.replace(held, e2e_check_every=16)
    assert "...stop<K>: that loss measured every K steps too" in script().rows_described(
        [dataclasses.asdict(stopped)], 4) and "stop<K>" not in text
    pulled = dataclasses.replace(held, e2e_anchor=10.0)
    assert "...anchor<A>: each step's loss plus A times the relative squared distance" in script().rows_described(
        [dataclasses.asdict(pulled)], 4) and "anchor<A>" not in text
    for absent in ("Distilled", "-ls", "-kalloc"):
        assert absent not in text
    assert script().rows_described(entries[:1], 4) == ""


@pytest.mark.parametrize("argv, message", [
    (["--calibration-sample", "-1", "--calibration-tokens", "64"], "--calibration-sample must be 0 or positive"),
    (["--calibration-sample", "1"], "with --calibration-tokens"),
    (["--fit-steps", "10"], "--fit-steps must be 0 (no fit) or positive, with --calibration-tokens"),
    (["--fit-steps", "-1", "--calibration-tokens", "64"], "--fit-steps must be 0 (no fit) or positive"),
    (["--pairs-by-budget", "--methods", "kv-svd", "--budgets", "2"], "--budgets must lie in (0, 1]"),
    (["--allocate"], "--allocate measures candidate sizes on the calibration tokens"),
    (["--fit-target", "residual"], "--fit-target residual needs --fit-steps"),
    (["--fit-solve-output"], "--fit-solve-output solves the output projections in the fit: give --fit-steps"),
    (["--e2e-steps", "5", "--calibration-tokens", "64"], "--e2e-steps must be 0 (none) or positive, with --fit-steps"),
    (["--e2e-steps", "5", "--calibration-tokens", "64", "--fit-steps", "3", "--e2e-learning-rate", "0"],
     "--e2e-learning-rate must be positive"),
    (["--e2e-tokens", "4096", "--calibration-tokens", "64", "--fit-steps", "3"],
     "--e2e-tokens must be 0 (the calibration tokens) or positive, with --e2e-steps"),
    (["--e2e-tokens", "-1", "--calibration-tokens", "64", "--fit-steps", "3", "--e2e-steps", "2"],
     "--e2e-tokens must be 0"),
    (["--long-length", "128"], "--long-length must exceed --length (256)"),
    (["--e2e-check-tokens", "512", "--calibration-tokens", "64", "--fit-steps", "3"],
     "--e2e-check-tokens must be 0 (all the fitting tokens) or positive, with --e2e-steps"),
    (["--allocate", "--calibration-tokens", "64", "--allocation-steps", "0"], "--allocation-steps and"),
    (["--sensitivity", "17"], "--sensitivity must be 0 (none) or a number of held-out windows up to --windows (16)"),
    (["--calibration-tokens", "64", "--fit-steps", "3", "--e2e-steps", "2", "--e2e-held-out-tokens", "512"],
     "--e2e-held-out-tokens must be 0 (judged on the fitting tokens) or positive, with --e2e-tokens"),
    (["--calibration-tokens", "64", "--fit-steps", "3", "--e2e-steps", "2", "--e2e-tokens", "4096",
      "--e2e-check-tokens", "512", "--e2e-held-out-tokens", "512"], "and without --e2e-check-tokens"),
    (["--calibration-tokens", "64", "--fit-steps", "3", "--e2e-steps", "2", "--e2e-length", "2048"],
     "--e2e-length must be 0 (--length) or positive, with --e2e-tokens; got 2048"),
    (["--calibration-tokens", "64", "--fit-steps", "3", "--e2e-steps", "2", "--e2e-check-every", "2"],
     "--e2e-check-every must be 0 (no early stopping) or from 1 to --e2e-steps - 1; got 2 with --e2e-steps 2"),
    (["--calibration-tokens", "64", "--fit-steps", "3", "--e2e-steps", "2", "--e2e-anchor", "-1"],
     "--e2e-anchor must be 0 (none) or a finite number > 0, with --e2e-steps; got -1.0"),
    (["--calibration-tokens", "64", "--fit-steps", "3", "--e2e-anchor", "10"], "with --e2e-steps; got 10.0"),
    (["--calibration-tokens", "64", "--fit-steps", "3", "--e2e-steps", "2", "--e2e-held-out-text", "code"],
     "--e2e-held-out-text code names where the held-out tokens come from: give --e2e-held-out-tokens too"),
    (["--calibration-tokens", "64", "--fit-steps", "3", "--e2e-steps", "2", "--e2e-tokens", "4096",
      "--e2e-held-out-tokens", "512", "--e2e-held-out-text", "wikipedia"],
     "--e2e-held-out-text wikipedia: --fit-text all reads that domain; choose a domain the fit does not read"),
])
def test_bad_race_options_give_one_error_and_write_nothing(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        script().main(["--out", str(tmp_path / "race"), *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "race").exists()


def test_a_calibrated_entry_is_fitted_to_the_originals_attention_inputs(tmp_path, monkeypatch):
    """The entry's conversion takes the calibration the race collected from the original once, and says so in its
    report; an entry asking for one without a way to get it is refused before anything is converted."""
    from collab_attn.fitting.calibration import collect_calibration

    original = tiny_llama()
    windows = {domain: rows(seed=i) for i, domain in enumerate(heldout.DOMAINS)}
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: [])
    entry = race.Entry("kv-svd", 16, options={"rope_pairs": 2}, budget=0.5, calibration_tokens=64)
    with pytest.raises(ValueError, match="asks for a calibration: pass run_entry"):
        race.run_entry(entry, original, None, windows, tmp_path, original_cache=48)
    collected = []

    def calibration():
        collected.append(collect_calibration(original, [{"input_ids": rows(count=4, length=16, seed=5)}]))
        return collected[-1]

    calibrated = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, calibration=calibration)
    plain = race.run_entry(race.Entry("kv-svd", 16, options={"rope_pairs": 2}, budget=0.5), original, None, windows,
                           tmp_path, original_cache=48, calibration=calibration)
    assert len(collected) == 1 and calibrated["name"] == "kv-svd-k16-rope_pairs2-calibrated64"
    assert calibrated["mean_layer_error"] != plain["mean_layer_error"]


def test_a_fitted_entry_is_fitted_on_the_calibration_tokens_and_named_for_it(tmp_path, monkeypatch):
    """``fit_steps``: after the calibrated conversion, ``fit_to_original`` on the calibration windows; the run is named
    ``-fitted<N>``, records the fit per layer and is closer to the original than the calibrated run it starts from."""
    from collab_attn.fitting.calibration import collect_calibration

    config = tiny_llama().config
    config.initializer_range = 0.2  # attention far from uniform: keys matter
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).eval()
    windows = {domain: rows(count=4, length=24, seed=i) for i, domain in enumerate(heldout.DOMAINS)}
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: [])
    fitting = rows(count=16, length=24, seed=5)
    common = {"budget": 0.5, "calibration_tokens": 128}
    entry = race.Entry("key-svd", 12, 12, **common, fit_steps=20)
    assert entry.name == "key-svd-k12-v12-calibrated128-fitted20"
    distilled = race.Entry("cp", 8, 8, **common, fit_steps=5, distill_tokens=64)
    assert distilled.name == "cp-k8-v8-calibrated128-fitted5-distilled64"

    def calibration():
        return collect_calibration(original, [{"input_ids": fitting}])

    with pytest.raises(ValueError, match="is fitted on its calibration tokens: give it calibration_tokens and pass"):
        race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, calibration=calibration)
    fitted = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                            calibration_rows=lambda: fitting)
    plain = race.run_entry(race.Entry("key-svd", 12, 12, **common), original, None, windows, tmp_path,
                           original_cache=48, calibration=calibration)
    assert fitted["fit"]["steps"] == 20 and len(fitted["fit"]["layers"]) == 2 and plain["fit"] is None
    assert all(layer["error_after"] < layer["error_before"] for layer in fitted["fit"]["layers"])
    assert fitted["cache_numbers"] == plain["cache_numbers"] == 24
    for domain in heldout.DOMAINS:
        assert fitted["domains"][domain]["kl"] < plain["domains"][domain]["kl"]
    both = race.Entry("key-svd", 12, 12, **common, fit_steps=20, e2e_steps=30, e2e_learning_rate=3e-3)
    assert both.name == "key-svd-k12-v12-calibrated128-fitted20-e2e30lr0.003"
    # the layer fit is kept and read back by every run that starts from it (no second fit), exactly as it was
    assert race.fitted_state_path(both, tmp_path) == race.fitted_state_path(entry, tmp_path)
    assert race.fitted_state_path(entry, tmp_path).is_file()
    monkeypatch.setattr(collab_attn, "fit_to_original", lambda *a, **k: pytest.fail("the layer fit was made again"))
    (tmp_path / "runs" / f"{entry.name}.json").unlink()
    again = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                           calibration_rows=lambda: fitting)
    assert again["fit"] == fitted["fit"] and again["domains"] == fitted["domains"]
    end_to_end = race.run_entry(both, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                                calibration_rows=lambda: fitting)
    assert end_to_end["end_to_end"]["steps"] == 30 and end_to_end["end_to_end"]["kept_fit"]
    assert fitted["end_to_end"] is None and end_to_end["cache_numbers"] == 24
    for domain in heldout.DOMAINS:
        assert end_to_end["domains"][domain]["kl"] < fitted["domains"][domain]["kl"]
    # the end-to-end fit on fitting tokens of its own (fit_rows), from the same layer fit
    fresh = dataclasses.replace(both, e2e_tokens=480)
    assert fresh.name == "key-svd-k12-v12-calibrated128-fitted20-e2e30lr0.003on480"
    assert race.fitted_state_path(fresh, tmp_path) == race.fitted_state_path(entry, tmp_path)
    with pytest.raises(ValueError, match="trains on fitting text beyond the calibration tokens: pass"):
        race.run_entry(fresh, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                       calibration_rows=lambda: fitting)
    with pytest.raises(ValueError, match="names the tokens of an end-to-end fit the entry does not make"):
        dataclasses.replace(entry, e2e_tokens=480)
    asked = []

    def fit_rows(tokens):
        asked.append(tokens)
        return rows(count=tokens // 24, length=24, seed=7)

    on_fresh = race.run_entry(fresh, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                              calibration_rows=lambda: fitting, fit_rows=fit_rows)
    assert asked == [480] and on_fresh["end_to_end"]["tokens"] == 480 and on_fresh["fit"] == fitted["fit"]
    assert on_fresh["end_to_end"]["kept_fit"] and on_fresh["entry"]["e2e_tokens"] == 480
    assert on_fresh["end_to_end"]["loss_before"] != end_to_end["end_to_end"]["loss_before"]  # on other tokens
    # judged on the first two batches (100 tokens: 2 batches of 4 x 24) of them: the same steps, the same weights
    checked = race.run_entry(dataclasses.replace(fresh, e2e_check_tokens=100), original, None, windows, tmp_path,
                             original_cache=48, calibration=calibration, calibration_rows=lambda: fitting,
                             fit_rows=fit_rows)
    assert (checked["end_to_end"]["tokens"], checked["end_to_end"]["check_tokens"]) == (480, 192)
    assert checked["name"].endswith("-e2e30lr0.003on480check100") and checked["end_to_end"]["kept_fit"]
    kept = [torch.load(race.fitted_state_path(e, tmp_path, "end-to-end"), weights_only=True)["state"]
            for e in (fresh, dataclasses.replace(fresh, e2e_check_tokens=100))]
    assert kept[0].keys() == kept[1].keys()
    for key in kept[0]:
        torch.testing.assert_close(kept[1][key], kept[0][key], rtol=0, atol=0)
    # or judged on the 48 fitting tokens after its own (2 windows), which it does not train on: the same weights
    held = dataclasses.replace(fresh, e2e_held_out_tokens=48)
    assert held.name == "key-svd-k12-v12-calibrated128-fitted20-e2e30lr0.003on480held48"
    asked.clear()
    judged = race.run_entry(held, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                            calibration_rows=lambda: fitting, fit_rows=fit_rows)
    assert sorted(set(asked)) == [480, 528] and judged["end_to_end"]["held_out"]
    assert (judged["end_to_end"]["tokens"], judged["end_to_end"]["check_tokens"]) == (480, 48)
    assert judged["end_to_end"]["kept_fit"] and judged["domains"] == on_fresh["domains"]
    assert judged["end_to_end"]["loss_before"] != on_fresh["end_to_end"]["loss_before"]
    with pytest.raises(ValueError, match="on its first e2e_check_tokens or on e2e_held_out_tokens after them, not"):
        dataclasses.replace(held, e2e_check_tokens=100)
    # or on the first 48 tokens of another domain's fit split, one the fit does not read (early stopping there)
    elsewhere = dataclasses.replace(held, e2e_held_out_text="code")
    assert elsewhere.name == "key-svd-k12-v12-calibrated128-fitted20-e2e30lr0.003on480held48code"
    texts = []

    def fit_rows_of(tokens, text=None):
        texts.append((tokens, text))
        return rows(count=tokens // 24, length=24, seed=7 if text is None else 11)

    away = race.run_entry(elsewhere, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                          calibration_rows=lambda: fitting, fit_rows=fit_rows_of)
    assert sorted(set(texts), key=str) == [(48, "code"), (480, None)] and away["end_to_end"]["held_out"]
    assert (away["end_to_end"]["tokens"], away["end_to_end"]["check_tokens"]) == (480, 48)
    assert away["end_to_end"]["loss_before"] != judged["end_to_end"]["loss_before"]  # judged on other tokens
    assert away["entry"]["e2e_held_out_text"] == "code"
    # pulled toward the layer fit's weights: the same start, judged alike, another fit
    pulled = race.run_entry(dataclasses.replace(held, e2e_anchor=100.0), original, None, windows, tmp_path,
                            original_cache=48, calibration=calibration, calibration_rows=lambda: fitting,
                            fit_rows=fit_rows)
    assert pulled["name"].endswith("-e2e30lr0.003on480held48anchor100") and pulled["end_to_end"]["anchor"] == 100.0
    assert pulled["end_to_end"]["loss_before"] == judged["end_to_end"]["loss_before"]
    assert pulled["end_to_end"]["history"] != judged["end_to_end"]["history"]
    with pytest.raises(ValueError, match="e2e_held_out_text='wikipedia': the end-to-end fit is judged on another "
                                         "domain's fit split, one that fit_text='mixed' does not read: choose one of "
                                         "code"):
        dataclasses.replace(elsewhere, e2e_held_out_text="wikipedia")
    with pytest.raises(ValueError, match="names where the end-to-end fit's held-out tokens come from"):
        dataclasses.replace(fresh, e2e_held_out_text="code")
    with pytest.raises(ValueError, match="e2e_held_out_tokens=48 are the fitting tokens after .* give it e2e_tokens"):
        dataclasses.replace(both, e2e_held_out_tokens=48)
    # the end-to-end fit is kept too, and read back by a run that starts from it
    assert race.fitted_state_path(fresh, tmp_path, "end-to-end").is_file()
    with pytest.raises(ValueError, match="stage must be 'layer', 'end-to-end' or 'distilled'"):
        race.fitted_state_path(fresh, tmp_path, "merged")
    assert race.fitted_state_path(dataclasses.replace(fresh, distill_tokens=64), tmp_path, "end-to-end") == (
        race.fitted_state_path(fresh, tmp_path, "end-to-end"))
    monkeypatch.setattr(collab_attn, "fit_end_to_end", lambda *a, **k: pytest.fail("the end-to-end fit again"))
    (tmp_path / "runs" / f"{fresh.name}.json").unlink()
    assert race.run_entry(fresh, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                          calibration_rows=lambda: fitting, fit_rows=fit_rows)["domains"] == on_fresh["domains"]
    other = race.Entry("key-svd", 8, 8, **common, fit_steps=20)  # another conversion's fit is refused
    race.fitted_state_path(entry, tmp_path).rename(race.fitted_state_path(other, tmp_path))
    with pytest.raises(ValueError, match="written by another conversion; delete it"):
        race.run_entry(other, original, None, windows, tmp_path, original_cache=48, calibration=calibration,
                       calibration_rows=lambda: fitting)


def test_the_end_to_end_fit_takes_its_own_tokens_in_longer_windows_about_as_many_a_step(tmp_path, monkeypatch):
    """``e2e_length``: the end-to-end fit's fitting tokens asked of ``fit_rows`` in windows of that length, as many
    windows a step as hold about ``batch`` calibration windows' tokens, judged on as many of its first tokens; the
    layer fit it starts from is the run's without it; a length without its own tokens is refused."""
    from collab_attn.fitting.calibration import collect_calibration

    original = tiny_llama()
    windows = {domain: rows(count=2, length=24, seed=i) for i, domain in enumerate(heldout.DOMAINS)}
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: [])
    fitting = rows(count=8, length=24, seed=5)
    entry = race.Entry("key-svd", 8, 12, budget=0.5, calibration_tokens=128, fit_steps=3, e2e_steps=4,
                       e2e_tokens=480, e2e_check_tokens=96, e2e_length=48)
    assert entry.name == "key-svd-k8-v12-calibrated128-fitted3-e2e4on480check96len48"
    assert race.fitted_state_path(entry, tmp_path) == race.fitted_state_path(
        dataclasses.replace(entry, e2e_steps=0, e2e_tokens=0, e2e_check_tokens=0, e2e_length=0), tmp_path)
    with pytest.raises(ValueError, match="e2e_length=48 sets the windows of the end-to-end fit's own fitting tokens"):
        dataclasses.replace(entry, e2e_tokens=0, e2e_check_tokens=0)
    asked, seen = [], []

    def fit_rows(tokens, length=24):
        asked.append((tokens, length))
        return rows(count=-(-tokens // length), length=length, seed=7)

    real = collab_attn.fit_end_to_end
    monkeypatch.setattr(collab_attn, "fit_end_to_end",
                        lambda model, orig, batches, **options: seen.append(batches) or real(model, orig, batches,
                                                                                             **options))
    result = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, batch=4,
                            calibration=lambda: collect_calibration(original, [{"input_ids": fitting}]),
                            calibration_rows=lambda: fitting, fit_rows=fit_rows)
    assert asked == [(480, 48)]
    assert [b["input_ids"].shape for b in seen[0]] == [(2, 48)] * 5  # 4 windows of 24 tokens: 2 of 48
    assert (result["end_to_end"]["tokens"], result["end_to_end"]["check_tokens"]) == (480, 96)
    assert result["entry"]["e2e_length"] == 48 and result["end_to_end"]["steps"] == 4


def a_finished_fitted_run(tmp_path, monkeypatch, windows):
    """A tiny Llama's fitted ``key-svd`` run, finished (its result file written), then its layer fit forbidden: where
    a later measurement of a finished run starts. Returns the original, the entry, the run's options and result."""
    from collab_attn.fitting.calibration import collect_calibration

    original = tiny_llama()
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: [])
    fitting = rows(count=8, length=24, seed=5)
    entry = race.Entry("key-svd", 8, 12, budget=0.5, calibration_tokens=128, fit_steps=5)
    options = {"calibration": lambda: collect_calibration(original, [{"input_ids": fitting}]),
               "calibration_rows": lambda: fitting}
    result = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, **options)
    monkeypatch.setattr(collab_attn, "fit_to_original", lambda *a, **k: pytest.fail("the layer fit was made again"))
    return original, entry, options, result


def test_sensitivity_is_measured_on_the_held_out_windows_of_a_finished_run_from_its_kept_fit(tmp_path,
                                                                                              monkeypatch):
    """``sensitivity_windows=N``: where a fitted run's KL sits, layer by layer (collab_attn.layer_sensitivity), on the
    first N held-out windows per domain, written beside the runs; a finished run is converted again for it with its
    layer fit read back (not fitted again) and its result file left as it was; the original is not measured."""
    windows = {domain: rows(count=4, length=24, seed=i) for i, domain in enumerate(heldout.DOMAINS)}
    original, entry, options, result = a_finished_fitted_run(tmp_path, monkeypatch, windows)
    written = (tmp_path / "runs" / f"{entry.name}.json").read_text()
    measured = []
    real = collab_attn.layer_sensitivity
    monkeypatch.setattr(collab_attn, "layer_sensitivity",
                        lambda model, orig, batches: measured.append(batches) or real(model, orig, batches,
                                                                                     progress=False))
    again = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, sensitivity_windows=3,
                           **options)
    assert again == result and (tmp_path / "runs" / f"{entry.name}.json").read_text() == written
    assert [torch.cat([b["input_ids"] for b in batches]).tolist() for batches in measured] == \
        [windows[domain][:3].tolist() for domain in heldout.DOMAINS]
    report = json.loads((tmp_path / "sensitivity" / f"{entry.name}.json").read_text())
    for domain in heldout.DOMAINS:
        model_kl = report[domain]["loss"]
        assert report[domain]["kind"] == "kl" and report[domain]["tokens"] == 3 * 24 and model_kl > 0
        assert [layer["name"] for layer in report[domain]["layers"]] == [f"model.layers.{i}.self_attn" for i in (0, 1)]
    assert "## wikipedia (3 held-out windows)" in (tmp_path / "sensitivity" / f"{entry.name}.md").read_text()
    race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, sensitivity_windows=3, **options)
    assert len(measured) == 2  # measured once
    race.run_entry(race.Entry("none"), original, None, windows, tmp_path, original_cache=48, sensitivity_windows=3)
    assert not (tmp_path / "sensitivity" / "original.json").exists()


def test_distillation_brings_the_converted_model_closer_to_the_original(tmp_path):
    """A tiny Llama converted to collaborative keys and shared values, distilled on its own fitting windows: the KL
    divergence from the original on those windows falls, the targets are the next tokens, the run is recorded."""
    import collab_attn

    original = tiny_llama()
    with torch.no_grad():
        original.lm_head.weight.mul_(30)  # peaked next-token distributions: a random model's are nearly uniform
    student = copy.deepcopy(original)
    collab_attn.reparametrize(student, 8, value_rank=8, progress=False)
    fitting = rows(count=64, length=16, seed=3)
    example = distill._Windows(fitting)[0]
    assert example["labels"].tolist() == [*fitting[0, 1:].tolist(), -100]
    before = heldout.agreement(student, original, fitting).kl
    run = distill.distill(student, original, fitting, tmp_path / "checkpoints", batch=4, learning_rate=1e-3,
                          checkpoint_every=None)
    after = heldout.agreement(student, original, fitting).kl
    assert after < 0.6 * before and not student.training  # measured: 1.02 -> 0.47
    assert heldout.agreement(student, original, rows(count=16, length=16, seed=9)).kl < 0.6 * before  # unseen
    assert [r["step"] for r in run.history if "loss" in r][-1] == 16  # one pass: 64 windows, 4 per step
    twice = distill.distill(copy.deepcopy(student), original, fitting[:8], tmp_path / "twice", batch=4, passes=3,
                            checkpoint_every=None)
    assert [r["step"] for r in twice.history if "loss" in r][-1] == 6  # three passes over 8 windows, 4 per step
    with pytest.raises(ValueError, match="passes=0: distil at least one pass"):
        distill.distill(student, original, fitting, tmp_path / "none", passes=0)


def test_a_distilled_run_keeps_every_weight_and_a_second_split_reads_them_back(tmp_path, monkeypatch):
    """run_entry with distill_tokens: the distilled weights (every weight the distillation moved, the MLPs too) are
    kept beside the fits, and a run of the same entry on the other split reads them back instead of distilling
    again, measuring the same model."""
    original = tiny_llama()
    windows = {domain: rows(count=3, length=16, seed=i) for i, domain in enumerate(heldout.DOMAINS)}
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: [])
    entry = race.Entry("cp", 8, 8, budget=0.5, distill_tokens=128)

    def fit_rows(tokens):
        return rows(count=tokens // 16, length=16, seed=7)

    first = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, fit_rows=fit_rows)
    kept = torch.load(race.fitted_state_path(entry, tmp_path, "distilled"), weights_only=True)
    assert any(".mlp." in key for key in kept["state"]) and kept["fit"]["tokens"] == 128 == first["training"]["tokens"]
    monkeypatch.setattr(distill, "distill", lambda *a, **k: pytest.fail("distilled again"))
    again = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, fit_rows=fit_rows,
                           split="test")
    assert again["training"] == first["training"] and again["domains"] == first["domains"]  # the same windows here


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0"], "--budgets must lie in (0, 1]"),
    (["--windows", "1"], "--windows, --length and --batch must be at least 2"),
    (["--glue-dir", "no/glue"], "--glue-dir=no/glue: no such folder"),
    (["--distill-tokens", "-5"], "--distill-tokens must be 0 (no distillation) or positive"),
    (["--calibration-tokens", "-5"], "--calibration-tokens must be 0 (no calibration) or positive"),
    (["--distill-learning-rate", "3e-4"], "--distill-learning-rate sets the rate of a distillation: give "
                                           "--distill-tokens too"),
    (["--distill-tokens", "64", "--distill-passes", "0"], "--distill-passes must be at least 1"),
    (["--distill-tokens", "64", "--distill-learning-rate", "-1"], "--distill-learning-rate must be a finite number"),
    (["--budgets", "0.5", "--distill-budgets", "0.25"], "--distill-budgets [0.25] must be among --budgets [0.5]"),
    (["--extra", "cp:96:v"], "--extra cp:96:v: give METHOD:RANK[:VALUE_RANK]"),
    (["--extra", "svd:96"], "--extra svd:96: give METHOD:RANK[:VALUE_RANK] with METHOD one of cp"),
])
def test_the_script_refuses_bad_input_in_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        script().main(["--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists()


def test_fit_targets_and_allocations_are_named_and_sized_for_what_they_do():
    from types import SimpleNamespace

    args = SimpleNamespace(
        fit_text="mixed", distill_learning_rate=1e-4, distill_passes=1,
        methods=["key-svd", "kv-svd"], budgets=[0.5], distill_budgets=[0.5], rope_pairs=4,
                           distill_tokens=0, calibration_tokens=64, calibration_sample=0, pairs_by_budget=False,
                           fit_steps=30, fit_target="residual", fit_solve_output=False, allocate=True, e2e_steps=0,
                           bands="per-layer")
    names = [entry.name for entry in script().race_entries(args, 3, 64, [])]
    assert names == ["original", "key-svd-k96-v96", "kv-svd-k168-rope_pairs4", "key-svd-k96-v96-calibrated64",
                     "kv-svd-k168-rope_pairs4-calibrated64", "key-svd-kalloc192-calibrated64",
                     "key-svd-k96-v96-calibrated64-fitted30residual",
                     "kv-svd-k168-rope_pairs4-calibrated64-fitted30residual",
                     "key-svd-kalloc192-calibrated64-fitted30residual"]
    assert race.entries_at("kv-svd", 0.5, 4, allocate=True) == []
    args.allocate, args.fit_target, args.fit_solve_output = False, "layer", True  # the output projections solved too
    assert [entry.name for entry in script().race_entries(args, 3, 64, [])][-2:] == [
        "key-svd-k96-v96-calibrated64-fitted30-ls", "kv-svd-k168-rope_pairs4-calibrated64-fitted30-ls"]


def test_an_allocated_entry_measures_its_sizes_once_and_caches_them(tmp_path, monkeypatch):
    """``alloc:B``: the layers' key and value widths from ``collab_attn.allocate_cache`` on the calibration windows,
    kept under ``allocations/`` so the fitted run of the same conversion reads them instead of measuring again; the
    run records them, caches what they say, and stays within the budget."""
    import collab_attn
    from collab_attn.fitting.calibration import collect_calibration

    config = tiny_llama().config
    config.initializer_range = 0.2
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).eval()
    windows = {domain: rows(count=2, length=24, seed=i) for i, domain in enumerate(heldout.DOMAINS)}
    windows["wikipedia 48"] = rows(count=2, length=48, seed=7)
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: ["-"] * len(race.PROMPTS))
    fitting = rows(count=8, length=24, seed=5)
    common = {"budget": 0.5, "calibration_tokens": 192}
    entry = race.Entry("key-svd", "alloc:24", **common)
    assert entry.name == "key-svd-kalloc24-calibrated192"
    measured = []
    allocate = collab_attn.allocate_cache

    def counted(*args, **kwargs):
        measured.append(len(args[3]))
        return allocate(*args, **kwargs)

    monkeypatch.setattr(collab_attn, "allocate_cache", counted)
    kwargs = {"calibration": lambda: collect_calibration(original, [{"input_ids": fitting}]),
              "calibration_rows": lambda: fitting, "allocation_steps": 3, "allocation_tokens": 96}
    run = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, batch=2, **kwargs)
    fitted = race.run_entry(dataclasses.replace(entry, fit_steps=5), original, None, windows, tmp_path,
                            original_cache=48, batch=2, **kwargs)
    assert measured == [2]  # once, on the first 96 tokens (2 batches of 2 x 24)
    allocation = run["allocation"]
    assert fitted["allocation"] == allocation and len(list((tmp_path / "allocations").glob("*.json"))) == 1
    assert run["cache_numbers"] == sum(allocation["ranks"] + allocation["value_ranks"]) / 2 <= 24
    assert set(run["domains"]) == {"wikipedia", "shakespeare", "wikipedia 48"}
    assert race.measured_domains([run]) == ["wikipedia", "shakespeare", "wikipedia 48"]
    summary = race.summary_markdown([run, fitted], "cmd", "setup")
    assert "## wikipedia 48" in summary and "kalloc24" in summary


def test_two_runs_are_compared_window_by_window(tmp_path, capsys):
    """scripts/compare_runs.py: the window bootstrap of one run against another, per domain; bad files refused."""
    from collab_attn.stats import window_bootstrap

    spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "scripts" / "compare_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    better, worse, same = fake_run("cp", 3.0), fake_run("kv-svd", 3.3), fake_run("kv-svd", 3.0)
    for name, run in (("better", better), ("worse", worse), ("same", same)):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    assert module.main([str(tmp_path / "better.json"), str(tmp_path / "worse.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    low, high = window_bootstrap(better["domains"]["wikipedia"]["windows"],
                                 worse["domains"]["wikipedia"]["windows"]).interval
    interval = f"{math.exp(-0.3):.3g}x [{1 + low:.3g}x, {1 + high:.3g}x] ahead (sample 0, 8 windows)"
    assert f"| wikipedia | {interval} | one sample | **ahead** |" in lines
    assert sum("**ahead**" in line for line in lines) == len(heldout.DOMAINS)
    module.main([str(tmp_path / "worse.json"), str(tmp_path / "better.json")])
    assert capsys.readouterr().out.count("**behind**") == len(heldout.DOMAINS)
    module.main([str(tmp_path / "same.json"), str(tmp_path / "better.json")])
    assert capsys.readouterr().out.count("| tie |") == len(heldout.DOMAINS)
    (tmp_path / "bad.json").write_text("[1, 2]")
    for argv, message in (([str(tmp_path / "no.json"), str(tmp_path / "better.json")], "no such run file"),
                          ([str(tmp_path / "bad.json"), str(tmp_path / "better.json")], "not a run file")):
        with pytest.raises(SystemExit) as exit_:
            module.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_two_conversions_are_compared_over_calibration_samples(tmp_path, capsys):
    """compare_runs.py with a pair of runs per calibration sample: the window bootstrap on the first sample, the
    t-interval over the samples beside it; runs of two conversions on one side, a sample twice or an odd count
    refused."""
    from collab_attn.stats import compare_on_shared_seeds

    spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "scripts" / "compare_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = {"cp0": fake_run("cp", 3.0), "cp1": fake_run("cp", 3.1, sample=1), "cp2": fake_run("cp", 3.05, sample=2),
            "kv0": fake_run("kv-svd", 3.3), "kv1": fake_run("kv-svd", 3.35, sample=1),
            "kv2": fake_run("kv-svd", 3.3, sample=2)}
    for name, run in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    path = {name: str(tmp_path / f"{name}.json") for name in runs}
    assert module.main([path["cp0"], path["kv0"], path["cp1"], path["kv1"], path["cp2"], path["kv2"]]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cp-k8-calibrated16 against kv-svd-k8-calibrated16:")
    low, high = compare_on_shared_seeds(*({s: math.log(runs[f"{m}{s}"]["domains"]["wikipedia"]["perplexity"])
                                           for s in range(3)} for m in ("cp", "kv"))).interval
    row = next(line for line in out.splitlines() if line.startswith("| wikipedia |"))
    assert (f"| {math.exp(-(0.3 + 0.25 + 0.25) / 3):.3g}x [{math.exp(low):.3g}x, {math.exp(high):.3g}x] ahead "
            "(geometric mean of 3 samples) | **ahead** |") in row
    assert f"| wikipedia | {math.exp(-0.3):.3g}x [" in row and "ahead (sample 0, 8 windows) |" in row
    module.main([path["cp1"], path["cp0"]])  # one run a side: by window, whatever the samples
    out = capsys.readouterr().out
    assert out.startswith("cp-k8-calibrated16s1 against cp-k8-calibrated16:")
    assert out.count("behind (samples 1 / 0, 8 windows) | one sample | **behind** |") == len(heldout.DOMAINS)
    (tmp_path / "cp0b.json").write_text(json.dumps(fake_run("cp", 3.02)))  # another run of sample 0
    for argv, message in (([path["cp0"], path["kv0"], path["kv1"], path["cp1"]], "runs of different conversions"),
                          ([path["cp0"], path["kv0"], str(tmp_path / "cp0b.json"), path["kv1"]],
                           "calibration sample [0] given twice"),
                          ([path["cp0"], path["kv0"], path["cp0"], path["kv1"]], "cp0.json are the same file"),
                          ([path["cp0"], path["kv0"], path["cp1"]], "pass them in pairs")):
        with pytest.raises(SystemExit) as exit_:
            module.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_rows_runs_only_the_rows_it_names_besides_the_original():
    import re
    from types import SimpleNamespace

    args = SimpleNamespace(
        fit_text="mixed", distill_learning_rate=1e-4, distill_passes=1,
        methods=["key-svd", "kv-svd"], budgets=[0.5, 0.25], distill_budgets=[0.5, 0.25],
                           rope_pairs=4, distill_tokens=0, calibration_tokens=64, calibration_sample=0,
                           pairs_by_budget=False, fit_steps=30, fit_target="layer", fit_solve_output=False,
                           allocate=False, e2e_steps=0, bands="per-layer")
    entries = script().race_entries(args, 3, 64, [])
    names = [e.name for e in script().rows_matching(entries, re.compile("fitted30$"))]
    assert names == ["original", "key-svd-k96-v96-calibrated64-fitted30",
                     "kv-svd-k168-rope_pairs4-calibrated64-fitted30", "key-svd-k48-v48-calibrated64-fitted30",
                     "kv-svd-k72-rope_pairs4-calibrated64-fitted30"]
    assert len(entries) == 13  # the plain and calibrated rows too, without --rows
    with pytest.raises(ValueError, match="'fitted600' matches none of this command's rows: key-svd-k96-v96, "):
        script().rows_matching(entries, re.compile("fitted600"))


def test_rows_must_be_a_regular_expression(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        script().main(["--out", str(tmp_path / "race"), "--rows", "fitted(100"])
    assert stop.value.code == 2 and "--rows 'fitted(100' is not a regular expression" in capsys.readouterr().err
    assert not (tmp_path / "race").exists()
