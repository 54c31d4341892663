#!/usr/bin/env bash
# Section 5 of experiments/transfer/README.md: README's one-call path for SmolLM2 at half its cache, no texts (own
# samples), timed by its wall clock on an otherwise idle machine (run nothing beside it). Its report is copied to
# experiments/transfer/<folder>/reparam_report.json and its times written to <folder>/timing.json: the command's
# wall seconds (date before and after: loading, sampling, conversion, fits, comparison, saving) and the report's own
# (wall_seconds: sampling the original's text; everything before saving).
#
#   bash experiments/transfer/run_one_call.sh            # no fitting setting: the general recipe (150 layer steps,
#                                                        # then every weight distilled 32 steps) -> one_call/general
#   FINISH=e2e bash experiments/transfer/run_one_call.sh # 150 layer steps, then 32 attention-only end-to-end steps
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/smollm2-kv96-own}
case "${FINISH:-general}" in
  general) fits=() folder=one_call/general ;;
  e2e) fits=(collab.fit_steps=150 collab.e2e_steps=32) folder=one_call ;;
  *) echo "FINISH must be general or e2e" >&2; exit 2 ;;
esac
command=(python scripts/reparametrize.py model=smollm2 collab=key-svd collab.rank=96 collab.value_rank=96
         "${fits[@]}" output_dir="$out" overwrite=true)
start=$(date +%s)
HF_HUB_OFFLINE=1 "${command[@]}"
wall=$(( $(date +%s) - start ))
echo "wall seconds: $wall"
mkdir -p "experiments/transfer/$folder"
cp "$out/reparam_report.json" "experiments/transfer/$folder/reparam_report.json"
python - "$wall" "${command[*]}" "experiments/transfer/$folder" <<'PY'
import json, os, sys
from pathlib import Path

folder = Path(sys.argv[3])
report = json.loads((folder / "reparam_report.json").read_text())
timing = {"command": sys.argv[2], "wall_seconds": int(sys.argv[1]),
          "sampling_seconds": round(report["wall_seconds"]["own_text"], 1),
          "before_saving_seconds": round(report["wall_seconds"]["before_saving"], 1),
          "cpus": os.cpu_count(), "machine": "the project's 2-core CPU, torch's default threads, nothing else running",
          "source": "experiments/transfer/run_one_call.sh: wall by date before and after the command; the others "
                    "from the report's wall_seconds"}
path = folder / "timing.json"
path.with_suffix(".tmp").write_text(json.dumps(timing, indent=2) + "\n")
path.with_suffix(".tmp").replace(path)
PY
