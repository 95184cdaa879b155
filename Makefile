# Tandem: `make up` starts a local cluster on the embedded default model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TANDEM := $(VENV)/bin/tandem
MODEL ?= models/default
# Extra pip flags, e.g. PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu" for a
# CPU-only torch on a machine without a local wheel.
PIP_EXTRA ?=

.PHONY: install test up model bench clean protos

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_EXTRA) -e '.[test]'
	touch $@

model: $(MODEL)/config.json

$(MODEL)/config.json: | install
	$(TANDEM) make-model --arch llama --size tiny --seed 0 --out $(MODEL)

test: install
	$(PY) -m pytest -q -p no:cacheprovider

up: install model
	$(TANDEM) up --model $(MODEL)

protos: install
	$(PY) protos/generate.py

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
