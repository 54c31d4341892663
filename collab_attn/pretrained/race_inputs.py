"""What scripts/race_smollm2.py checks before it works (collab_attn/cli.py: one ``error:`` line, exit status 2,
nothing written), beside the option checks in the script itself:

- ``check_arguments``: before any model is loaded: the results folder (``--out``: a folder, not a file, whose run
  files are run files), the device, the texts (``--glue-dir``, ``--shakespeare``: folders and UTF-8 files where
  they go), ``--model`` (a rotary decoder checkpoint), and the sizes no option check covers.
- ``check_fitting_text``: once the tokenizer is loaded, before the model: every block of fitting tokens the options
  ask for is in the fitting text, and the end-to-end fit's check and held-out tokens fit in what it trains on; the
  windows so made are returned for the race to use.
- ``race_identity`` and ``check_identity``: once the model is loaded, before any run is read or written: the folder
  records the model's weights and the texts it was made from (``collab_attn.identity``, ``<out>/identity.json``
  written with its first run); another model or other texts are refused, naming both. A folder made before
  identities were recorded is checked against its original's first held-out window (the same tokens, the same
  log-likelihood) and then adopted.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from collab_attn import cli
from collab_attn.identity import check_folder_identity, file_fingerprint, weights_fingerprint

FOLDERS = ("runs", "checkpoints", "sensitivity", "answers", "allocations", "test", "test/runs")
FILES = ("summary.md", "perplexity.png", "identity.json", "test/summary.md", "test/perplexity.png")
RUN_KEYS = ("name", "entry", "domains")


def text_files(glue_dir, shakespeare) -> dict[str, Path]:
    """The files the race's fitting and held-out texts are read from (``collab_attn.pretrained.heldout.texts``)."""
    glue = Path(glue_dir)
    return {"QNLI/dev.tsv": glue / "QNLI" / "dev.tsv", "RTE/train.tsv": glue / "RTE" / "train.tsv",
            "MRPC/train.tsv": glue / "MRPC" / "train.tsv", "shakespeare": Path(shakespeare)}


def check_out(out) -> Path:
    """``--out``: a folder that is (or can be made) writable, whose known parts are what they should be and whose
    run files are run files (they are all read back for the summary, after the work)."""
    folder = cli.output_dir("--out", out, files=[name for name in FILES if "/" not in name])
    for name in FOLDERS:
        if (folder / name).exists() and not (folder / name).is_dir():
            raise cli.BadInput(f"--out={out} holds a file {name} where the folder {name}/ goes: move it away, or "
                               "pass another --out")
    for name in FILES:
        if (folder / name).is_dir():
            raise cli.BadInput(f"--out={out} holds a folder {name}/ where the file {name} goes: move it away")
    for runs in (folder / "runs", folder / "test" / "runs"):
        for path in sorted(runs.glob("*.json")) if runs.is_dir() else []:
            run = cli.json_file("--out", path)
            if not isinstance(run, dict) or not set(RUN_KEYS) <= set(run):
                raise cli.BadInput(f"{path} is not a run file of scripts/race_smollm2.py (it needs "
                                   f"{', '.join(RUN_KEYS)}): move it out of {runs}, or pass another --out")
    from collab_attn.identity import read_folder_identity

    read_folder_identity(folder)
    return folder


def check_arguments(args) -> tuple[str, object]:
    """Every argument no option check of the script covers, before any model is loaded; returns the checkpoint's
    folder (or Hub id) and config."""
    from collab_attn.models.checkpoints import checked_model
    from collab_attn.models.families import family_of

    check_out(args.out)
    args.device = cli.device("--device", args.device)
    if args.threads is not None:
        cli.positive_int("--threads", args.threads)
    cli.integer("--rope-pairs", args.rope_pairs, 0)
    if args.e2e_length == 1:
        raise cli.BadInput("--e2e-length must be 0 (--length) or at least 2: a window holds the beginning-of-text "
                           "token and at least one token to predict; got 1")
    for flag, rate in (("--e2e-learning-rate", args.e2e_learning_rate),
                       ("--distill-learning-rate", args.distill_learning_rate)):
        if not (math.isfinite(rate) and rate > 0):
            raise cli.BadInput(f"{flag} must be a finite number > 0, got {rate}")
    for text in args.extra:
        if any(int(size) < 1 for size in text.split(":")[1:]):
            raise cli.BadInput(f"--extra {text}: RANK and VALUE_RANK must be positive, e.g. key-svd:192:144")
    cli.input_dir("--glue-dir", args.glue_dir)
    for name, path in text_files(args.glue_dir, args.shakespeare).items():
        cli.text_file("--shakespeare" if name == "shakespeare" else "--glue-dir", path)
    folder, config = checked_model(args.model, "--model")
    if not family_of(config).rotary:
        raise cli.BadInput(f"--model {args.model} is a {config.model_type} model: the race converts rotary decoders "
                           "(Llama, Qwen2, Mistral checkpoints)")
    check_conversions(args, config)
    return folder, config


