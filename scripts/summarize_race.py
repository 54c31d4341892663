"""Tables and plots of the conversion race at matched key/value-cache bytes (collab_attn/lm/race.py).

    python scripts/summarize_race.py                                 # experiments/kv_cache

Reads <root>/<model>/<variant>/seed*/runs/*.json (scripts/convert_lm.py with cache_fractions), writes
<root>/<model>_<variant>.png and the results part of <root>/results.md (between its markers; the rest is
kept; <root>/README.md is written by hand and links it).
Every result is read and checked first: bad input exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import sys

from collab_attn import cli
from collab_attn.lm.race import check_root, write_summary


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="experiments/kv_cache")
    args = parser.parse_args(argv)
    cli.exit_on_bad_input(lambda: check_root(args.root))
    print(f"wrote {write_summary(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
