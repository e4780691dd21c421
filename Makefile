# The README's two commands. Each does all of its own set-up on a fresh machine.
#   make run   virtualenv, install .[all] (what serving needs), build the engine's kernels, demo models,
#              serve configs/demo.yaml (prints the demo tenant key, the admin key and the console's address)
#   make test  the same install plus .[dev] (the test tools), system packages (redis-server, chromium),
#              ruff, the whole test suite

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned: on CPU-only machines here `torch==2.13.0` resolves to the local CPU wheel. Elsewhere,
# point TORCH_INDEX at a CPU wheel index (e.g. https://download.pytorch.org/whl/cpu) to avoid CUDA wheels.
TORCH_INDEX ?=
INSTALL_KEY := $(shell cat pyproject.toml Makefile | sha1sum | cut -c1-10)
STAMP := $(VENV)/.installed-$(INSTALL_KEY)
# `make test` adds the test tools to the same virtualenv: after `make run` only these are installed
TEST_STAMP := $(VENV)/.installed-test-$(INSTALL_KEY)
# the engine's C++ CPU kernels, built once per install (never while serving) when these files change
KERNEL_FILES := $(wildcard backends/torch_llm/kernels/*.cpp) $(addprefix backends/torch_llm/kernels/,cpu_extension.py \
  build_kernels.py attention_cpu.py fused_cpu.py blocked_linear.py)
KERNELS_STAMP := $(VENV)/.kernels-built
CONFIG ?= configs/demo.yaml
# extras installed by `make install` and `make run`: what serving needs, no test tools (the image too)
EXTRAS ?= all
# extras `make test` adds
TEST_EXTRAS ?= dev
# set to 1 where a CUDA torch wheel is wanted on a machine without a GPU (building a CUDA image)
ALLOW_CUDA ?=
PORT ?= 8000

.PHONY: run test install compiler system-deps lint demo-models bench clean

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

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[$(EXTRAS),$(TEST_EXTRAS)]'
	touch $@

# built here, by the install, into the virtualenv (backends/torch_llm/kernels/cpu_extension.py): a serving
# process only loads them. Without a compiler the engine serves on its fallbacks and says how to build.
$(KERNELS_STAMP): $(STAMP) $(KERNEL_FILES) | compiler
	$(VENV)/bin/fleetgate build-kernels \
	  || echo "some CPU kernels did not build: the engine uses its fallbacks (fleetgate build-kernels retries)"
	touch $@

install: $(STAMP) $(KERNELS_STAMP)

# g++ builds the LLM engine's CPU kernels; installed with apt when missing (needs root)
compiler:
	@command -v g++ >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; } \
	    || echo "could not install g++: the engine will use its fallbacks (gather + SDPA attention, torch ops)"; \
	  else echo "g++ missing and not root: the engine will use its fallbacks (gather + SDPA attention, torch ops)"; fi; }

# redis-server backs the Redis state-store tests, chromium + chromium-driver run the admin console's
# browser tests (tests/gateway/admin/console); installed with apt when missing (needs root).
system-deps: compiler
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } \
	    || echo "could not install redis-server: Redis tests will be skipped"; \
	  else echo "redis-server missing and not root: Redis tests will be skipped"; fi; }
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ]; then { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	    || echo "could not install chromium: the console's browser tests will be skipped"; \
	  else echo "chromium or chromedriver missing and not root: the console's browser tests will be skipped"; fi; }

lint: $(TEST_STAMP)
	$(PY) -m ruff check fleetgate gateway backends router policies tests bench

test: $(TEST_STAMP) system-deps lint
	@# the install's own kernel build (a no-op when built): engines under test load, never compile
	$(VENV)/bin/fleetgate build-kernels \
	  || echo "some CPU kernels did not build: their tests are skipped, engines use the fallbacks"
	$(PY) -m pytest -q -p no:cacheprovider

models/digits.onnx models/tiny-llama/config.json &: | $(STAMP)
	$(VENV)/bin/fleetgate demo-models --out models

demo-models: models/digits.onnx models/tiny-llama/config.json

# The local demo: the tenant key is kept in var/demo-key and reused while it is valid (one key, not one
# per run); the admin key (admin API, console, /metrics) is made once into var/admin-key, unless
# FLEETGATE_ADMIN_KEY is set. Both files are mode 0600 and var/ is not committed.
run: $(STAMP) $(KERNELS_STAMP) demo-models
	@mkdir -p var
	@[ -s var/admin-key ] || (umask 077 && $(PY) -c "import secrets; print(secrets.token_urlsafe(32))" > var/admin-key)
	@key=$$($(VENV)/bin/fleetgate keys create --config $(CONFIG) --tenant demo --name make-run \
	  --secret-file var/demo-key) || exit 1; \
	export FLEETGATE_ADMIN_KEY="$${FLEETGATE_ADMIN_KEY:-$$(cat var/admin-key)}"; \
	echo; echo "demo API key:  $$key"; \
	echo "admin key:     $$FLEETGATE_ADMIN_KEY   (admin API, /metrics)"; \
	echo "console:       http://localhost:$(PORT)/admin/ui   (sign in with the admin key)"; \
	echo "metrics:       curl -s -H \"Authorization: Bearer $$FLEETGATE_ADMIN_KEY\" localhost:$(PORT)/metrics"; \
	echo "try:  curl -s -H \"Authorization: Bearer $$key\" -H 'content-type: application/json' localhost:$(PORT)/v1/models/digits:predict -d '{\"instances\": [[0,0,5,13,9,1,0,0,0,0,13,15,10,15,5,0,0,3,15,2,0,11,8,0,0,4,12,0,0,8,8,0,0,5,8,0,0,9,8,0,0,4,11,0,1,12,7,0,0,2,14,5,10,12,0,0,0,0,6,13,10,0,0,0]]}'"; \
	echo; exec $(VENV)/bin/fleetgate serve --config $(CONFIG) --port $(PORT)

# the cheap benchmarks (minutes on 2 cores; each writes its JSON and PNG under bench/results/), then every
# plot redrawn from its JSON with the date and machine written on it (bench/plots.py). The long ones (LLM
# engines, peers in their own virtualenvs, fairness traces, soak) are run one by one, by hand.
bench: $(TEST_STAMP)
	$(PY) -m bench.bench_gateway
	$(PY) -m bench.bench_limits
	$(PY) -m bench.bench_runtimes
	$(PY) -m bench.bench_http_stack
	$(PY) -m bench.plots

clean:
	rm -rf $(VENV) models var
