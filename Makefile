# Quick start on a fresh machine with Python >= 3.10 and make:
#   make demo   generate synthetic universes, train CosmoFlow on 4 CPU ranks (data x spatial hybrid)
#   make test   run the test suite
#   make reconstruct   the second science task: a 3D U-Net reconstructs initial density fields (4 CPU ranks)
# Everything installs into .venv. TORCH selects the torch wheel (default: the CPU build 2.13.0).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
APP_STAMP := $(VENV)/.installed-app
DEMO_DATA ?= data/demo-s0.5
DEMO_RANKS ?= 4
DEMO_RUN ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

RECON_DATA ?= data/reconstruct
RECON_RUN ?= runs/reconstruct-$(shell date +%Y%m%d-%H%M%S)
RECON_TRAIN ?= 512
RECON_VAL ?= 32

.PHONY: venv test demo demo-data reconstruct reconstruct-data volume-study volume-study-gpu lint clean gpu-check perf-tiny

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test,mpi]"
	touch $(STAMP)

$(APP_STAMP): $(STAMP)
	$(PIP) install -q -e ".[test,mpi,app]"
	touch $(APP_STAMP)

# Two test files at a time (pytest-xdist, whole files: their process groups are shared within a file):
# the end-to-end tests leave a core idle while one rank starts or waits. TEST_WORKERS=0 runs them in turn.
# Bytecode is written (__pycache__, ignored by git) even where the environment says not to: the suite
# starts a few hundred interpreters, each of which would compile the project's modules again (~1 s).
TEST_WORKERS ?= 2
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# 640 + 160 synthetic 64^3 universes (~0.05 s each; smoothing 0.5 Mpc/h, no linear field: the demo regresses); files already there are kept.
demo-data: $(STAMP)
	$(PY) -m cosmoflow.generate --out $(DEMO_DATA)/train --universes 640 --size 64 --seed 1 --smoothing 0.5 \
		--workers 2 --no-linear
	$(PY) -m cosmoflow.generate --out $(DEMO_DATA)/val --universes 160 --size 64 --seed 2 --smoothing 0.5 \
		--workers 2 --no-linear

demo: $(APP_STAMP) demo-data
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(DEMO_RANKS) launch/train.py \
		--config launch/configs/demo.yaml --set data.train=$(DEMO_DATA)/train --set data.val=$(DEMO_DATA)/val \
		--set run_dir=$(DEMO_RUN)

# 64^3 universes with their initial fields; files already there are kept.
reconstruct-data: $(STAMP)
	$(PY) -m cosmoflow.generate --out $(RECON_DATA)/train --universes $(RECON_TRAIN) --size 64 --seed 11 --smoothing 1 --workers 2
	$(PY) -m cosmoflow.generate --out $(RECON_DATA)/val --universes $(RECON_VAL) --size 64 --seed 12 --smoothing 1 --workers 2

# Trains, prints r(k) per shell against the input's, and keeps the result in perf/results/.
reconstruct: $(APP_STAMP) reconstruct-data
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 4 launch/train.py \
		--config launch/configs/reconstruct.yaml --set data.train=$(RECON_DATA)/train \
		--set data.val=$(RECON_DATA)/val --set run_dir=$(RECON_RUN)
	cp $(RECON_RUN)/reconstruction.json perf/results/reconstruction.json

# The GPU suite with the python at hand (a GPU image has its own torch and no package registry; nothing
# is installed): the CUDA tests, then the accelerator benchmarks in order of value, within GPU_BUDGET
# seconds (what would not fit is skipped, with its reason). Writes GPU_OUT/gpu_check.{md,json} and the
# tests' log. `python -m perf gpu_check --dry-run --budget N` prints the plan; perf/README.md has more.
GPU_BUDGET ?= 480
GPU_OUT ?= perf/results/gpu
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m perf gpu_check --budget $(GPU_BUDGET) --out $(GPU_OUT)

# Benchmarks (perf/README.md): make perf-NAME [ARGS="--rounds 1"] runs `python -m perf NAME`, which
# writes to a scratch folder (ARGS="--record": into perf/results/); make perf-list names them; make
# perf-tiny runs every one at its tiny size (what the tests do).
perf-tiny: $(STAMP)
	$(PY) -m pytest -q tests/test_perf_suite.py

perf-%: $(STAMP)
	$(PY) -m perf $* $(ARGS)

# The volume study: the same 64^3 universes (2 Mpc/h voxels) trained on as 16^3 crops, 32^3 crops and whole
# (2 ranks), 2 seeds each, and the no-network reference; universes and finished runs are reused. About 75 min on
# 2 cores; writes perf/results/volume_study.{json,md} (and _mae.png, _curves.png with matplotlib).
VOLUME_CONFIG ?= launch/configs/volume_study.yaml
volume-study: $(APP_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m cosmoflow.experiments.volume --config $(VOLUME_CONFIG)

# The volume study on a GPU host (its own python and torch, no package registry): the 128^3 study
# (volume_study_128.yaml) with its ranks sharing the GPU, then universes of 256^3 (64^3, 128^3 crops, whole 256^3 over 4 ranks).
# Writes perf/results/volume_study_gpu{,256}.{json,md}. Like gpu-check it installs nothing: h5py, PyYAML
# and numpy are in a CUDA image, and nvtx is optional (hybridpar/profiling/ranges.py).
volume-study-gpu:
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) $(PYTHON) -m cosmoflow.experiments.volume --config launch/configs/volume_study_gpu.yaml
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) $(PYTHON) -m cosmoflow.experiments.volume --config launch/configs/volume_study_gpu256.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check hybridpar cosmoflow launch tests perf

clean:
	rm -rf $(VENV) build *.egg-info
