#!/usr/bin/env bash
# Every GPU figure of docs/performance.md in one run on one GPU machine (about 9 minutes on one H200): the loss alone
# (benchmarks/loss.py), the 1.2 B and 8 B benchmarks (benchmarks/gpu_check.py) and the CUDA parity checks
# (tools/cuda_checks.py), each under its own time
# limit so one that hangs leaves the others their time. Results: $OUT (default ./gpu_out) holds one JSON and one log
# per part; gpu_check rewrites its JSON after each part, so a part stopped at its limit keeps what it measured.
#
#   tools/gpu_run.sh                 # wheels in .whl/ (e.g. transformers) are installed into /tmp/site first
#   PARTS="1b" tools/gpu_run.sh      # only some parts: loss, 1b, 8b, checks
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
PARTS=${PARTS:-"loss 1b 8b checks"}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
    | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$OUT/versions.txt" 2>&1

run() {  # run NAME SECONDS COMMAND...
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    timeout "$limit" torchrun --standalone --nproc-per-node 1 "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - started)) s" | tee -a "$OUT/times.txt"
}

for part in $PARTS; do
    case $part in
        1b) run gpu_1b 200 benchmarks/gpu_check.py --shape 1b --dir /tmp/llama_1b --out "$OUT/gpu_1b.json" \
            --load-repeats 3 --contenders "${CONTENDERS_1B:-automodel,automodel+eager,automodel+model,automodel+fused+chunk1024,transformers}" ;;
        8b) run gpu_8b 230 benchmarks/gpu_check.py --shape 8b --dir /tmp/llama_8b --out "$OUT/gpu_8b.json" \
            --load-repeats 2 --warmup 2 --steps 4 --contenders "${CONTENDERS_8B:-automodel,automodel+model,transformers}" ;;
        loss) timeout 60 python3 benchmarks/loss.py --device cuda --dtype bfloat16 --tokens 8192 --hidden 2048 \
            --chunks 1024,2048,4096,8192 --rounds 5 --out "$OUT/loss.json" > "$OUT/loss.log" 2>&1
            echo "loss: exit $?" | tee -a "$OUT/times.txt" ;;
        checks) run cuda_checks 90 tools/cuda_checks.py --out "$OUT/cuda_checks.json" \
            --only fsdp2_load_parity,sft_recipe ;;
    esac
done
