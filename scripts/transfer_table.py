"""The transfer matrix of a SmolLM2 race folder (scripts/race_smollm2.py --fit-text ...): each conversion's perplexity
over the original's on every held-out domain, by the text it was fitted on, and each in-domain fit against the
general ones (collab_attn/pretrained/transfer.py). Writes <folder>/transfer.md (validation) or <folder>/test/transfer.md
(--split test) and prints it.

    python scripts/transfer_table.py experiments/transfer
    python scripts/transfer_table.py experiments/transfer --split test

Bad input exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a results folder of scripts/race_smollm2.py")
    parser.add_argument("--split", choices=("validation", "test"), default="validation")
    args = parser.parse_args(argv)
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
    command = "python scripts/transfer_table.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_text_atomic(folder / "transfer.md", f"# Transfer matrix\n\n```bash\n{command}\n```\n\n{text}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
