"""Write the SmolLM2 race's fitting text to a text file, for README's one-call path to fit on as the race does:
``scripts/reparametrize.py ... collab.calibration=FILE`` reads a decoder's text file as windows of 256 tokens drawn
from the whole file (``collab_attn.glue.calibrate.file_windows``).

    python scripts/write_fit_text.py /tmp/fit-all.txt                  # the three domains' fit splits, 67,584 tokens
    python scripts/write_fit_text.py /tmp/fit-code.txt --fit-text code --tokens 32768

The file holds the first windows of each named domain's fit split as the race takes them (``--length`` tokens each,
as many from each domain, interleaved: ``collab_attn.pretrained.distill.text_windows``), each window's text after its
beginning-of-text token, one window after another on new lines. Read back as windows, it holds about as many as were
written (the newline between two windows, or a token merged across a window's edge, moves the cuts). Bad input is
one ``error:`` line, exit status 2, nothing written.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.models.checkpoints import smollm2_checkpoint  # noqa: E402
from collab_attn.pretrained.distill import text_windows  # noqa: E402
from collab_attn.pretrained.heldout import FIT_DOMAINS  # noqa: E402
from collab_attn.pretrained.race import FIT_TEXTS  # noqa: E402

DOMAIN_TEXTS = [name for name, texts in FIT_TEXTS.items() if set(texts) <= set(FIT_DOMAINS)]  # no own samples


def fit_text(tokenizer, fit_text: str, tokens: int, length: int, glue_dir: Path, shakespeare: Path) -> str:
    rows = text_windows(tokenizer, glue_dir, shakespeare, length, tokens, FIT_TEXTS[fit_text])
    return "\n".join(tokenizer.decode(row[1:]) for row in rows.tolist()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the text file to write")
    parser.add_argument("--fit-text", default="all", choices=DOMAIN_TEXTS,
                        help="whose fit splits (the race's --fit-text; default: the three domains')")
    parser.add_argument("--tokens", type=int, default=67584, help="fitting tokens in all (default: 264 windows of "
                        "256, 65,536 and a margin: what collab.distill_steps=64 reads, 4 windows a step)")
    parser.add_argument("--length", type=int, default=256, help="tokens a window (default 256)")
    parser.add_argument("--glue-dir", type=Path, default=ROOT.parent / "shared" / "data" / "glue")
    parser.add_argument("--shakespeare", type=Path,
                        default=ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.length < 2:
        parser.error(f"--tokens {args.tokens} --length {args.length}: ask for at least one token, and windows of at "
                     "least 2 (the beginning-of-text token and one more)")
    if args.out.is_dir():
        parser.error(f"{args.out} is a folder: name the text file to write")

    def write() -> str:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
        text = fit_text(tokenizer, args.fit_text, args.tokens, args.length, args.glue_dir, args.shakespeare)
        write_text_atomic(args.out, text)
        return text

    text = cli.exit_on_bad_input(write)
    print(f"{args.out}: {args.fit_text}, {args.tokens:,} fitting tokens in windows of {args.length}, "
          f"{len(text):,} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
