"""What llama.cpp's default float16 key/value cache does to a fitted SmolLM2 conversion exported as a standard Llama,
against what it does to the original, on the race's validation windows.

    python scripts/llama_cpp_half_cache.py --folder experiments/smollm2/fitted_2048 \
        --runs key-svd-k96-v96-bandsshared-calibrated16384-fitted100-e2e32on32768check4096 \
               key-svd-k48-v48-bandsshared-calibrated16384-fitted100-e2e32on32768check4096

Each run of a ``scripts/race_smollm2.py --bands shared`` folder is rebuilt from the fit the race kept
(``<folder>/checkpoints/<run>.end-to-end-fit.pt``, else ``.layer-fit.pt``: every converted attention weight and the
band split) and checked against its run file: its float32 perplexity in transformers on the same windows must be the
recorded one (to 1e-4). It is then written as the GGUF file ``collab_attn.export`` writes, and the original the same
way (float32, ``collab_attn.serving.checkpoint.source_as_standard``). llama-cpp-python evaluates every window with a
float32 cache and with a float16 one (llama.cpp's default; it also rounds the queries to float16 when it multiplies
them with float16 keys), flash attention off. Per model and domain: the perplexity with each cache, the float16
cache's perplexity against float32's (``collab_attn.stats.window_bootstrap``: a paired bootstrap over the windows),
the mean KL of the float16 cache's next-token distribution from the float32 one, and the largest logit change.
Results: ``--out`` (``.json`` and ``.md``), by default ``experiments/serving/llama_cpp_half_cache_<UTC time>``; an
existing result is never overwritten.

llama-cpp-python is not a dependency of the project: ``scripts/check_llama_cpp.sh`` installs it.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import collab_attn  # noqa: E402
from collab_attn import cli  # noqa: E402
from collab_attn.cli import ArgumentParser  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.models.checkpoints import resolve_model, smollm2_gguf  # noqa: E402
from collab_attn.pretrained.heldout import agreement, evaluation_windows, fingerprint  # noqa: E402
from collab_attn.serving import standard_model  # noqa: E402
from collab_attn.serving.checkpoint import source_as_standard  # noqa: E402
from collab_attn.serving.gguf_file import write_gguf  # noqa: E402
from collab_attn.serving.llama_cpp_engine import load_llama_cpp  # noqa: E402
from collab_attn.stats import window_bootstrap  # noqa: E402

CACHES = {"f32": 0, "f16": 1}  # GGML types
STAGES = ("end-to-end", "layer")  # the kept fits, latest first
VERDICTS = {"better": "lower", "worse": "higher", "tie": "tie"}  # the float16 cache's perplexity against float32's


def fitted(original, folder: Path, name: str):
    """The run ``name`` of ``folder`` rebuilt from its kept fit, and its run file's record."""
    record = json.loads((folder / "runs" / f"{name}.json").read_text())
    entry = record["entry"]
    if entry["options"].get("bands") != "shared":
        raise ValueError(f"{name}: converted with each layer's own bands; only a --bands shared run exports")
    checkpoint = next((folder / "checkpoints" / f"{name}.{stage}-fit.pt" for stage in STAGES
                       if (folder / "checkpoints" / f"{name}.{stage}-fit.pt").is_file()), None)
    if checkpoint is None:
        raise ValueError(f"{name}: no kept fit in {folder / 'checkpoints'}; run the race for it first")
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, entry["rank"], method=entry["method"], value_rank=entry["value_rank"],
                              progress=False, **entry["options"])
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state"]
    model.load_state_dict(state, strict=False)
    return model, record


def llama_cpp_windows(llama_cpp, path: Path, rows: dict[str, torch.Tensor], cache: str) -> dict[str, list]:
    """Per domain, each window's log-probabilities (positions x vocabulary) from llama.cpp with a ``cache``
    key/value cache; the file is loaded once."""
    length = max(windows.shape[1] for windows in rows.values())
    engine = llama_cpp.Llama(model_path=str(path), n_ctx=length, logits_all=True, verbose=False, n_threads=1,
                             n_threads_batch=1, type_k=CACHES[cache], type_v=CACHES[cache], flash_attn=False)
    out = {}
    for domain, windows in rows.items():
        out[domain] = []
        for row in windows.tolist():
            engine.reset()
            engine.eval(row)
            out[domain].append(torch.tensor(engine.scores[:len(row)]).log_softmax(-1))
    engine.close()
    return out


