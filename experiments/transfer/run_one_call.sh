#!/usr/bin/env bash
# Section 5 of experiments/transfer/README.md: a recipe as one command, timed by its wall clock on an otherwise idle
# machine (run nothing beside it), its times written to experiments/transfer/<folder>/timing.json: the command's wall
# seconds (date before and after) and its stages' own seconds from what it writes.
#
#   bash experiments/transfer/run_one_call.sh            # README's one-call path for SmolLM2 at half its cache, no
#                                                        # texts: the general recipe (150 layer steps, then every
#                                                        # weight distilled 32 steps, on 128 windows of own samples)
#                                                        # -> one_call/general
#   FINISH=general64 bash experiments/transfer/run_one_call.sh  # the general recipe with the layer fit on the first
#                                                        # 64 windows -> one_call/general64
#   FINISH=e2e bash experiments/transfer/run_one_call.sh # 150 layer steps, then 32 attention-only end-to-end steps
#                                                        # -> one_call
#   FINISH=texts bash experiments/transfer/run_one_call.sh  # the recipe that meets the aim at 1/2: the race on the
#                                                        # three domains' text, 150 layer steps, then every weight
#                                                        # distilled on 65,536 tokens, both cores -> one_call/texts
#   FINISH=textfile bash experiments/transfer/run_one_call.sh  # that recipe through the one-call path: the three
#                                                        # domains' text written to a file (scripts/write_fit_text.py,
#                                                        # not timed), read as windows -> one_call/textfile, then
#                                                        # measured on the race's validation and test windows (not
#                                                        # timed; scripts/evaluate_heldout.py)
#   FOLDER=one_call/general-capture bash experiments/transfer/run_one_call.sh  # the general recipe timed again, into
#                                                        # another folder (here: after the capture shortcuts of 8eaa808)
# The one-call runs copy the report to <folder>/reparam_report.json; the race writes into $OUT (a scratch folder:
# nothing kept, so every stage runs) and its run file is copied to <folder>/run.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
finish=${FINISH:-general}
out=${OUT:-/tmp/smollm2-kv96-$finish}
one_call=(python scripts/reparametrize.py model=smollm2 collab=key-svd collab.rank=96 collab.value_rank=96)
case "$finish" in
  general) folder=one_call/general command=("${one_call[@]}") ;;
  general64) folder=one_call/general64  # the same, the layer fit on the first 64 windows (the recipe until 2026-12-07)
             command=("${one_call[@]}" collab.calibration_samples=64) ;;
  e2e) folder=one_call command=("${one_call[@]}" collab.fit_steps=150 collab.e2e_steps=32) ;;
  texts) folder=one_call/texts
         command=(python scripts/race_smollm2.py --budgets 0.5 --methods key-svd --calibration-tokens 16384
                  --fit-steps 150 --threads 2 --fit-text all --distill-tokens 65536 --distill-budgets 0.5
                  --rows 'fitted150-distilled65536-textall$' --domains wikipedia shakespeare code) ;;
  textfile) folder=one_call/textfile
            command=("${one_call[@]}" collab.calibration="$out-fit.txt"
                     collab.fit_steps=150 collab.distill_steps=64) ;;
  *) echo "error: FINISH=$finish: must be general, general64, e2e, texts or textfile" >&2; exit 2 ;;
esac
folder=${FOLDER:-$folder}  # FOLDER: another folder under experiments/transfer for the same recipe (a second timing)
if [[ $finish == textfile ]]; then
  HF_HUB_OFFLINE=1 python scripts/write_fit_text.py "$out-fit.txt"
fi
if [[ $finish == texts ]]; then
  [[ -e $out ]] && { echo "error: OUT=$out exists: the race would reuse what it kept there; give a new folder" >&2
                     exit 2; }
  command+=(--out "$out")
else
  command+=(output_dir="$out" overwrite=true)
fi
start=$(date +%s)
HF_HUB_OFFLINE=1 "${command[@]}"
wall=$(( $(date +%s) - start ))
echo "wall seconds: $wall"
mkdir -p "experiments/transfer/$folder"
if [[ $finish == texts ]]; then
  cp "$out"/runs/key-svd-*.json "experiments/transfer/$folder/run.json"
else
  cp "$out/reparam_report.json" "experiments/transfer/$folder/reparam_report.json"
fi
python - "$wall" "${command[*]}" "experiments/transfer/$folder" <<'PY'
import json, os, sys
from pathlib import Path

folder = Path(sys.argv[3])
timing = {"command": sys.argv[2], "wall_seconds": int(sys.argv[1])}
if (folder / "run.json").is_file():  # the race: its run file's stages; the rest of the wall is loading and the
    run = json.loads((folder / "run.json").read_text())  # original's and the run's evaluation
    stages = {"conversion_seconds": run["convert_seconds"], "layer_fit_seconds": run["fit"]["seconds"],
              "distillation_seconds": run["training"]["seconds"]}
    timing |= {key: round(value, 1) for key, value in stages.items()}
    timing["recipe_seconds"] = round(sum(stages.values()), 1)
    source = "the others from the run file's convert_seconds, fit.seconds and training.seconds"
else:
    report = json.loads((folder / "reparam_report.json").read_text())
    sampling = report["wall_seconds"]["own_text"]  # None where the fits read a text file
    timing |= {"sampling_seconds": None if sampling is None else round(sampling, 1),
               "before_saving_seconds": round(report["wall_seconds"]["before_saving"], 1),
               "layer_fit_seconds": round(report["fit"]["seconds"], 1),
               "distillation_seconds": round(report["distillation"]["seconds"], 1)}
    source = "the others from the report's wall_seconds, fit.seconds and distillation.seconds"
timing |= {"cpus": os.cpu_count(), "machine": "the project's 2-core CPU, torch's default threads, nothing else running",
           "source": f"experiments/transfer/run_one_call.sh: wall by date before and after the command; {source}"}
path = folder / "timing.json"
path.with_suffix(".tmp").write_text(json.dumps(timing, indent=2) + "\n")
path.with_suffix(".tmp").replace(path)
PY
if [[ $finish == textfile ]]; then
  for split in validation test; do
    HF_HUB_OFFLINE=1 python scripts/evaluate_heldout.py "$out" --split "$split" \
      --out "experiments/transfer/$folder/$split.json"
  done
fi
