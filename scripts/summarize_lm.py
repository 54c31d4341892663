"""Tables, learning curves and samples of the Tiny Shakespeare runs (collab_attn/lm/summary.py).

    python scripts/summarize_lm.py                                   # experiments/shakespeare_char
    python scripts/summarize_lm.py outputs/shakespeare_char

Reads <root>/<folder>/runs/*.json and <root>/<folder>/convert/runs/*.json for every folder, writes
<root>/curves_<folder>.png and the results part of <root>/results.md (between its markers; the rest is
kept; <root>/README.md is written by hand and links it).
Every result is read and checked first: bad input exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import sys

from collab_attn import cli
from collab_attn.lm.summary import check_results, write_summary


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="experiments/shakespeare_char")
    args = parser.parse_args(argv)
    cli.exit_on_bad_input(lambda: check_results(args.root))
    print(f"wrote {write_summary(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