def measured(llama_cpp, path: Path, rows: dict[str, torch.Tensor], label: str) -> dict:
    """Per domain: both caches' perplexities and windows, the bootstrap of float16 against float32, KL and the
    largest logit change."""
    every = {cache: llama_cpp_windows(llama_cpp, path, rows, cache)
             for cache in tqdm(CACHES, desc=label, unit="cache")}
    result = {}
    for domain, windows in rows.items():
        logs = {cache: every[cache][domain] for cache in CACHES}
        sums = {cache: [] for cache in CACHES}
        kl, moved = 0.0, 0.0
        for index, row in enumerate(windows):
            target = row[1:]
            for cache in CACHES:
                nll = -float(logs[cache][index][:-1].gather(1, target[:, None]).sum())
                sums[cache].append({"tokens": len(target), "nll": nll, "fingerprint": fingerprint(row)})
            full, half = logs["f32"][index][:-1], logs["f16"][index][:-1]
            kl += float((full.exp() * (full - half)).sum())
            moved = max(moved, float((half - full).abs().max()))
        tokens = sum(w["tokens"] for w in sums["f32"])
        comparison = window_bootstrap(sums["f16"], sums["f32"])
        result[domain] = {
            "perplexity": {cache: math.exp(sum(w["nll"] for w in sums[cache]) / tokens) for cache in CACHES},
            "f16_vs_f32": {"ratio": 1 + comparison.mean_difference, "low": 1 + comparison.interval[0],
                           "high": 1 + comparison.interval[1], "verdict": VERDICTS[comparison.verdict]},
            "kl": kl / tokens, "largest_log_probability_change": moved, "windows": sums}
    return result


def markdown(result: dict, command: str) -> str:
    lines = ["# llama.cpp's float16 cache against its float32 cache: SmolLM2 and its exported conversions", "",
             "Validation windows of the race (16 of 256 tokens per domain). Each model against itself: perplexity "
             "with a float32 and a float16 cache (flash attention off), the float16 one's ratio to float32's with "
             "the paired window bootstrap (95%), the mean KL of the float16 cache's next-token distribution from the "
             "float32 one, and the largest change of a log-probability.", "", "```bash", command, "```", "",
             "| model | domain | perplexity f32 | f16 | f16 / f32 | KL (nats / token) | KL / original's | largest "
             "change |", "|---|---|---:|---:|---|---:|---:|---:|"]
    original = result["models"]["original"]
    for name, domains in result["models"].items():
        for domain, row in domains.items():
            ratio = row["f16_vs_f32"]
            lines.append(f"| {name} | {domain} | {row['perplexity']['f32']:.3f} | {row['perplexity']['f16']:.3f} | "
                         f"{ratio['ratio']:.5f} [{ratio['low']:.5f}, {ratio['high']:.5f}], {ratio['verdict']} | "
                         f"{row['kl']:.2e} | {row['kl'] / original[domain]['kl']:.1f}x | "
                         f"{row['largest_log_probability_change']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, required=True, help="a scripts/race_smollm2.py --out folder")
    parser.add_argument("--runs", nargs="+", required=True, help="run names of --bands shared runs in --folder")
    parser.add_argument("--windows", type=cli.positive_arg, default=16)
    parser.add_argument("--length", type=cli.positive_arg, default=256)
    parser.add_argument("--domains", nargs="+", default=["wikipedia", "shakespeare"])
    parser.add_argument("--glue-dir", type=Path, default=ROOT.parent / "shared" / "data" / "glue")
    parser.add_argument("--shakespeare", type=Path,
                        default=ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt")
    parser.add_argument("--out", type=Path, default=None,
                        help="a new output path without suffix (default: experiments/serving/llama_cpp_half_cache_<UTC "
                             "time>); an existing result is never overwritten")
    args = parser.parse_args(argv)
    missing = [name for name in args.runs if not (args.folder / "runs" / f"{name}.json").is_file()]
    if missing:
        parser.error(f"--runs {missing}: no such run file in {args.folder / 'runs'}")
    try:
        out = cli.result_stem("--out", args.out, ROOT / "experiments" / "serving" / "llama_cpp_half_cache",
                              (".json", ".md"))
    except cli.BadInput as error:
        parser.error(str(error))
    try:
        llama_cpp = load_llama_cpp()
    except ImportError as error:
        parser.error(str(error))
    torch.set_num_threads(1)
    folder = resolve_model("smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = {domain: evaluation_windows(tokenizer, domain, "validation", args.length, args.windows, args.glue_dir,
                                       args.shakespeare) for domain in args.domains}
    command = " ".join(["python scripts/llama_cpp_half_cache.py", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command, "llama_cpp_python": llama_cpp.__version__, "models": {}, "checks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "original.gguf"
        write_gguf(source_as_standard(original), path, smollm2_gguf())
        result["models"]["original"] = measured(llama_cpp, path, rows, "original")
        for name in args.runs:
            model, record = fitted(original, args.folder, name)
            with torch.no_grad():
                check = {domain: agreement(model, original, windows).perplexity for domain, windows in rows.items()}
            for domain, perplexity in check.items():
                recorded = record["domains"][domain]["perplexity"]
                if abs(perplexity / recorded - 1) > 1e-4:
                    raise SystemExit(f"{name}: rebuilt from its kept fit, its {domain} perplexity is {perplexity:.4f}, "
                                     f"not the recorded {recorded:.4f}: the fit and the run file disagree")
            result["checks"][name] = check
            path = Path(tmp) / f"{name}.gguf"
            write_gguf(standard_model(model), path, smollm2_gguf())
            result["models"][name] = measured(llama_cpp, path, rows, name)
    write_text_atomic(out.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    write_text_atomic(out.with_suffix(".md"), markdown(result, command))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return result


if __name__ == "__main__":
    main()
