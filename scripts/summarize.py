"""Summarize a GLUE sweep: a task x rank x stage table (Markdown, CSV) and a compression-vs-accuracy plot.

Where jobs were re-fine-tuned it also writes before_after.md: each re-fine-tuned score next to the score of the same
job straight after the conversion.

    python scripts/summarize.py outputs/glue                 # writes summary.md/.csv/.png into outputs/glue
    python scripts/summarize.py experiments/minilm_mrpc_rte --out experiments/minilm_mrpc_rte
    python scripts/summarize.py experiments/minilm_glue --tasks cola,mrpc,stsb,rte --out experiments/minilm_glue/4tasks
    python scripts/summarize.py experiments/minilm_glue --seeds 0 --out experiments/minilm_glue/seed0
"""

from __future__ import annotations

import argparse
import sys

from collab_attn import cli
from collab_attn.glue.summary import OUTPUTS, load_results, write
from collab_attn.glue.tasks import get_task


def check(args: argparse.Namespace):
    """The results (every results.jsonl under sweep_dir, each line a train_glue result), the tasks and seeds kept,
    and the output folder, before anything is written; returns the rows and the output folder."""
    tasks = [task.strip() for task in args.tasks.split(",")] if args.tasks else None
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        raise cli.BadInput(f"--seeds={args.seeds!r}: give comma-separated integers, e.g. --seeds 0,1") from None
    for task in tasks or []:
        with cli.naming("--tasks", args.tasks):
            get_task(task)
    cli.input_dir("sweep_dir", args.sweep_dir)
    out = cli.output_dir("--out" if args.out else "sweep_dir", args.out or args.sweep_dir, files=OUTPUTS)
    with cli.naming("sweep_dir", args.sweep_dir):
        frame = load_results(args.sweep_dir, tasks, seeds)
    return frame, out


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="a directory holding results.jsonl files (searched recursively)")
    parser.add_argument("--out", default=None, help="the folder to write the summary into (default: sweep_dir)")
    parser.add_argument(
        "--tasks", default=None,
        help="comma-separated tasks to keep (e.g. cola,mrpc,stsb,rte); the average column is over these",
    )
    parser.add_argument("--seeds", default=None, help="comma-separated seeds to keep (e.g. 0), to compare rows on "
                        "the same seeds")
    args = parser.parse_args(argv)
    frame, out = cli.exit_on_bad_input(lambda: check(args))
    paths = write(frame, out)
    print(paths["markdown"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
