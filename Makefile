# Two commands for a fresh machine (see README): `make lab` opens the course, `make test` runs
# every test. Both create .venv and install dtlib with everything it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of PyTorch by default; on a GPU machine use e.g. `make test TORCH=torch`.
TORCH  ?= torch==2.13.0
FIRST_LESSON := notebooks/00_collectives.ipynb
# Jupyter refuses to start as root (containers, cloud notebooks) unless told so. root_dir keeps
# the whole course (notebooks/, exercises/) in the file browser; default_url makes both the
# browser it starts and the URL it prints (for a headless machine) open lesson 0.
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_ARGS ?=

.PHONY: install lab test site exercises check-exercises grade benchmarks workshop workshop-proxy clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[all]"  # the core and every extra (pyproject.toml)
	@# DeepSpeed's CPU Adam (ZeRO-Offload), compiled into ~/.cache/torch_extensions once here, as
	@# DS_BUILD_CPU_ADAM=1 does for a source install, rather than on a learner's first offload run.
	@# A build killed midway leaves torch's lock file behind, and every later build waits on it forever
	@# (torch.utils.file_baton.FileBaton polls for the file to go): one older than 30 minutes is stale.
	-find "$${TORCH_EXTENSIONS_DIR:-$$HOME/.cache/torch_extensions}" -name lock -mmin +30 -delete 2>/dev/null
	timeout 900 $(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('CPUAdamBuilder').load(verbose=False)" \
		|| echo "note: DeepSpeed's CPU Adam did not compile now; it will on first use"
	touch $@

# JupyterLab's defaults for the course, installed where it reads packages' overrides (its
# app settings' overrides.d/): no "get notified about Jupyter news?" pop-up over the plots.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.d/dtlib.json

$(LAB_OVERRIDES): lab/overrides.json
	mkdir -p $(dir $@)
	cp $< $@

lab: install $(LAB_OVERRIDES)
	$(VENV)/bin/jupyter lab $(AS_ROOT) --ServerApp.root_dir=$(CURDIR) \
		--LabApp.default_url=/lab/tree/$(FIRST_LESSON) $(LAB_ARGS)

# Every lesson and every solved exercise executed under nbval (each saved with its outputs into
# _build/executed/ for the website), then the library's tests; tests/test_site.py builds the
# website from those saved runs (as `make site` does) and opens it in headless Chromium. Two runs,
# so the notebooks are saved before the site is built; both run whatever the first's outcome.
# TEST_JOBS pytest-xdist workers, each taking whole files (--dist loadfile: a notebook's cells
# share one kernel, a module its fixtures): the suite waits on processes, sockets and timeouts
# about half the time, which a second worker fills. TEST_JOBS=0 runs everything in one process.
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -p no:cacheprovider --durations=25 -n $(TEST_JOBS) --dist loadfile
test: install
	@status=0; \
	$(PYTEST) notebooks solutions --nbval-lax --nbval-cell-timeout=120 --executed-dir=_build/executed || status=1; \
	$(PYTEST) tests || status=1; \
	exit $$status

# The course website in _site/ (docs/site.md): lessons with their outputs (from make test's run
# when newer than the lesson, else executed now), exercises, docs, API reference, search.
site: install
	$(PY) book/build.py

# Regenerate exercises/ and solutions/ from masters/ (after editing a master).
exercises: install
	$(PY) -m dtlib.grading assign

check-exercises: install
	$(PY) -m dtlib.grading check

# Grade a folder of submitted notebooks: make grade SUBMISSIONS=path/to/folder LESSON=01
# [OUT=grades.csv] [TIMEOUT=seconds per submission] [CPU_TIME=CPU seconds per submission] [JOBS=submissions at once]
grade: install
	@if [ -z "$(SUBMISSIONS)" ] || [ -z "$(LESSON)" ]; then \
	  echo "usage: make grade SUBMISSIONS=path/to/folder LESSON=01 [OUT=grades.csv] [TIMEOUT=s] [CPU_TIME=300] [JOBS=1]"; \
	  echo "  grades every file in SUBMISSIONS against masters/LESSON_*.ipynb, one CSV row each"; \
	  exit 2; fi
	$(PY) -m dtlib.grading grade "$(SUBMISSIONS)" --lesson "$(LESSON)" --out "$(or $(OUT),grades.csv)" \
	  $(if $(TIMEOUT),--timeout "$(TIMEOUT)") $(if $(CPU_TIME),--cpu-time "$(CPU_TIME)") $(if $(JOBS),--jobs "$(JOBS)")

benchmarks: install
	for b in benchmarks/bench_*.py; do $(PY) $$b --quick || exit 1; done

# The workshop server (docs/workshop.md): JupyterHub with its proxy, each learner's server in its
# own cgroups with the course in its home. State (user database, cookie secret) goes in .workshop/.
# WORKSHOP_ARGS: any JupyterHub option, e.g. --Spawner.cpu_limit=2 --JupyterHub.bind_url=http://:80
WORKSHOP_ARGS ?=
CHP := workshop/node_modules/.bin/configurable-http-proxy

workshop-proxy: $(CHP)

$(CHP): workshop/package.json workshop/package-lock.json
	npm ci --prefix workshop --no-audit --no-fund
	touch $@

workshop: install $(CHP) $(LAB_OVERRIDES)
	mkdir -p .workshop
	cd .workshop && ../$(PY) -m jupyterhub -f ../workshop/jupyterhub_config.py $(WORKSHOP_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache _build _site
