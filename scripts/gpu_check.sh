#!/usr/bin/env bash
# The CUDA/nccl paths of every engine in a few minutes, on a machine with a GPU.
#
# Needs a Python environment with CUDA torch 2.13, lossreduce ('.[trl]') and, for the
# verl part, verl 0.9.1 as in tests/trainer_worker/integrations/verl/requirements.txt;
# point PYTHON at it (default: .venv-verl/bin/python). Nothing is downloaded here:
# the model is a tiny Qwen2 built in code. Prints one line per check and exits
# non-zero if any check fails.
#
#   1. lossreduce train --engine torch: 1 Ray worker on the GPU, nccl process group,
#      torch.distributed normalizers, --verify against a one-process replay;
#   2. lossreduce train --engine trl: TRL on CUDA;
#   3. verl's FSDP2 engine on CUDA: stock TrainingWorker vs LossReduceTrainingWorker
#      on one mini-batch (same update in token_mean, the normalizers), and the
#      device-to-host syncs per mini-batch step of each (torch's sync debug mode);
#   4. lossreduce train --engine verl: verl's FSDP2 actor worker on the GPU (nccl), a few
#      steps, then --verify against one verl worker in the driver.
#   5. areal-loop-cuda: AReaL 1.0.4's trainer loop (grpo_launch.py under torchrun, one
#      CUDA rank, the test's CPU rollout server), LossReducePPOTrainer vs stock PPOTrainer
#      (scripts/gpu_check_areal.py); runs with AREAL_PYTHON (default
#      .venv-areal/bin/python: AReaL's environment, with CUDA torch), skipped if absent.
#   5b. areal-archon-cuda: the same loop with actor.backend=archon:d1 and Archon's own
#      flash-attention varlen kernel (which CPU lacks), SGD with clipping off,
#      LossReducePPOTrainer vs PPOTrainer (scripts/gpu_check_archon.py), same Python.
#   5c. areal-megatron-cuda: AReaL 1.0.4's MegatronPPOActor on CUDA (nccl), every mode
#      against the formulas and token_mean against stock on one GPU, and context
#      parallel 2 against one GPU where two GPUs and Transformer Engine are present
#      (scripts/gpu_check_megatron.py); runs with MEGATRON_PYTHON (default
#      .venv-megatron/bin/python), skipped if absent.
#   5d. verl-megatron-cuda: verl 0.9.1's Megatron engine on CUDA (nccl) under
#      LossReduceTrainingWorker, every mode against the formulas and token_mean against stock
#      TrainingWorker on one GPU, and context parallel 2 against one GPU where two GPUs and
#      Transformer Engine are present (scripts/gpu_check_verl_megatron.py); runs with
#      VERL_MEGATRON_PYTHON (default .venv-verl-megatron/bin/python), skipped if absent.
#   6. verl-main-ppo-cuda: verl's own main_ppo with trainer.v1.trainer_mode=lossreduce
#      (the launch of docs/frameworks/verl.md) on one CUDA rank, generation from
#      lossreduce's CPU rollout, 3 GRPO steps, one coordinator round per mini-batch
#      (scripts/gpu_check_verl_main_ppo.py).
#   7. skyrl-megatron-refused: SkyRL 0.4.0's Megatron backend, which lossreduce refuses
#      (docs/frameworks/skyrl.md, "Not done"): in an environment with skyrl[megatron]
#      (Transformer Engine, Megatron-Core, Megatron-Bridge; CUDA torch), SkyRL's Megatron
#      worker module imports (the blocker on CPU), and a launch with
#      trainer.strategy=megatron is still refused by lossreduce's check before Ray starts;
#      runs with SKYRL_MEGATRON_PYTHON (default .venv-skyrl-megatron/bin/python), skipped
#      if absent.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv-verl/bin/python}
BIN=$(dirname "$PYTHON")
OUT=${OUT:-/tmp/lossreduce-gpu-check}
mkdir -p "$OUT"
failed=0

