# ckpt_lab: the two commands of the README are `make lab` and `make test`; both set everything up first.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ckpt_lab-installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
# JupyterLab refuses to start as root without --allow-root; with no display there is no browser to open.
LAB_FLAGS := $(if $(filter 0,$(shell id -u)),--allow-root) \
	$(if $(or $(DISPLAY),$(WAYLAND_DISPLAY),$(filter Darwin,$(shell uname -s))),,--no-browser)
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: setup lab test lint unit nbval notebooks bench pareto peak compat gpu-check check-dot check-python clean \
	site site-setup site-serve

LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json

## setup: a virtual environment in .venv with the pinned requirements and ckpt_lab (editable)
setup: check-dot $(STAMP) $(LAB_SETTINGS)

check-dot:
	@command -v dot >/dev/null 2>&1 || { \
	  echo "Graphviz's 'dot' program is missing: torchviz needs it to draw autograd graphs. Install it with"; \
	  echo "    sudo apt-get install graphviz      # Debian, Ubuntu"; \
	  echo "    brew install graphviz              # macOS"; \
	  echo "and run this command again."; exit 1; }

check-python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ckpt_lab needs Python >= 3.11; run: make PYTHON=/path/to/python3.11 ...")'

$(STAMP): requirements.txt pyproject.toml | check-python
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@

# JupyterLab asks every new user whether to fetch news from the internet; answer no for them.
$(LAB_SETTINGS): $(STAMP)
	@mkdir -p $(dir $@)
	@echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' > $@

## lab: set up, then open the notebooks in JupyterLab
lab: setup
	$(BIN)/jupyter trust $(NOTEBOOKS)
	$(BIN)/jupyter lab --ServerApp.root_dir=notebooks $(LAB_FLAGS)

## test: set up (the site's environment too: tests/test_site.py builds the site), then ruff, the unit
## tests and strict nbval over every notebook
test: setup site-setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests $(NOTEBOOKS) $(NBVAL)

lint: setup
	$(BIN)/ruff check .

unit: setup site-setup
	$(BIN)/python -m pytest tests

nbval: setup
	$(BIN)/python -m pytest $(NOTEBOOKS) $(NBVAL)

## notebooks: regenerate every notebook from its paired script, execute top to bottom, save with outputs
## (one notebook: make notebooks NB=02 -- any prefix of its name)
NB ?= [0-9]
notebooks: setup
	cd notebooks && for py in src/$(NB)*.py; do ../$(BIN)/jupytext --quiet --to ipynb --update --output "$$(basename "$${py%.py}").ipynb" "$$py" || exit 1; done
	CKPT_LAB_SAVE_IMAGES=1 $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.kernel_name=python3 --ExecutePreprocessor.timeout=600 notebooks/$(NB)*.ipynb

## site: the course site, HTML built from the notebooks' stored outputs (nothing is executed), into
## _site/html (git ignores _site/); STUDENT=1 builds the students' site, without the exercises'
## solutions, into _site/students. Its own pinned requirements (docs/requirements.txt) go into
## .venv-site on first use; autodoc imports ckpt_lab and torch from .venv. docs/maintainers.md: how.
SITE_VENV := .venv-site
SITE_STAMP := $(SITE_VENV)/.ckpt_lab-site-installed
SITE_OUT := _site/$(if $(STUDENT),students,html)
SITE_PORT ?= 8000
site-setup: $(SITE_STAMP)

$(SITE_STAMP): docs/requirements.txt | check-python
	$(PYTHON) -m venv $(SITE_VENV)
	$(SITE_VENV)/bin/python -m pip install --quiet -r docs/requirements.txt
	@touch $@

site: setup site-setup
	$(SITE_VENV)/bin/python -m sphinx -b html -W --keep-going -q -d _site/doctrees$(if $(STUDENT),-students) \
	  $(if $(STUDENT),-t students) docs $(SITE_OUT)
	@echo "site: $(SITE_OUT)/index.html (make site-serve$(if $(STUDENT), STUDENT=1) serves it on http://127.0.0.1:$(SITE_PORT))"

## site-serve: serve the built site on loopback only (make site first)
site-serve:
	@test -f $(SITE_OUT)/index.html || { echo "no site in $(SITE_OUT): run make site first"; exit 1; }
	$(PYTHON) -m http.server $(SITE_PORT) --bind 127.0.0.1 --directory $(SITE_OUT)

## bench: the full benchmark with torch.compile's budget rows (about 15 minutes on 2 cores); rewrites
## bench/results.json, its plots and the site's table (docs/results/generated/benchmark_table.md)
## (python -m ckpt_lab.bench [--quick] alone writes to results/, which git ignores)
bench: setup
	$(BIN)/python -m ckpt_lab.bench --refresh-site --compile

## pareto: the memory/recompute frontier with torch.compile's budget points (about 3 minutes);
## rewrites images/05_pareto.png
pareto: setup
	$(BIN)/python -m ckpt_lab.bench.pareto --refresh-site --compile

## peak: the peak sweep: the peak planner, the retained-bytes planner and torch.compile's budget on mlp-8,
## transformer-4 and GPT-2, predicted and measured peaks (about 10 minutes on 2 cores); rewrites
## images/peak_sweep.png and the site's table, docs/results/generated/peak_table.md (results/peak.json
## holds every number)
peak: setup
	$(BIN)/python -m ckpt_lab.bench.peak --refresh-site

## compat: the unit tests under another torch (make compat TORCH=2.14.1 [PYTHON=python3.12]), in a
## virtual environment outside the checkout (~/.cache/ckpt_lab/venv-torch-VERSION-pyX.Y, reused);
## not part of make test (the torch wheels are large). tools/compat.py --help for the rest.
TORCH ?=
compat: check-python
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.14.1 [PYTHON=python3.12]"; exit 2; }
	$(PYTHON) tools/compat.py --torch $(TORCH) --python $(PYTHON)

## gpu-check: on a machine with CUDA, every CUDA test and the benchmark's workloads on the GPU, into
## OUT (results/gpu-check by default): gpu_check.json and summary.txt. Without CUDA, a dry run on the
## CPU. No venv setup: runs with .venv's python if there is one, else python3 (GPU_PYTHON=... to choose).
OUT ?= results/gpu-check
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m ckpt_lab.gpu_check --out $(OUT)

clean:
	rm -rf $(VENV) $(SITE_VENV) _site
