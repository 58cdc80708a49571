# `make demo`, `make test` and `make test-fast` (-parity, -e2e) set up .venv on first use, then run. Python 3.11+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# JAX's persistent compilation cache: repeated runs and test subprocesses reuse compiled code.
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES ?= -1

.PHONY: demo test test-fast test-parity test-e2e durations unit-times pod-presets clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-demo: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# torch==2.13.0 is the CPU build these machines carry (see setup.py's test extra). The tpu
# extra (libtpu, matching the installed jax) is what tests/test_compile.py compiles TPU
# programs with: without it those tests fail rather than skip.
$(VENV)/.installed-test: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e ".[test,tpu]"
	touch $@ $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	$(BIN)/python -m t5lite.demo --out runs/demo

# Every test (what CI runs), spread over the machine's cores: compiling is single-threaded, so
# two workers on two cores about halve the suite's time.
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests -n auto --dist loadgroup --durations=25

# The tiers (docs/development.md, "Test tiers"): every test is unit (the default), parity
# (against torch/transformers/peft) or e2e (subprocesses, long runs); `slow` marks the expensive
# ones, by hand or by measurement (tests/durations.json). The edit loop runs the unit tests that
# are not slow.
test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests -n auto --dist loadgroup -m "unit and not slow" --durations=15

test-parity: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests -n auto --dist loadgroup -m parity --durations=15

test-e2e: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests -n auto --dist loadgroup -m e2e --durations=15

# Re-measures every test into tests/durations.json (run it warm: a second time after a run);
# tests recorded over tests/helpers/durations.py's FAST_LIMIT_S leave the fast tier.
durations: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests -n auto --dist loadgroup --record-durations -q

# Re-measures, on a cold compilation cache as CI has, each unit pytest-xdist deals out (a module
# or an xdist_group) into tests/unit_times.json: the suite is dealt longest unit first
# (tests/helpers/scheduling.py). As long as `make test`.
unit-times: $(VENV)/.installed-test
	rm -rf .jax_cache_cold
	JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache_cold $(BIN)/python -m pytest tests -n auto \
	  --dist loadgroup --record-unit-times -q
	rm -rf .jax_cache_cold

# Compiles every pod preset (gin/runs/pods/*.gin) for its TPU topology on this CPU host, one
# report's JSON line each into runs/pod_presets.jsonl (about an hour on 2 cores).
pod-presets: $(VENV)/.installed-test
	mkdir -p runs && : > runs/pod_presets.jsonl
	for f in gin/runs/pods/*.gin; do \
	  echo "$$f"; echo "{\"preset\": \"$$f\", \"report\": $$($(BIN)/t5lite compile \
	    --gin_file=$$f 2>/dev/null | tail -n 1)}" >> runs/pod_presets.jsonl; \
	done

clean:
	rm -rf $(VENV) .jax_cache .jax_cache_cold .pytest_cache
