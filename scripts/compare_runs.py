"""Two conversions of the SmolLM2 race (``runs/<name>.json`` of scripts/race_smollm2.py) side by side: per evaluation
domain, the perplexity ratio on the first calibration sample beside the paired bootstrap over the held-out windows
both were measured on (``collab_attn.stats.window_bootstrap``) and, given a pair of runs for each of two or more
calibration samples, the geometric mean of the ratio over the samples beside the t-interval over them
(``collab_attn.stats.compare_on_shared_seeds``), with the verdict: each estimate beside its own interval.

    cd experiments/smollm2/fitted/runs
    python ../../../../scripts/compare_runs.py key-svd-k96-v96-calibrated16384-fitted600-e2e32.json \
        key-svd-k96-v96-calibrated16384-fitted600.json
    python ../../../../scripts/compare_runs.py key-svd-k96-v96-calibrated16384-fitted100.json \
        kv-svd-k168-rope_pairs4-calibrated16384-fitted100.json \
        key-svd-k96-v96-calibrated16384s1-fitted100.json kv-svd-k168-rope_pairs4-calibrated16384s1-fitted100.json

Prints a Markdown table ("ahead": the first run has the lower perplexity, by more than the interval). Bad input exits
with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from collab_attn import cli
from collab_attn.pretrained.race import comparison_markdown


def read_run(path: Path) -> dict:
    if not path.exists():
        raise cli.Missing(f"{path}: no such run file; pass two runs/<name>.json files of scripts/race_smollm2.py")
    text = cli.text_file("", path)  # a folder or a binary file: refused naming the file
    try:
        run = json.loads(text)
    except json.JSONDecodeError as err:
        raise cli.BadInput(f"{path}: not a JSON run file ({err}); pass runs/<name>.json files of "
                           "scripts/race_smollm2.py") from None
    if not isinstance(run, dict) or not {"name", "entry", "domains"} <= set(run):
        raise cli.BadInput(f"{path}: not a run file of scripts/race_smollm2.py (it needs name, entry and domains)")
    return run


def read_runs(paths: list[Path]) -> list[dict]:
    """The run files, each given once: the same file twice (or two files holding the same run) compares a run with
    itself, a tie that says nothing."""
    runs = [read_run(path) for path in paths]
    for i, (path, run) in enumerate(zip(paths, runs)):
        for other, earlier in zip(paths[:i], runs[:i]):
            if other.resolve() == path.resolve() or run == earlier:
                what = "the same file" if other.resolve() == path.resolve() else "two copies of the same run"
                raise cli.BadInput(f"{other} and {path} are {what} ({run['name']}): a run compared with itself says "
                                   "nothing; pass two different runs")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the run to judge")
    parser.add_argument("b", type=Path, help="the run it is judged against")
    parser.add_argument("more", type=Path, nargs="*", metavar="A B",
                        help="more pairs: the same two conversions calibrated on another sample")
    args = parser.parse_args(argv)
    if len(args.more) % 2:
        parser.error(f"{len(args.more) + 2} run files: pass them in pairs (a b, then a b of another calibration "
                     "sample)")
    paths = [args.a, args.b, *args.more]
    runs = cli.exit_on_bad_input(lambda: read_runs(paths))
    lines = cli.exit_on_bad_input(lambda: comparison_markdown(runs[0::2], runs[1::2]))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
