# specshim: two commands matter. `make demo` runs the main job on a tiny model
# the tool builds itself; `make test` runs every test tier. Both create .venv.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
STAMP  := $(VENV)/.specshim-setup
PYTEST_ARGS ?=

.PHONY: setup test test-extended test-unit test-e2e test-gpu test-export test-matrix bench bench-extract bench-gpu bench-reuse bench-transport bench-writer demo doctor lint clean

setup: $(STAMP)

# Re-runs only when the pinned stack or the package metadata changes.
$(STAMP): pyproject.toml requirements/cpu-stack.txt requirements/overrides.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(UV) || { $(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip; \
		$(PY) -m pip install -q uv; }
	$(UV) pip install --python $(PY) --index-strategy unsafe-best-match \
		-r requirements/cpu-stack.txt --override requirements/overrides.txt -e .
	$(PY) -c "import specshim, sys; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
	touch $@

# Every tier but the cases marked `extended` (siblings of cases it runs; CI's
# minutes): `make test-extended` runs those. JOBS pytest processes take a test
# file each (a reference generator each: tests/conftest.py), as most of a test
# is one core's start-up; JOBS=1 runs every test in this one process.
JOBS ?= 2
XDIST := $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadgroup)
test: setup
	$(PY) -m pytest -m "not extended" $(XDIST) $(PYTEST_ARGS)

test-extended: setup
	$(PY) -m pytest -m extended $(XDIST) $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit tests/contract $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest tests/e2e $(XDIST) $(PYTEST_ARGS)

# The GPU tier (tests/gpu) on vLLM's CUDA build, in .venv-gpu; needs an NVIDIA
# GPU and the registries. It unsets nothing for you: run it as a user would,
# without VLLM_WORKER_MULTIPROC_METHOD, VLLM_USE_V2_MODEL_RUNNER or
# PYTORCH_NVML_BASED_CUDA_CHECK (it refuses to run under them). On a host
# that reaches no registry, run `python3 -m tests.gpu.tier` in the bundle
# of ../shared/gpu/README.md instead. Two pytest processes share the GPU
# (tests/gpu/tier.py; `PYTEST_ARGS=...` passes through, `--jobs 1` serialises).
GPU_VENV := .venv-gpu
test-gpu:
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q uv
	$(GPU_VENV)/bin/uv pip install --python $(GPU_VENV)/bin/python \
		-r requirements/gpu-stack.txt -e .
	$(GPU_VENV)/bin/python -m tests.gpu.tier -p timeout --timeout 900 $(PYTEST_ARGS)

# `specshim export` read by the newest speculators' own dataset class: a peer
# environment (.venv-export, requirements/export-peer.txt) runs the reader,
# .venv runs the extract and the export. ~4 min; not in `make test`.
EXPORT_VENV := .venv-export
test-export: setup
	test -x $(EXPORT_VENV)/bin/python || $(UV) venv -q --python $(PY) $(EXPORT_VENV)
	$(UV) pip install -q --python $(EXPORT_VENV)/bin/python --index-strategy unsafe-best-match \
		-r requirements/export-peer.txt -e .
	SPECSHIM_EXPORT_PYTHON=$(EXPORT_VENV)/bin/python VLLM_CPU_KVCACHE_SPACE=1 \
		$(PY) -m pytest tests/export -ra $(PYTEST_ARGS)

# One environment per vLLM release (.venv-vllm<ver>): every release specshim
# calls tested (specshim._versions.TESTED_VLLM), or VERSIONS=0.11.0,0.16.0 for
# a subset. Writes matrix/results/ and the table of docs/compatibility.md.
VERSIONS ?=
MATRIX_ARGS ?= --write-table docs/compatibility.md
test-matrix: setup
	$(PY) matrix/run.py --jobs $(JOBS) $(if $(VERSIONS),--versions $(VERSIONS)) $(MATRIX_ARGS)

# Side-by-side benchmark (specshim vs speculators 0.4.0.1 vs HF), the step-budget
# sweep and the goals; writes benchmarks/results/ and the results table of
# docs/performance.md, then make bench-reuse's three data sets. ~70 min.
BENCH_ARGS ?= --write-table docs/performance.md
bench: setup
	$(UV) pip install -q --python $(PY) -r requirements/bench.txt
	$(PY) benchmarks/run.py $(BENCH_ARGS)
	$(PY) benchmarks/reuse_bench.py $(BENCH_REUSE_ARGS)

# extract --reuse-prefixes against extract without it, on three data sets (a
# shared 1,024-token system prompt, 4 responses per prompt, nothing shared):
# samples/s both ways and the files compared; part of make bench; writes
# benchmarks/results/reuse.{json,md}. ~15 min on 2 cores.
BENCH_REUSE_ARGS ?=
bench-reuse: setup
	$(PY) benchmarks/reuse_bench.py $(BENCH_REUSE_ARGS)

# extract end to end vs bare generate() (2,000 samples, tiny DeepSeek-V3), and
# time to first generate() and peak RSS on 10k- and 200k-line datasets; writes
# benchmarks/results/extract.{json,md}. ~25 min on 2 cores.
BENCH_EXTRACT_ARGS ?=
bench-extract: setup
	$(PY) benchmarks/extract_bench.py $(BENCH_EXTRACT_ARGS)

# On a host with an NVIDIA GPU: vLLM's own prefill, its native extraction,
# bare generate() (vLLM's runner and V1) and extract on one model, and the
# output disk, in one run; writes benchmarks/results/gpu.{json,md}. MODEL is
# llama-1b, llama-8b or deepseek-v3-moe; each fits one 10-minute call on the
# lent H200 after the bundle is installed (../shared/gpu/README.md: there run
# `python3 benchmarks/gpu_bench.py --model MODEL`). One line and exit 2 where
# no CUDA device exists. BENCH_GPU_ARGS="--parts reuse" runs make
# bench-reuse's three data sets on MODEL's checkpoint instead.
MODEL ?= llama-1b
BENCH_GPU_ARGS ?=
GPU_PYTHON ?= $(firstword $(wildcard $(GPU_VENV)/bin/python $(PY)) $(PYTHON))
bench-gpu:
	$(GPU_PYTHON) benchmarks/gpu_bench.py --model $(MODEL) $(BENCH_GPU_ARGS)

# extract's writer alone, from states in memory, against a plain write of the
# same bytes on the same disk (and torch.save's bytes written in fewer calls);
# writes benchmarks/results/writer.{json,md}. ~1 min; on the lent H200 run
# `python3 benchmarks/writer_bench.py` in the installed bundle.
BENCH_WRITER_ARGS ?=
bench-writer: setup
	$(PY) benchmarks/writer_bench.py $(BENCH_WRITER_ARGS)

# The CPU proxy of the GPU figures: one call's states from a worker process to
# the main one, pickled (speculators' path) and through state-transport's
# shared region; writes benchmarks/results/transport.json. ~1 min.
bench-transport: setup
	$(PY) benchmarks/transport_bench.py

demo: setup
	$(VENV)/bin/specshim demo

doctor: setup
	$(VENV)/bin/specshim doctor

lint: setup
	$(VENV)/bin/ruff check src tests matrix benchmarks
	$(VENV)/bin/ruff format --check src tests matrix benchmarks

clean:
	rm -rf $(VENV) $(GPU_VENV) $(EXPORT_VENV) .venv-vllm* .venv-bench-* .pytest_cache matrix/results/*.log benchmarks/.cache
