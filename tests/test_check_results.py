"""scripts/check_results.py: the numbers the results pages cite, recomputed from their run files; a page with one
number altered, one number no claim covers, or a quoted sentence gone fails with a line that says where and what."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_results.py"
spec = importlib.util.spec_from_file_location("check_results", SCRIPT)
check_results = importlib.util.module_from_spec(spec)
sys.modules["check_results"] = check_results
spec.loader.exec_module(check_results)

SMOLLM2 = "experiments/smollm2/README.md"


@pytest.fixture(scope="module")
def registry():
    return check_results.build()


def _altered(tmp_path: Path, page: str, old: str, new: str) -> Path:
    text = (ROOT / page).read_text()
    assert text.count(old) >= 1, f"{old!r} is not on {page}: the test needs a number that is there"
    path = tmp_path / Path(page).name
    path.write_text(text.replace(old, new, 1))
    return path


def test_the_committed_pages_hold(warm_python):
    """The script, as a user runs it: every claim holds on the committed pages, exit status 0."""
    done = subprocess.run([warm_python(), str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""
    assert "every number holds" in done.stderr


def test_the_claims_cover_the_pages_they_promise(registry):
    pages = {c.page for c in registry.claims}
    assert {SMOLLM2, "README.md", "docs/converting.md"} <= pages
    assert {(s.page, s.section, s.tables_only) for s in registry.strict} >= {(SMOLLM2, None, False),
                                                                                ("README.md", "Results", False)}
    assert len([c for c in registry.claims if c.page == SMOLLM2 and c.values]) >= 60


def test_one_number_altered_fails_with_where_and_what(tmp_path, registry, warm_python):
    """1.143x (SmolLM2 at 1/2 after the long recipe, wikipedia) written as 1.153x: the line says the page's number,
    the run file's and the file; the script exits 1."""
    page = _altered(tmp_path, SMOLLM2, "| `key-svd` | 1/2 | 28.8M | 1.143x / 1.019x |",
                    "| `key-svd` | 1/2 | 28.8M | 1.153x / 1.019x |")
    problems = check_results.check(registry, {SMOLLM2: page})
    assert len(problems) == 1, problems
    line = next(i for i, text in enumerate(page.read_text().splitlines(), 1) if "1.153x" in text)
    assert problems[0].startswith(f"{SMOLLM2}:{line}: 1.153 where the run files give 1.143")
    assert "key-svd-k96-v96-calibrated16384-fitted600-e2e64on65536.json" in problems[0]

    done = subprocess.run([warm_python(), str(SCRIPT), "--page", f"{SMOLLM2}={page}"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1
    assert done.stdout.strip() == problems[0]
    assert "1 problem(s)" in done.stderr


@pytest.mark.parametrize("page, old, new, said", [
    # an interval bound
    (SMOLLM2, "0.447x [0.416x, 0.481x]", "0.447x [0.416x, 0.491x]", "0.491 where the run files give 0.481"),
    # a timing
    (SMOLLM2, "41 + 211 + 257 = **510 s**", "41 + 211 + 257 = **515 s**", "515 where the run files give 510"),
    # README's results section: the rope race's interval and SmolLM2's table
    ("README.md", "(-0.0164 [-0.0272, -0.0057])", "(-0.0164 [-0.0272, -0.0047])",
     "-0.0047 where the run files give -0.0057"),
    ("README.md", "| 2.59x / 1.75x |", "| 2.69x / 1.75x |", "2.69 where the run files give 2.59"),
])
def test_other_numbers_altered_fail(tmp_path, registry, page, old, new, said):
    problems = check_results.check(registry, {page: _altered(tmp_path, page, old, new)})
    assert len(problems) == 1 and said in problems[0], problems


def test_a_number_no_claim_covers_fails(tmp_path, registry):
    """A measured-looking number added to a strict page without a claim is named, with its line."""
    page = _altered(tmp_path, SMOLLM2, "## 4. Every weight distilled",
                    "One more run reached 1.234x.\n\n## 4. Every weight distilled")
    problems = check_results.check(registry, {SMOLLM2: page})
    assert len(problems) == 1, problems
    assert "'1.234x' cites no run file" in problems[0]
    line = next(i for i, text in enumerate(page.read_text().splitlines(), 1) if "1.234x" in text)
    assert problems[0].startswith(f"{SMOLLM2}:{line}:")


def test_a_quote_gone_fails(tmp_path, registry):
    """The quote's words changed: the claim is not found, and its three numbers, left uncited, are named too."""
    page = _altered(tmp_path, "README.md", "MQA was ahead of them at 4,000 steps", "MQA led them at 4,000 steps")
    problems = check_results.check(registry, {"README.md": page})
    assert "not on the page" in problems[0]
    assert "MQA was ahead of them at 4,000 steps (-0.0219 [-0.0346, -0.0092])" in problems[0]
    assert [p.split(": ", 1)[1] for p in problems[1:]] == [
        f"{n!r} cites no run file: add a claim for it (or cited(...) with where it comes from) in "
        "scripts/result_pages/" for n in ("-0.0219", "-0.0346", "-0.0092", "-0.0088", "-0.0216", "+0.0040")]


def test_a_page_of_its_own(tmp_path):
    """The machinery on a run file and a page made here: a claim holds, an altered number fails, a bad field names
    itself, and a strict page's tables count but its code blocks do not."""
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"fit": {"seconds": 211.4}, "domains": {
        "wikipedia": {"perplexity": 54.4, "original_perplexity": 44.28},
        "shakespeare": {"perplexity": 40.2, "original_perplexity": 37.76}}}))
    page = tmp_path / "page.md"
    page.write_text("The fit took 211 s and\nreached 1.23x / 1.06x.\n\n```bash\npython run.py --lr 3e-4 0.5\n```\n\n"
                    "| row | 1.23x |\n")

    def claims():
        check_results.claim(str(page), "The fit took {:.0f} s and reached {:.2f}x / {:.2f}x.",
                            check_results.field(str(run), "fit.seconds"), check_results.ppl(str(run)))
        check_results.claim(str(page), "| row | {:.2f}x |", check_results.ppl(str(run), "wikipedia"))
        check_results.strict(str(page))
    registry = check_results.build([claims])
    assert check_results.check(registry) == []

    page.write_text(page.read_text().replace("211 s", "212 s"))
    problems = check_results.check(registry)
    assert problems == [f"{page}:1: 212 where the run files give 211 in 'The fit took 211 s and reached 1.23x / "
                        f"1.06x.' ({run})"]

    page.write_text(page.read_text().replace("212 s", "211 s") + "| other | 9.99x |\n")
    assert check_results.check(registry) == [
        f"{page}:9: '9.99x' cites no run file: add a claim for it (or cited(...) with where it comes from) in "
        "scripts/result_pages/"]

    def wrong():
        check_results.claim(str(page), "took {:.0f} s", check_results.field(str(run), "fit.cpu_seconds"))
    problems = check_results.check(check_results.build([wrong]))
    assert len(problems) == 1 and "cannot be computed (KeyError: 'cpu_seconds'" in problems[0]


