"""Tables, learning curves and samples of the Tiny Shakespeare runs (collab_attn/lm/summary.py).

    python scripts/summarize_lm.py                                   # experiments/shakespeare_char
    python scripts/summarize_lm.py outputs/shakespeare_char

Reads <root>/<folder>/runs/*.json and <root>/<folder>/convert/runs/*.json for every folder, writes
<root>/curves_<folder>.png and the results part of <root>/README.md (between its markers; the rest is kept).
"""

from __future__ import annotations

import argparse
import sys

from collab_attn.lm.summary import write_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="experiments/shakespeare_char")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {write_summary(args.root)}")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
