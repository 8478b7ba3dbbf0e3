# ferrovod developer commands. `make test` is what CI runs (.ci/run); `make demo` trains a
# small model on 2 processes. Everything Python lives in the virtual environment $(VENV),
# created and kept up to date by scripts/setup_venv.sh.

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
RUN := $(VENV)/bin/ferrovodrun
NP ?= 2
# Extra arguments for the benchmark, e.g. make bench BENCH_ARGS="--ops allreduce --max-size 16M"
BENCH_ARGS ?=
# cargo test profile: Cargo.toml's [profile.test] (debug, line tables only). Measured on the
# 2-core VM from an empty target dir: debug with full debug info, 38 s to build + 85 s of
# tests (line tables only take a fifth off the build's CPU: 72 against 88 core-s, side by
# side); at opt-level 1, 89 s to build + 28 s of tests; a release build (thin LTO on every
# test binary) costs more again. Use CARGO_TEST_FLAGS=--release to compare again as tests grow.
CARGO_TEST_FLAGS ?=
# Two xdist workers on the 2-core VM: the suite is bound by CPU (starting TensorFlow costs a
# process 4 s of it, torch 1.8 s), so a third worker, tried to fill the waits on Ray's and
# Spark's daemons, gained nothing: pytest 864 s with -n 3 (the cores 98 % busy) against 860-878 s
# with -n 2, one checkout, one sitting. FERROVOD_TEST_CPU_LOG=<file> records each test's CPU
# time, start and worker; scripts/test_time.py says from it where the suite's time goes.
# -rs prints why each skipped test was skipped.
PYTEST_FLAGS ?= -q -x -rs --timeout=300 -n 2 --dist loadgroup

export VENV

.PHONY: help setup build demo test test-rust test-py lint bench wheel clean

help:
	@echo "make demo    train a CNN on the digits dataset with 2 processes (sets everything up first)"
	@echo "make test    fmt, clippy, the Rust tests, pytest: what CI runs"
	@echo "make setup   create $(VENV) and build the extension into it"
	@echo "make build   rebuild the extension into $(VENV)"
	@echo "make lint    cargo fmt --check and clippy"
	@echo "make bench   collectives benchmark, side by side with torch.distributed (gloo)"
	@echo "make wheel   the manylinux abi3 wheel into dist/"
	@echo "make clean   remove build outputs and $(VENV)"

setup:
	@bash scripts/setup_venv.sh

build:
	@bash scripts/setup_venv.sh

demo: setup
	$(RUN) -np $(NP) $(PY) examples/pytorch_digits.py

# src/python/ is compiled only with the `python` feature: clippy runs with and without it.
# Its warnings fail the build only under LINT_RUSTC, the toolchain the code was last checked
# clean with. Under another one (a newer image's) they are printed, not fatal, so that a new
# lint cannot break CI; fix them and move LINT_RUSTC to make them fatal again. Cargo.toml's
# [lints] denials and clippy's deny-by-default lints fail under any toolchain. The toolchain is
# not pinned by rust-toolchain.toml: rustup would have to download one the machine lacks, and
# only the package registries are reachable here.
LINT_RUSTC ?= 1.95.0

lint:
	cargo fmt --check
	@have="$$(rustc --version | cut -d' ' -f2)"; deny=(-D warnings); \
	if [[ "$$have" != "$(LINT_RUSTC)" ]]; then \
		deny=(); \
		echo "lint: rustc $$have is not $(LINT_RUSTC), the toolchain this code is checked with:" \
			"clippy's warnings are reported, not fatal (fix them, then set LINT_RUSTC := $$have)"; \
	fi; \
	for features in "" "--features python"; do \
		echo "cargo clippy --all-targets $$features -- $${deny[*]}"; \
		cargo clippy --all-targets $$features -- "$${deny[@]}"; \
	done

# cargo-nextest (on the machines this project's CI runs on) runs the tests of every test binary
# side by side, where cargo test runs one binary's after another and waits for each one's
# slowest test: on the 2-core VM 75 s of tests against 88 s, the same 255 tests. nextest runs
# no doctests, so cargo test --doc follows it. Without nextest, cargo test runs them all.
test-rust:
	@if cargo nextest --version >/dev/null 2>&1; then \
		echo "cargo nextest run $(CARGO_TEST_FLAGS) && cargo test --doc $(CARGO_TEST_FLAGS)"; \
		cargo nextest run $(CARGO_TEST_FLAGS) && cargo test --doc $(CARGO_TEST_FLAGS); \
	else \
		echo "cargo test $(CARGO_TEST_FLAGS) (cargo-nextest is not installed)"; \
		cargo test $(CARGO_TEST_FLAGS); \
	fi

# The wheel users install is built here, with the rest of the set-up, rather than inside
# tests/python/test_wheel.py (which reuses a wheel newer than the sources): its release build
# took that test 90 s of CPU while the other worker's tests waited for a core.
test-py: setup
	@bash scripts/system_deps.sh
	@bash scripts/setup_mxnet_venv.sh
	@echo "test-py: building the wheel into dist/ for tests/python/test_wheel.py"
	@bash scripts/build_wheel.sh dist >/dev/null
	@# Where PYTHONDONTWRITEBYTECODE is set (the CI machines set it) no process writes the
	@# bytecode of the modules it imports, and each of the suite's thousand-odd processes
	@# compiled ferrovod's again: importing ferrovod.torch and the launcher's modules took
	@# 95 ms of CPU without their bytecode, 20 ms with it.
	@$(PY) -m compileall -q -j 0 python tests/python >/dev/null
	$(PY) -m pytest tests/python $(PYTEST_FLAGS)

test: setup lint test-rust test-py

bench: setup
	@$(PY) -c "import torch" 2>/dev/null || { \
		echo "bench: installing torch into $(VENV) (first time only, a few minutes)"; \
		$(PY) -m pip install --quiet torch; }
	$(RUN) -np $(NP) $(PY) benchmarks/collectives.py --compare torch $(BENCH_ARGS)

wheel:
	@bash scripts/build_wheel.sh dist

clean:
	cargo clean
	rm -rf $(VENV) dist wheelhouse bench-out .pytest_cache
	find python -name '*.so' -delete
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