def test_attention_parameters_from_the_shapes_match_the_run_files():
    """The counts the pages take from the layer shapes where no run file records one agree with every count a run
    file does record (end_to_end.parameters)."""
    recorded = {}
    for path in sorted((ROOT / "experiments/smollm2").glob("*/runs/*-calibrated16384-*e2e*.json")):
        name = json.loads(path.read_text())
        for method in ("key-svd", "cp", "tucker", "kv-svd"):
            for budget in check_results.SIZES:
                if path.name.startswith(check_results.conversion(method, budget) + "-"):
                    recorded[method, budget] = name["end_to_end"]["parameters"]
    assert len(recorded) >= 6
    for (method, budget), count in recorded.items():
        assert check_results.attention_parameters(method, budget).numbers() == [pytest.approx(count / 1e6)]


def test_the_bootstrap_is_the_one_compare_runs_prints():
    from collab_attn.pretrained.race import RESAMPLES

    assert check_results.RESAMPLES == RESAMPLES


def test_every_experiment_folder_is_indexed():
    index = (ROOT / "experiments" / "README.md").read_text()
    folders = sorted(p.name for p in (ROOT / "experiments").iterdir()  # not __pycache__ (importing job_index.py)
                     if p.is_dir() and not p.name.startswith(("_", ".")))
    assert folders and [f for f in folders if f"[`{f}/`]" not in index] == []


