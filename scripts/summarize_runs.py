"""Tables and plots of the language-model runs, one mode per pipeline.

    python scripts/summarize_runs.py lm                                  # experiments/shakespeare_char
    python scripts/summarize_runs.py lm outputs/shakespeare_char
    python scripts/summarize_runs.py race                                # experiments/kv_cache

lm: tables, learning curves and samples of the Tiny Shakespeare runs (collab_attn/char_lm/runs_summary.py). Reads
<root>/<folder>/runs/*.json and <root>/<folder>/convert/runs/*.json for every folder, writes
<root>/curves_<folder>.png and the results part of <root>/results.md.
race: tables and plots of the conversion race at matched key/value-cache bytes
(collab_attn/char_lm/race_summary.py). Reads <root>/<model>/<variant>/seed*/runs/*.json (scripts/convert_lm.py with
cache_fractions), writes <root>/<model>_<variant>.png and the results part of <root>/results.md.

The results part of results.md lies between its markers; the rest is kept (<root>/README.md is written by hand
and links it). Every result is read and checked first: bad input exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import sys

from collab_attn import cli
from collab_attn.char_lm import race_summary, runs_summary

MODES = {  # mode: its default root, the check of every result, the writer
    "lm": ("experiments/shakespeare_char", runs_summary.check_results, runs_summary.write_summary),
    "race": ("experiments/kv_cache", race_summary.check_root, race_summary.write_summary),
}


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=list(MODES), help="lm: the Tiny Shakespeare runs; race: the cache race")
    parser.add_argument("root", nargs="?", default=None,
                        help=f"the folder of the runs (default: {', '.join(f'{m} {r[0]}' for m, r in MODES.items())})")
    args = parser.parse_args(argv)
    default_root, check, write = MODES[args.mode]
    root = default_root if args.root is None else args.root
    cli.exit_on_bad_input(lambda: check(root))
    print(f"wrote {write(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