def check_conversions(args, config) -> None:
    """The conversions the command asks for, against the model's config (on the meta device, no weights read): each
    ``--extra`` converts as given, ``--allocate`` has at least 4 numbers per token and layer to share, and the
    command has at least one conversion (a budget no method reaches leaves only the original)."""
    from collab_attn.models.conversion import check_request
    from collab_attn.pretrained.race import entries_at

    kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for text in args.extra:
        method, *sizes = text.split(":")
        try:
            check_request(config, method, int(sizes[0]), int(sizes[1]) if len(sizes) == 2 else None)
        except ValueError as err:
            raise cli.BadInput(f"--extra {text}: {cli.one_line(err)}") from None
    smallest = min(args.budgets) * 2 * kv_heads * head_dim  # numbers per token and layer
    if args.allocate and smallest < 4:
        raise cli.BadInput(f"--allocate --budgets {min(args.budgets):g}: {smallest:g} numbers per token and layer, "
                           "fewer than the 4 an allocation needs (2 for keys, 2 for values); give larger --budgets")
    sized = [e for fraction in args.budgets for method in args.methods
             for e in entries_at(method, fraction, args.rope_pairs, kv_heads, head_dim)]
    if not sized and not args.extra and not args.allocate:
        raise cli.BadInput(f"--budgets {' '.join(f'{b:g}' for b in args.budgets)}: none of --methods "
                           f"{' '.join(args.methods)} fits within them on this model ({2 * kv_heads * head_dim} "
                           "numbers per token and layer): nothing to race; give larger --budgets or other --methods")


def fitting_blocks(args) -> list[tuple[int, int]]:
    """The blocks of fitting tokens the options ask for, as (tokens, window length): what ``fit_rows`` reads."""
    blocks = []
    if args.calibration_tokens:
        blocks.append(((args.calibration_sample + 1) * args.calibration_tokens, args.length))
    if args.distill_tokens:
        blocks.append((args.distill_tokens, args.length))
    if args.e2e_steps and args.e2e_tokens:
        length = args.e2e_length or args.length
        blocks.append((args.e2e_tokens, length))
        if args.e2e_held_out_tokens and not args.e2e_held_out_text:
            blocks.append((args.e2e_tokens + args.e2e_held_out_tokens, length))
    return list(dict.fromkeys(blocks))


def check_fitting_text(args, tokenizer) -> dict[tuple[int, int], torch.Tensor]:
    """Every block of fitting tokens the options ask for, made into windows (``text_windows``) before the model is
    loaded: a fitting text too short for one is refused naming the option, and so is an end-to-end check (or
    held-out part) that the fit's own tokens cannot hold. Returns the windows by (tokens, length)."""
    from collab_attn.pretrained.distill import text_windows
    from collab_attn.pretrained.heldout import OWN_TEXTS
    from collab_attn.pretrained.race import FIT_TEXTS

    options = {}
    if args.calibration_tokens:
        options[(args.calibration_sample + 1) * args.calibration_tokens, args.length] = (
            "--calibration-tokens" + (" x (--calibration-sample + 1)" if args.calibration_sample else ""))
    if args.distill_tokens:
        options.setdefault((args.distill_tokens, args.length), "--distill-tokens")
    made = {}
    texts = FIT_TEXTS[args.fit_text]
    for tokens, length in fitting_blocks(args):
        def own(count, text, length=length):  # the original's samples are made once it is loaded: counted here
            return torch.zeros(count, length, dtype=torch.long)

        try:
            made[tokens, length] = text_windows(tokenizer, args.glue_dir, args.shakespeare, length, tokens, texts, own)
        except ValueError as err:
            option = options.get((tokens, length), "--e2e-tokens" + (" + --e2e-held-out-tokens"
                                                                      if tokens != args.e2e_tokens else ""))
            raise cli.BadInput(f"{option}: {tokens:,} fitting tokens in windows of {length}, as many from each of "
                               f"{', '.join(texts)}, are more than the fitting text holds ({err}); ask for fewer") \
                from None
    if args.calibration_tokens and args.calibration_sample:
        blocks = len(made[(args.calibration_sample + 1) * args.calibration_tokens, args.length])
        if blocks // (args.calibration_sample + 1) < 1:
            raise cli.BadInput(f"--calibration-sample {args.calibration_sample}: --calibration-tokens "
                               f"{args.calibration_tokens} make {blocks} windows of {args.length} for "
                               f"{args.calibration_sample + 1} samples, less than one each; raise --calibration-tokens")
    if args.e2e_held_out_text:
        length = args.e2e_length or args.length
        try:
            text_windows(tokenizer, args.glue_dir, args.shakespeare, length, args.e2e_held_out_tokens,
                         FIT_TEXTS[args.e2e_held_out_text])
        except ValueError as err:
            raise cli.BadInput(f"--e2e-held-out-tokens {args.e2e_held_out_tokens} of --e2e-held-out-text "
                               f"{args.e2e_held_out_text} in windows of {length}: more than its fit split holds "
                               f"({err}); ask for fewer") from None
    if args.e2e_steps:
        _check_end_to_end(args, made)
    return {} if set(texts) & set(OWN_TEXTS) else made  # the original's samples: counted here, made once loaded


