# `make demo` and `make test` bootstrap their own environment in .venv.
PYTHON ?= python3
VENV ?= .venv
# CPU machines get the CPU build from the pin; GPU users set e.g. TORCH_SPEC="torch==2.13.0" TORCH_INDEX=<their index>.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.lightning-asyncckpt-installed
# `make demo` installs only what examples/train.py needs (the library, torch and Lightning: the demo extra);
# `make test` adds the test extra to the same venv, `make bench` the plots' matplotlib (the bench extra)
DEMO_STAMP := $(VENV)/.lightning-asyncckpt-demo-installed
BENCH_STAMP := $(VENV)/.lightning-asyncckpt-bench-installed
# the standalone Lightning distribution (pytorch-lightning, no `lightning`), for tests/test_distributions.py
PL_VENV ?= .venv-pl
PL_STAMP := $(PL_VENV)/.lightning-asyncckpt-installed
PYTEST_ARGS ?=
# the documentation site's tools, pinned (requirements/docs.txt), apart from the runtime in .venv
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.lightning-asyncckpt-installed
# `make test` runs the suite in this many pytest processes (pytest-xdist; 0: in this one). Most tests wait on
# processes they started (workers importing torch, ranks importing Lightning) with a core idle, so more
# processes than cores fill a 2-core machine: 620 s in 2 against 1036 s in one, measured in one session; on
# 2026-12-07, 740 s in 3 against 777 s in 2 (one run each).
PYTEST_WORKERS ?= 3

.PHONY: demo docs environments test fuzz test-faults test-scale test-all test-nvrx-versions test-compat bench bench-train bench-tiers bench-cluster gpu-check lint clean

$(STAMP): pyproject.toml requirements/pins.txt
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(PIP) install -q --disable-pip-version-check --index-url $(TORCH_INDEX) "$(TORCH_SPEC)")
	$(PIP) install -q --disable-pip-version-check -c requirements/pins.txt "$(TORCH_SPEC)" -e ".[test]"
	@touch $@

$(DEMO_STAMP): pyproject.toml requirements/pins.txt
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(PIP) install -q --disable-pip-version-check --index-url $(TORCH_INDEX) "$(TORCH_SPEC)")
	$(PIP) install -q --disable-pip-version-check -c requirements/pins.txt "$(TORCH_SPEC)" -e ".[demo]"
	@touch $@

$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q --disable-pip-version-check -c requirements/pins.txt "$(TORCH_SPEC)" -e ".[test,bench]"
	@touch $@

