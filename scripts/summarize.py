"""Tables and plots of every pipeline's runs, one mode per pipeline.

    python scripts/summarize.py glue outputs/glue            # a GLUE sweep: summary.md/.csv/.png into outputs/glue
    python scripts/summarize.py glue experiments/minilm_glue --tasks cola,mrpc,stsb,rte --out <folder>   # these tasks
    python scripts/summarize.py glue experiments/minilm_glue --seeds 0 --out experiments/minilm_glue/seed0
    python scripts/summarize.py lm                           # experiments/shakespeare_char
    python scripts/summarize.py lm outputs/shakespeare_char
    python scripts/summarize.py race                         # experiments/kv_cache
    python scripts/summarize.py transfer experiments/transfer [--split test]

glue: a task x rank x stage table (Markdown, CSV) and a compression-vs-accuracy plot of every results.jsonl under the
folder (searched recursively); where jobs were re-fine-tuned also before_after.md, each re-fine-tuned score beside the
same job's straight after the conversion (collab_attn/glue/summary.py).
lm: tables, learning curves and samples of the Tiny Shakespeare runs (collab_attn/char_lm/runs_summary.py). Reads
<root>/<folder>/runs/*.json and <root>/<folder>/convert/runs/*.json for every folder, writes
<root>/curves_<folder>.png and the results part of <root>/results.md.
race: tables and plots of the conversion race at matched key/value-cache bytes
(collab_attn/char_lm/race_summary.py). Reads <root>/<model>/<variant>/seed*/runs/*.json (scripts/convert_lm.py with
cache_fractions), writes <root>/<model>_<variant>.png and the results part of <root>/results.md (between its
markers; the rest is kept).
transfer: the transfer matrix of a SmolLM2 race folder (scripts/race_smollm2.py --fit-text ...): each conversion's
perplexity over the original's on every held-out domain, by the text it was fitted on, and each in-domain fit against
the general ones (collab_attn/pretrained/transfer.py); writes <folder>/transfer.md (validation) or
<folder>/test/transfer.md (--split test) and prints it.

Every result is read and checked first: bad input exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402


def glue(args) -> int:
    from collab_attn.glue.summary import OUTPUTS, load_results, write
    from collab_attn.glue.tasks import get_task

    def check():
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
            return load_results(args.sweep_dir, tasks, seeds), out

    frame, out = cli.exit_on_bad_input(check)
    paths = write(frame, out)
    print(paths["markdown"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def runs(args) -> int:
    from collab_attn.char_lm import race_summary, runs_summary

    default, check, write = {
        "lm": ("experiments/shakespeare_char", runs_summary.check_results, runs_summary.write_summary),
        "race": ("experiments/kv_cache", race_summary.check_root, race_summary.write_summary),
    }[args.mode]
    root = default if args.root is None else args.root
    cli.exit_on_bad_input(lambda: check(root))
    print(f"wrote {write(root)}")
    return 0


def transfer(args, parser) -> int:
    from collab_attn.pretrained.race import load_runs, split_dir
    from collab_attn.pretrained.transfer import transfer_markdown

    folder = split_dir(args.folder, args.split)
    if not (folder / "runs").is_dir():
        parser.error(f"{folder}: no runs/ folder; pass a results folder of scripts/race_smollm2.py that holds "
                     f"{args.split} runs")
    try:
        text = transfer_markdown(load_runs(folder))
    except ValueError as error:
        parser.error(str(error))
    command = f"python scripts/summarize.py transfer {args.folder}" + (
        "" if args.split == "validation" else f" --split {args.split}")
    write_text_atomic(folder / "transfer.md", f"# Transfer matrix\n\n```bash\n{command}\n```\n\n{text}")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True, parser_class=cli.ArgumentParser)
    sweep = modes.add_parser("glue", help="a GLUE sweep (scripts/train_glue.py)")
    sweep.add_argument("sweep_dir", help="a directory holding results.jsonl files (searched recursively)")
    sweep.add_argument("--out", default=None, help="the folder to write the summary into (default: sweep_dir)")
    sweep.add_argument("--tasks", default=None,
                       help="comma-separated tasks to keep (e.g. cola,mrpc,stsb,rte); the average column is over these")
    sweep.add_argument("--seeds", default=None,
                       help="comma-separated seeds to keep (e.g. 0), to compare rows on the same seeds")
    for mode, default, what in (("lm", "experiments/shakespeare_char", "the Tiny Shakespeare runs"),
                                ("race", "experiments/kv_cache", "the cache race of scripts/convert_lm.py")):
        sub = modes.add_parser(mode, help=what)
        sub.add_argument("root", nargs="?", default=None, help=f"the folder of the runs (default: {default})")
    matrix = modes.add_parser("transfer", help="the transfer matrix of a scripts/race_smollm2.py folder")
    matrix.add_argument("folder", type=Path, help="a results folder of scripts/race_smollm2.py")
    matrix.add_argument("--split", choices=("validation", "test"), default="validation")
    args = parser.parse_args(argv)
    if args.mode == "glue":
        return glue(args)
    if args.mode == "transfer":
        return transfer(args, matrix)
    return runs(args)


if __name__ == "__main__":
    sys.exit(main())
