"""Parameter, FLOP and key/value cache accounting of concatenated vs collaborative attention, as Markdown tables.

    python scripts/accounting.py                                   # MiniLM, BERT-base and GPT-2 small sizes
    python scripts/accounting.py --preset bert-base --seq-len 512
    python scripts/accounting.py --d-model 1024 --heads 16 --layers 24 --ranks 1024 512 256 128 64
    python scripts/accounting.py --method tucker --output experiments/accounting/tucker.md
    python scripts/accounting.py --preset gpt2 --ranks 384 186 90 --value-rank 186   # keys and values shared

For each size: one layer's parameters as the number of heads changes at fixed d_model, the parameters per
component at each rank (default d, 3d/4, d/2, d/3, d/4, d/6, d/8 and head_dim), the FLOPs per token at
``--seq-len`` and the key/value cache bytes per token when the model decodes (``--dtype-bytes``, default 2).
Bad input exits with status 2 and one ``error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from collab_attn.analysis.accounting import METHODS, table
from collab_attn.cli import ArgumentParser, exit_on_bad_input, output_file, positive_arg
from collab_attn.files import write_text_atomic
from collab_attn.models.methods import METHODS as CONVERSION_METHODS
from collab_attn.models.methods import PAPER_METHOD

PRESETS = {
    "minilm": {"d_model": 384, "num_heads": 12, "num_layers": 6, "title": "MiniLM (all-MiniLM-L6-v2)"},
    "bert-base": {"d_model": 768, "num_heads": 12, "num_layers": 12, "title": "BERT-base"},
    "gpt2": {"d_model": 768, "num_heads": 12, "num_layers": 12, "title": "GPT-2 small"},
}


def parse(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS),
                        help="a model size (repeatable); default: every preset unless --d-model is given")
    parser.add_argument("--d-model", type=positive_arg, help="hidden size of a custom model (with --heads)")
    parser.add_argument("--heads", type=positive_arg, help="attention heads of the custom model")
    parser.add_argument("--layers", type=positive_arg, default=1, help="layers of the custom model (default 1)")
    parser.add_argument("--ranks", type=positive_arg, nargs="+",
                        help="shared key/query sizes D~ (default: d to head_dim)")
    parser.add_argument("--seq-len", type=positive_arg, default=128,
                        help="sequence length for the FLOPs (default 128)")
    parser.add_argument("--head-counts", type=positive_arg, nargs="+", default=[1, 2, 4, 8, 12, 16],
                        help="head counts for the fixed-d_model table (those dividing d_model are shown)")
    parser.add_argument("--method", choices=METHODS, default=PAPER_METHOD)
    parser.add_argument("--tucker-core-size", type=positive_arg, help="Tucker core size (default: heads)")
    parser.add_argument("--value-rank", type=positive_arg,
                        help="collaborative heads share one value of this width D_v too (default: per-head values)")
    parser.add_argument("--no-bias", action="store_true", help="projections without biases")
    parser.add_argument("--dtype-bytes", type=int, default=2, choices=(1, 2, 4),
                        help="bytes per cached number (2: float16/bfloat16, 4: float32)")
    parser.add_argument("--output", type=Path, help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    if (args.d_model is None) != (args.heads is None):
        parser.error("--d-model and --heads go together")
    return args


def tables(args: argparse.Namespace) -> str:
    sizes = [PRESETS[name] for name in args.preset or []]
    if args.d_model is not None:
        sizes.append({"d_model": args.d_model, "num_heads": args.heads, "num_layers": args.layers, "title": None})
    sizes = sizes or list(PRESETS.values())
    return "\n\n".join(
        table(
            size["d_model"], size["num_heads"], args.ranks, args.seq_len, num_layers=size["num_layers"],
            head_counts=args.head_counts, bias=not args.no_bias, method=args.method,
            tucker_core_size=args.tucker_core_size, title=size["title"], dtype_bytes=args.dtype_bytes,
            value_rank=args.value_rank,
        )
        for size in sizes
    )


def check(args: argparse.Namespace) -> str:
    """The tables (pure arithmetic: sizes that do not fit refuse here) and the output path, before writing."""
    if args.d_model is not None and args.d_model % args.heads:
        raise ValueError(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.value_rank is not None and not CONVERSION_METHODS[args.method].cuts_values:
        raise ValueError(f"--value-rank shares the values of collaborative heads (cp, tucker); --method {args.method} "
                         "keeps every head's values")
    if args.output is not None:
        output_file("--output", args.output)
    return tables(args)


def main(argv=None) -> None:
    args = parse(argv)
    text = exit_on_bad_input(lambda: check(args))
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.output, text + "\n")


if __name__ == "__main__":
    main()