$(PL_STAMP): pyproject.toml requirements/pins.txt
	@test -x $(PL_VENV)/bin/python || $(PYTHON) -m venv $(PL_VENV)
	$(if $(TORCH_INDEX),$(PL_VENV)/bin/python -m pip install -q --disable-pip-version-check --index-url $(TORCH_INDEX) "$(TORCH_SPEC)")
	$(PL_VENV)/bin/python -m pip install -q --disable-pip-version-check -c requirements/pins.txt "$(TORCH_SPEC)" \
		pytorch-lightning nvidia-resiliency-ext isal
	$(PL_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

$(DOCS_STAMP): requirements/docs.txt
	@test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements/docs.txt
	@touch $@

# the site, into docs/_build/html: warnings are errors (a broken link, reference or include fails it), and
# the API reference imports the package from this checkout with .venv's torch and Lightning
docs: $(STAMP) $(DOCS_STAMP)
	ASYNCCKPT_RUNTIME_SITE="$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		$(DOCS_VENV)/bin/python -m sphinx -b html -W --keep-going -q -E docs docs/_build/html

demo: $(DEMO_STAMP)
	$(VENV)/bin/python examples/train.py

# both environments side by side: pip waits on unpacking and disk as much as on a core, so on 2 cores a clean
# checkout's two took 1:34 at once against 2:48 one after the other (measured once each, 2026-12-06)
environments:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(PL_STAMP)

test: environments
	$(VENV)/bin/python -m pytest -q -m "not slow and not faults and not fuzz" -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# the full corruption suite: hypothesis-generated truncations and bit flips of real checkpoints, each loaded,
# verified and inspected in a subprocess with a timeout, and real Trainer.fit(ckpt_path=...) resumes
fuzz: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m fuzz -n $(PYTEST_WORKERS) $(PYTEST_ARGS) tests/test_corruption.py

# the full fault-injection matrix: {ddp, mp} x {nvrx, mcore} x {persistent, fork} x every fault kind and rank
test-faults: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m faults $(PYTEST_ARGS)

# 4 ranks on 2 simulated nodes (own /dev/shm, TMPDIR, scratch each; needs root or user namespaces for
# `unshare --mount`, else skipped): every strategy, resharding 4 -> 2 -> 4, a failure on node 1, node 1 lost mid-save,
# and the two tiers (a lost node resumed from its peers' replicas, a corrupted replica, SIGTERM)
test-scale: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m scale $(PYTEST_ARGS)

test-all: environments
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# nvidia-resiliency-ext 0.5 to 0.7 (manylinux_2_39 only): downloaded, unpacked, run beside 0.4.1 (needs network)
test-nvrx-versions: $(STAMP)
	bash scripts/nvrx_versions.sh

# the oldest and newest supported stacks (torch, Lightning, megatron-core, Python), each in a venv cached under
# COMPAT_VENVS (default ../.compat-venvs), against a subset of the suite; about 30 minutes (needs network once)
test-compat:
	bash scripts/compat.sh

# every save variant in one run, interleaved; writes benchmarks/results/bench-<time>.{md,json} and its plots
# (bench-<time>-{stall,step,commit}.png; benchmarks/README.md says how to read them)
bench: $(BENCH_STAMP)
	$(VENV)/bin/python benchmarks/bench_save.py $(BENCH_ARGS)

# a real Trainer loop with 1 GiB of state saving every 4, 8 and 16 steps, every variant and the DCP async_save peer
# (planned for about 15 minutes on 2 idle cores; the first run took 47 on a busy machine); writes
# benchmarks/results/train-<time>.{md,json} and train-<time>-{stall,step,commit}.png
bench-train: $(BENCH_STAMP)
	$(VENV)/bin/python benchmarks/bench_train_loop.py $(BENCH_TRAIN_ARGS)

# the local tier (node-local saves replicated to a peer on another node) against the persistent one, 4 ranks on
# 2 simulated nodes: training overhead per save and recovery after a lost node (about 2 minutes on 2 cores);
# writes benchmarks/results/tiers-<time>.{md,json} and tiers-<time>-{overhead,recovery}.png
bench-tiers: $(BENCH_STAMP)
	$(VENV)/bin/python benchmarks/bench_tiers.py $(BENCH_TIERS_ARGS)

# resume at scale on an emulated cluster (root: a network namespace per node behind a tc rate limit, the shared
# storage an S3-protocol server behind its own, mounted with s3fs): resume time and bytes read from the storage,
# ours against stock's, at two NIC:storage ratios, and both tiers' targets (bench_tiers --cluster);
# writes benchmarks/results/cluster-<time>.{md,json} and tiers-<time>.{md,json}
bench-cluster: $(BENCH_STAMP)
	$(VENV)/bin/python benchmarks/bench_cluster.py $(BENCH_CLUSTER_ARGS)
	$(VENV)/bin/python benchmarks/bench_tiers.py --cluster $(BENCH_TIERS_ARGS)

# on a CUDA machine: the GPU tests and the CUDA benchmark, with the machine's own CUDA torch (see the script)
gpu-check:
	bash scripts/gpu_check.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_asyncckpt tests examples benchmarks docs

clean:
	rm -rf $(VENV) $(PL_VENV) $(DOCS_VENV) docs/_build demo_output .pytest_cache
