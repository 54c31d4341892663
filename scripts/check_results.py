"""Check the numbers results pages cite from run files: recompute each, and fail on the first digit that differs.

A claim is a page, a quote and the values the quote cites. The quote is a ``str.format`` template of text on the page
(``"| 1/2 | {:.3f}x / {:.3f}x |"``): each ``{...}`` is a number, written the way the page writes it, and each value
computes that number from run files (``ppl("experiments/smollm2/fitted/runs/X.json")``: its perplexity over the
original's on both domains). The claim holds when the template, filled with the recomputed values, occurs on the page
(whitespace and line breaks count as one space). Numbers a page cites from elsewhere (an aim, a setting, a published
figure) are ``cited(page, quote, why)``: no value, but the reason is on record.

A page may also be ``strict``: every measured-looking number on it (one with a decimal point, or followed by ``x``,
``%`` or `` s``; code blocks, code spans and link targets aside) must sit inside a claim or a ``cited`` quote, on the
whole page, in its tables only, or in one section. So a number added without a claim fails too. Integers without a
unit (token counts, steps) are not measured-looking: claim them where they come from a run file.

    python scripts/check_results.py                  # every claim; one line per problem and exit status 1, else 0
    python scripts/check_results.py --list           # every claim as the page should read, with its run files
    python scripts/check_results.py --page experiments/smollm2/README.md=/tmp/draft.md   # check a draft instead

Each page's claims are a function ``claims_<name>()`` in ``scripts/result_pages/<page>.py`` that calls
``claim``/``cited``/``strict``; the checker is ``scripts/result_pages/engine.py``. Adding a page: its function, and
its name in ``PAGES`` below. Value helpers: ``ppl``, ``kl``, ``top1``, ``field``, ``boot`` (the window bootstrap of
``scripts/compare_runs.py``), ``over_samples`` (its t-interval over calibration samples), ``seeds`` and
``seed_pairs`` (seed means and paired t-intervals of the Tiny Shakespeare races), ``stage`` (a GLUE job's stage in
its ``results.jsonl``), ``verdict_is`` and ``seeds_verdict_is`` (no number: a verdict a sentence states, recomputed
over windows or over seeds), ``formula`` (anything else). A corrected number's old text, struck through (``~~old~~
new (**corrected <date>, issue <n>**)``), is ``struck(page, old, why)``; the new one is claimed as any other.
A problem line reads ``page:line: 1.153 where the run files give 1.143 in '<the quote as it should read>' (run
files)``, or names a quote not on the page, a value that cannot be computed (a run file or field not there), or a
number no claim covers. A page that is not there exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # result_pages/, beside this script

from result_pages.accounting import claims_accounting  # noqa: E402
from result_pages.benchmarks import claims_benchmarks, claims_benchmarks_doc  # noqa: E402
from result_pages.design import claims_design  # noqa: E402
from result_pages.distributed_sst2 import claims_distributed_sst2  # noqa: E402
from result_pages.docs_converting import claims_docs_converting  # noqa: E402
from result_pages.docs_glue import claims_docs_glue  # noqa: E402
from result_pages.docs_language_modelling import claims_docs_language_modelling  # noqa: E402
from result_pages.energy_minilm import claims_energy_minilm  # noqa: E402
from result_pages.engine import (  # noqa: E402,F401  (the checker's names, for tests and callers)
    RESAMPLES,
    Registry,
    Value,
    check,
    cited,
    claim,
    cli,
    field,
    formula,
    ppl,
    strict,
)
from result_pages.engine import build as build_pages  # noqa: E402
from result_pages.kv_cache import claims_kv_cache  # noqa: E402
from result_pages.minilm_glue import claims_minilm_glue  # noqa: E402
from result_pages.minilm_mrpc_rte import claims_minilm_mrpc_rte  # noqa: E402
from result_pages.minilm_random_init import claims_minilm_random_init  # noqa: E402
from result_pages.minilm_rte_recipe import claims_minilm_rte_recipe  # noqa: E402
from result_pages.minilm_sst2 import claims_minilm_sst2  # noqa: E402
from result_pages.scratch_sst2 import claims_scratch_sst2  # noqa: E402
from result_pages.serving import claims_serving  # noqa: E402
from result_pages.shakespeare import claims_shakespeare  # noqa: E402
from result_pages.smollm2 import (  # noqa: E402,F401  (SIZES, attention_parameters, conversion: for the tests)
    SIZES,
    attention_parameters,
    claims_readme,
    claims_smollm2,
    conversion,
)
from result_pages.transfer import claims_readme_transfer, claims_transfer  # noqa: E402

PAGES: list[Callable[[], None]] = [claims_smollm2, claims_readme, claims_readme_transfer, claims_transfer,
                                   claims_shakespeare, claims_benchmarks, claims_benchmarks_doc, claims_kv_cache,
                                   claims_minilm_glue, claims_minilm_mrpc_rte, claims_minilm_random_init,
                                   claims_accounting, claims_scratch_sst2, claims_serving, claims_energy_minilm,
                                   claims_minilm_sst2, claims_minilm_rte_recipe, claims_docs_glue,
                                   claims_distributed_sst2, claims_docs_language_modelling, claims_docs_converting,
                                   claims_design]


def build(pages: list[Callable[[], None]] | None = None) -> Registry:
    """A registry of the claims of ``pages`` (default: ``PAGES``), each page function called once."""
    return build_pages(PAGES if pages is None else pages)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every claim as the page should read, and exit")
    parser.add_argument("--page", action="append", default=[], metavar="PAGE=FILE",
                        help="check FILE in place of PAGE (a path from the repository root); repeatable")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.page:
        page, sep, file = item.partition("=")
        if not sep or not page or not file:
            parser.error(f"--page {item!r}: pass PAGE=FILE (e.g. experiments/smollm2/README.md=/tmp/draft.md)")
        overrides[page] = Path(file)

    registry = build()

    def work():
        if args.list:
            return [f"{c.page}: {c.render()}  <- {c.sources()}" for c in registry.claims]
        return check(registry, overrides)

    lines = cli.exit_on_bad_input(work, bad=cli.BadInput)
    for line in lines:
        print(line)
    if args.list:
        return 0
    print(f"{len(lines)} problem(s) in {len(registry.claims)} claims" if lines else
          f"{len(registry.claims)} claims checked: every number holds", file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