check() {
  local name=$1
  shift
  local started=$SECONDS
  if timeout 240 "$@" >"$OUT/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - started)) s)"
  else
    echo "FAIL $name ($((SECONDS - started)) s): see $OUT/$name.log"
    tail -20 "$OUT/$name.log"
    failed=1
  fi
}

"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 2

check torch-nccl "$BIN/lossreduce" train --engine torch --workers 1 --steps 5 --verify --out "$OUT/torch"
check trl-cuda "$BIN/lossreduce" train --engine trl --workers 1 --steps 3 --out "$OUT/trl"
check verl-fsdp2-cuda "$PYTHON" scripts/gpu_check_verl.py "$OUT/verl.json"
[ -f "$OUT/verl.json" ] && cat "$OUT/verl.json"
check verl-engine-cuda "$BIN/lossreduce" train --engine verl --workers 1 --steps 3 --out "$OUT/verl-engine"
check verl-engine-verify "$BIN/lossreduce" train --engine verl --workers 1 --verify --out "$OUT/verl-verify"
check verl-main-ppo-cuda "$PYTHON" scripts/gpu_check_verl_main_ppo.py "$OUT/verl-main-ppo.json"
[ -f "$OUT/verl-main-ppo.json" ] && cat "$OUT/verl-main-ppo.json"
AREAL_PYTHON=${AREAL_PYTHON:-.venv-areal/bin/python}
if [ -x "$AREAL_PYTHON" ]; then
  check areal-loop-cuda "$AREAL_PYTHON" scripts/gpu_check_areal.py "$OUT/areal.json"
  [ -f "$OUT/areal.json" ] && cat "$OUT/areal.json"
  check areal-archon-cuda "$AREAL_PYTHON" scripts/gpu_check_archon.py "$OUT/archon.json"
  [ -f "$OUT/archon.json" ] && cat "$OUT/archon.json"
else
  echo "SKIP areal-loop-cuda: no AReaL environment at $AREAL_PYTHON"
fi
MEGATRON_PYTHON=${MEGATRON_PYTHON:-.venv-megatron/bin/python}
if [ -x "$MEGATRON_PYTHON" ]; then
  check areal-megatron-cuda "$MEGATRON_PYTHON" scripts/gpu_check_megatron.py "$OUT/megatron.json"
  [ -f "$OUT/megatron.json" ] && cat "$OUT/megatron.json"
else
  echo "SKIP areal-megatron-cuda: no Megatron environment at $MEGATRON_PYTHON"
fi
VERL_MEGATRON_PYTHON=${VERL_MEGATRON_PYTHON:-.venv-verl-megatron/bin/python}
if [ -x "$VERL_MEGATRON_PYTHON" ]; then
  check verl-megatron-cuda "$VERL_MEGATRON_PYTHON" scripts/gpu_check_verl_megatron.py "$OUT/verl-megatron.json"
  [ -f "$OUT/verl-megatron.json" ] && cat "$OUT/verl-megatron.json"
else
  echo "SKIP verl-megatron-cuda: no verl Megatron environment at $VERL_MEGATRON_PYTHON"
fi
SKYRL_MEGATRON_PYTHON=${SKYRL_MEGATRON_PYTHON:-.venv-skyrl-megatron/bin/python}
if [ -x "$SKYRL_MEGATRON_PYTHON" ]; then
  check skyrl-megatron-refused "$SKYRL_MEGATRON_PYTHON" -c '
import importlib

importlib.import_module("skyrl.backends.skyrl_train.workers.megatron.megatron_worker")
from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.skyrl.entrypoint import prepared_config

try:
    prepared_config(["trainer.strategy=megatron"])
except ReductionConfigError as err:
    assert "trainer.strategy=" in str(err), err
    print("refused:", err)
else:
    raise SystemExit("trainer.strategy=megatron was not refused")
'
else
  echo "SKIP skyrl-megatron-refused: no SkyRL Megatron environment at $SKYRL_MEGATRON_PYTHON"
fi
exit $failed