def _check_end_to_end(args, made: dict) -> None:
    """The end-to-end fit's batches as ``run_entry`` makes them: its check tokens within them, its held-out tokens
    at least one window after them."""
    from collab_attn.pretrained.race import FIT_TEXTS

    if args.e2e_tokens:
        length = args.e2e_length or args.length
        windows = len(made[args.e2e_tokens, length])
        step = max(1, args.batch * args.length // args.e2e_length) if args.e2e_length else args.batch
        what = f"--e2e-tokens {args.e2e_tokens}"
    else:
        blocks = len(made[(args.calibration_sample + 1) * args.calibration_tokens, args.length])
        windows, length, step = blocks - args.calibration_sample * (blocks // (args.calibration_sample + 1)), \
            args.length, args.batch
        what = f"the calibration tokens (--calibration-tokens {args.calibration_tokens})"
    batches = -(-windows // step)
    most = batches * min(step, windows) * length
    if args.e2e_check_tokens > most:
        raise cli.BadInput(f"--e2e-check-tokens {args.e2e_check_tokens} is more than the end-to-end fit's own tokens "
                           f"hold ({what}: {windows} windows of {length}, {batches} batches of {step}): pass at most "
                           f"{most}, or 0 to measure on all of them")
    if args.e2e_tokens and args.e2e_held_out_tokens and not args.e2e_held_out_text:
        after = len(made[args.e2e_tokens + args.e2e_held_out_tokens, length]) - windows
        if after < 1:
            block = len(FIT_TEXTS[args.fit_text]) * length  # a window of every text
            least = block * -(-args.e2e_tokens // block) - args.e2e_tokens + 1
            raise cli.BadInput(f"--e2e-held-out-tokens {args.e2e_held_out_tokens} adds no window after the end-to-end "
                               f"fit's own {windows} windows of {length} (the fitting text is cut into windows, one "
                               f"from each domain at a time): pass at least {least}")


def race_identity(args, model) -> dict:
    """What a race folder records: the model as given and its weights' fingerprint, and each text file's."""
    return {"model": str(args.model), "weights": weights_fingerprint(model),
            "texts": {name: {"path": str(Path(path).expanduser().absolute()), "sha256": file_fingerprint(path)}
                      for name, path in text_files(args.glue_dir, args.shakespeare).items()}}


@torch.no_grad()
def check_identity(args, identity: dict, model, rows: dict[str, torch.Tensor]) -> bool:
    """Refuse a results folder made from another model or other texts (``collab_attn.identity``); a folder of runs
    made before identities were recorded is checked against its original's first held-out window (the same token
    ids, and the same log-likelihood of them within 1e-3) where its runs hold it. Returns whether the folder
    records its identity already."""
    import json

    from collab_attn.pretrained.heldout import fingerprint

    if check_folder_identity(args.out, identity):
        return True
    path = Path(args.out) / "runs" / "original.json"
    if not path.is_file():
        return False
    for domain, measured in json.loads(path.read_text())["domains"].items():
        first = (measured.get("windows") or [None])[0]
        if domain not in rows or first is None or first["fingerprint"] != fingerprint(rows[domain][0]):
            continue
        ids = rows[domain][:1].to(model.device)
        logp = model(ids).logits[:, :-1].double().log_softmax(-1)
        nll = float(-logp.gather(-1, ids[:, 1:, None]).sum())
        if not math.isclose(nll, first["original_nll"], rel_tol=1e-3):
            raise cli.BadInput(f"--out={args.out} holds runs of another model: its original's first {domain} window "
                               f"has log-likelihood {-first['original_nll']:.4f}, this command's --model "
                               f"{args.model!r} gives {-nll:.4f} on the same tokens: pass another --out for this model")
        break
    return False
