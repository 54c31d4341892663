"""A converted decoder (a folder that ``scripts/reparametrize.py`` wrote) against its original on the held-out windows
of the SmolLM2 race (``collab_attn.pretrained.heldout``): perplexity, KL divergence and top-1 agreement per domain,
with every window's sums, into a run file that ``scripts/compare_runs.py`` reads beside the race's own.

    python scripts/evaluate_heldout.py /tmp/smollm2-kv96 --out /tmp/kv96-validation.json      # validation, 16 windows
    python scripts/evaluate_heldout.py /tmp/smollm2-kv96 --split test --out /tmp/kv96-test.json  # test, 32 windows

``--split validation`` (the default) measures wikipedia, shakespeare and code, where choices are made; ``--split
test`` those and docs, read once to report. Windows of 256 tokens, the race's. The original is the checkpoint the
conversion read (``model_path`` of its ``reparam_report.json``) unless ``--original`` names another. Bad input is one
``error:`` line, exit status 2, nothing written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.pretrained.heldout import FIT_DOMAINS, TEST_DOMAINS, agreement, evaluation_windows  # noqa: E402

WINDOWS = {"validation": 16, "test": 32}  # per domain, as the race measures
DOMAINS = {"validation": FIT_DOMAINS, "test": TEST_DOMAINS}
LENGTH = 256


def evaluate(model_dir: Path, split: str, count: int, domains: list[str], original_path: str | None, glue_dir: Path,
             shakespeare: Path) -> dict:
    """The run file of the converted model in ``model_dir`` against its original on ``count`` windows of each of
    ``domains``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import collab_attn  # noqa: F401  (registers the converted classes with the Auto classes)

    report = json.loads(cli.text_file("model_dir", model_dir / "reparam_report.json"))
    original_path = original_path or report["model_path"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = {domain: evaluation_windows(tokenizer, domain, split, LENGTH, count, glue_dir, shakespeare)
            for domain in domains}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(original_path, dtype=torch.float32).eval()
    return {"name": model_dir.name, "split": split,
            "entry": {"model": str(model_dir), "original": original_path, "collab": report["collab"]},
            "domains": {domain: agreement(model, original, windows).as_dict() for domain, windows in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="the converted model's folder (scripts/reparametrize.py's)")
    parser.add_argument("--out", type=Path, required=True, help="the run file to write (JSON)")
    parser.add_argument("--split", default="validation", choices=tuple(WINDOWS))
    parser.add_argument("--windows", type=int, help="windows a domain (default: 16 on validation, 32 on test)")
    parser.add_argument("--domains", nargs="+", choices=TEST_DOMAINS,
                        help="the domains to measure (default: wikipedia, shakespeare and code; on test, docs too)")
    parser.add_argument("--original", help="the original checkpoint (default: the report's model_path)")
    parser.add_argument("--glue-dir", type=Path, default=ROOT.parent / "shared" / "data" / "glue")
    parser.add_argument("--shakespeare", type=Path,
                        default=ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt")
    args = parser.parse_args(argv)
    count = WINDOWS[args.split] if args.windows is None else args.windows
    if count < 1:
        parser.error(f"--windows {count}: measure at least one window a domain")
    domains = args.domains or list(DOMAINS[args.split])
    if args.split != "test" and "docs" in domains:
        parser.error("--domains docs: the docs are measured on the test split only (--split test)")
    if not (args.model_dir / "reparam_report.json").is_file():
        parser.error(f"{args.model_dir}: no reparam_report.json; pass a folder that scripts/reparametrize.py wrote")
    run = cli.exit_on_bad_input(lambda: evaluate(args.model_dir, args.split, count, domains, args.original,
                                                 args.glue_dir, args.shakespeare))
    write_text_atomic(args.out, json.dumps(run, indent=2) + "\n")
    for domain, measured in run["domains"].items():
        ratio = measured["perplexity"] / measured["original_perplexity"]
        print(f"{domain}: perplexity {measured['perplexity']:.3f} ({ratio:.3f}x the original's), "
              f"KL {measured['kl']:.3f}, top-1 {measured['top1']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