def test_a_missing_page_is_one_error_line(tmp_path, warm_python):
    done = subprocess.run([warm_python(), str(SCRIPT), "--page", f"README.md={tmp_path / 'none.md'}"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {tmp_path / 'none.md'}: no such page (claims cite it)"


BENCHMARKS = "experiments/benchmarks/README.md"


def test_the_benchmark_pages_are_strict(registry):
    assert {(s.page, s.section, s.tables_only) for s in registry.strict} >= {(BENCHMARKS, None, False),
                                                                                ("docs/benchmarks.md", None, False)}


@pytest.mark.parametrize("page, old, new, said", [
    # a ratio recomputed from the rounds' raw timings, and a verdict word the timing rule does not give
    (BENCHMARKS, "| 1 x 512 | 1.48x **slower** (1.39)", "| 1 x 512 | 1.46x **slower** (1.39)",
     "1.46 where the run files give 1.48"),
    (BENCHMARKS, "| 1 x 512 | 1.48x **slower** (1.39)", "| 1 x 512 | 1.48x tie (1.39)", "not on the page"),
    ("docs/benchmarks.md", "0.57x the original's time per token", "0.55x the original's time per token",
     "0.55 where the run files give 0.57"),
])
def test_the_benchmark_pages_fail_on_a_number_or_verdict_altered(tmp_path, registry, page, old, new, said):
    problems = check_results.check(registry, {page: _altered(tmp_path, page, old, new)})
    assert problems and said in problems[0], problems


def test_the_experiment_pages_are_strict_and_their_verdicts_recomputed(tmp_path, registry):
    """Issue 88's pages under the checker are strict on the whole page, and a verdict word is recomputed: the seeds'
    "tie" of activation-aware CP against the original at 128 (MiniLM, GLUE) written as "behind" fails."""
    pages = ["experiments/kv_cache/README.md", "experiments/minilm_glue/README.md",
             "experiments/minilm_mrpc_rte/README.md", "experiments/minilm_random_init/README.md",
             "experiments/accounting/README.md", "experiments/scratch_sst2/README.md"]
    assert {(p, None, False) for p in pages} <= {(s.page, s.section, s.tables_only) for s in registry.strict}
    page = "experiments/minilm_glue/README.md"
    draft = _altered(tmp_path, page, "-0.8 [-2.9, +1.3], tie", "-0.8 [-2.9, +1.3], behind")
    problems = check_results.check(registry, {page: draft})
    assert problems and all(page in p for p in problems), problems


def test_the_serving_pages_are_strict_and_a_timing_verdict_recomputed(tmp_path, registry):
    """The serving, energy, SST-2 and RTE-recipe pages are strict on the whole page, and the decode timing rule's
    "slower" of the half-cache export with a static cache written as "faster" fails."""
    pages = ["experiments/serving/README.md", "experiments/energy_minilm/README.md",
             "experiments/minilm_sst2/README.md", "experiments/minilm_rte_recipe/README.md"]
    assert {(p, None, False) for p in pages} <= {(s.page, s.section, s.tables_only) for s in registry.strict}
    draft = _altered(tmp_path, pages[0], "650 ms: 1.54x, **slower**", "650 ms: 1.54x, **faster**")
    problems = check_results.check(registry, {pages[0]: draft})
    assert problems and all(pages[0] in p for p in problems), problems


@pytest.mark.parametrize("old, new, said", [
    # a ratio of SmolLM2's long recipe, a correction's new number, and a GLUE job's stage read from results.jsonl
    ("take it to 1.129x / 1.017x", "take it to 1.139x / 1.017x", "1.139 where the run files give 1.129"),
    ("~~2-4x~~ 4.3x that", "~~2-4x~~ 4.4x that", "4.4 where the run files give 4.3"),
    ("F1 0.858 at rank 128", "F1 0.859 at rank 128", "0.859 where the run files give 0.858"),
])
def test_the_docs_pages_are_strict_and_their_numbers_recomputed(tmp_path, registry, old, new, said):
    """docs/glue.md, docs/language-modelling.md and docs/converting.md are strict on the whole page (issue 88), and an
    altered number on docs/converting.md fails."""
    pages = ["docs/glue.md", "docs/language-modelling.md", "docs/converting.md"]
    assert {(p, None, False) for p in pages} <= {(s.page, s.section, s.tables_only) for s in registry.strict}
    page = pages[2]
    problems = check_results.check(registry, {page: _altered(tmp_path, page, old, new)})
    assert len(problems) == 1 and said in problems[0], problems


def test_the_design_doc_is_strict_and_its_numbers_recomputed(tmp_path, registry):
    """docs/design.md is strict (issue 88): the attention share the end-to-end fit trains is recomputed."""
    assert ("docs/design.md", None, False) in {(s.page, s.section, s.tables_only) for s in registry.strict}
    page = "docs/design.md"
    altered = _altered(tmp_path, page, "28.8M parameters, 21% of", "28.8M parameters, 22% of")
    problems = check_results.check(registry, {page: altered})
    assert len(problems) == 1 and "22 where the run files give 21" in problems[0], problems


def test_a_verdict_a_sentence_states_is_recomputed():
    """``verdict_is``: no number, but the claim cannot be computed where the window bootstrap's verdict differs."""
    from result_pages.engine import verdict_is

    a = "experiments/smollm2/fitted/runs/key-svd-k96-v96-calibrated16384-fitted100-ls.json"
    b = "experiments/smollm2/fitted/runs/key-svd-k96-v96-calibrated16384-fitted100.json"
    assert verdict_is(a, b, "wikipedia", "behind").numbers() == []
    with pytest.raises(ValueError, match="behind, where the page says tie"):
        verdict_is(a, b, "wikipedia", "tie").numbers()
