# The README's two commands. Each does all of its own set-up on a fresh machine.
#   make run   virtualenv, install, demo models, serve configs/demo.yaml (prints a demo key + curl line)
#   make test  virtualenv, install .[all,dev], system packages (redis-server), ruff, the whole test suite

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned: on CPU-only machines here `torch==2.13.0` resolves to the local CPU wheel. Elsewhere,
# point TORCH_INDEX at a CPU wheel index (e.g. https://download.pytorch.org/whl/cpu) to avoid CUDA wheels.
TORCH_INDEX ?=
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-10)
CONFIG ?= configs/demo.yaml
# extras installed by `make install` (the container image uses EXTRAS=all: no test tools)
EXTRAS ?= all,dev
# set to 1 where a CUDA torch wheel is wanted on a machine without a GPU (building a CUDA image)
ALLOW_CUDA ?=
PORT ?= 8000

.PHONY: run test install system-deps lint demo-models bench clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e '.[$(EXTRAS)]'
	@$(PY) -c "import torch, sys; gpu = __import__('shutil').which('nvidia-smi') or '$(ALLOW_CUDA)'; \
	  sys.exit('CUDA torch wheel on a machine without a GPU: set TORCH_INDEX' if torch.version.cuda and not gpu else 0)"
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

# redis-server backs the Redis state-store tests, g++ builds the LLM engine's CPU attention kernel,
# chromium + chromium-driver run the admin console's browser tests (tests/console); installed with apt
# when missing (needs root).
system-deps:
	@command -v g++ >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; } \
	    || echo "could not install g++: the engine will use gather + SDPA attention"; \
	  else echo "g++ missing and not root: the engine will use gather + SDPA attention"; fi; }
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } \
	    || echo "could not install redis-server: Redis tests will be skipped"; \
	  else echo "redis-server missing and not root: Redis tests will be skipped"; fi; }
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ]; then { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	    || echo "could not install chromium: the console's browser tests will be skipped"; \
	  else echo "chromium or chromedriver missing and not root: the console's browser tests will be skipped"; fi; }

lint: $(STAMP)
	$(PY) -m ruff check fleetgate gateway backends router policies tests bench

test: $(STAMP) system-deps lint
	@# builds the LLM engine's CPU kernels once, here, so no test pays the build in its timeout
	$(PY) -c "from backends.torch_llm.attention_cpu import load_kernel; load_kernel()" \
	  || echo "the CPU attention kernel did not build: engines fall back to gather + SDPA"
	$(PY) -c "from backends.torch_llm.fused_cpu import load_kernels; load_kernels()" \
	  || echo "the fused CPU kernels did not build: engines keep torch's elementwise ops"
	$(PY) -c "from backends.torch_llm.blocked_linear import load_kernel; load_kernel()" \
	  || echo "the blocked linear kernel did not build: engines use oneDNN's linears"
	$(PY) -m pytest -q -p no:cacheprovider

models/digits.onnx models/tiny-llama/config.json &: | $(STAMP)
	$(VENV)/bin/fleetgate demo-models --out models

demo-models: models/digits.onnx models/tiny-llama/config.json

run: $(STAMP) demo-models
	@mkdir -p var
	@key=$$($(VENV)/bin/fleetgate keys create --config $(CONFIG) --tenant demo --name make-run) || exit 1; \
	echo; echo "demo API key: $$key"; \
	echo "try:  curl -s -H \"Authorization: Bearer $$key\" -H 'content-type: application/json' localhost:$(PORT)/v1/models/digits:predict -d '{\"instances\": [[0,0,5,13,9,1,0,0,0,0,13,15,10,15,5,0,0,3,15,2,0,11,8,0,0,4,12,0,0,8,8,0,0,5,8,0,0,9,8,0,0,4,11,0,1,12,7,0,0,2,14,5,10,12,0,0,0,0,6,13,10,0,0,0]]}'"; \
	echo; exec $(VENV)/bin/fleetgate serve --config $(CONFIG) --port $(PORT)

# the cheap benchmarks (minutes on 2 cores; each writes its JSON and PNG under bench/results/), then every
# plot redrawn from its JSON with the date and machine written on it (bench/plots.py). The long ones (LLM
# engines, peers in their own virtualenvs, fairness traces, soak) are run one by one, by hand.
bench: $(STAMP)
	$(PY) bench/bench_gateway.py
	$(PY) bench/bench_limits.py
	$(PY) bench/bench_runtimes.py
	$(PY) bench/bench_http_stack.py
	$(PY) bench/plots.py

clean:
	rm -rf $(VENV) models var
