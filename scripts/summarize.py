"""Summarize a GLUE sweep: a task x rank x stage table (Markdown, CSV) and a compression-vs-accuracy plot.

Where jobs were re-fine-tuned it also writes before_after.md: each re-fine-tuned score next to the score of the same
job straight after the conversion.

    python scripts/summarize.py outputs/glue                 # writes summary.md/.csv/.png into outputs/glue
    python scripts/summarize.py experiments/minilm_mrpc_rte --out experiments/minilm_mrpc_rte
    python scripts/summarize.py experiments/minilm_glue --tasks cola,mrpc,stsb,rte --out experiments/minilm_glue/4tasks
"""

from __future__ import annotations

import argparse
import sys

from collab_attn.glue.summary import summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="a directory holding results.jsonl files (searched recursively)")
    parser.add_argument("--out", default=None, help="where to write the summary (default: sweep_dir)")
    parser.add_argument(
        "--tasks", default=None,
        help="comma-separated tasks to keep (e.g. cola,mrpc,stsb,rte); the average column is over these",
    )
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",") if args.tasks else None
    try:
        paths = summarize(args.sweep_dir, args.out, tasks)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(paths["markdown"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
