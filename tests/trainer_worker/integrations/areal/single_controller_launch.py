"""GRPO on AReaL with lossreduce's normalizers, in AReaL's default single-controller mode.

``python single_controller_launch.py --config single_controller.yaml``: an AReaL launch
script with one import changed, as ``grpo_launch.py``, but with the workflow named by
import path, as single-controller mode needs: the workflow runs on the rollout
worker, which builds it from ``workflow_kwargs`` and imports the reward function by its
path (AReaL puts the controller's ``sys.path``, so this script's folder, on the workers'
``PYTHONPATH``). The same script runs under ``torchrun`` in SPMD mode.
The data is a JSON-lines file of chat prompts with an ``answer``; the reward is a rule:
the share of the response's words that are the answer.
"""

import sys

from areal.api.cli_args import GRPOConfig, load_expr_config
from datasets import load_dataset

# was: from areal import PPOTrainer
from lossreduce.trainer_worker.integrations.areal import LossReducePPOTrainer as PPOTrainer


def answer_share(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    **data: object,  # the prompt row's other fields (AReaL passes them all)
) -> float:
    words = completions.split()
    return words.count(answer) / max(len(words), 1)


def main(argv: list[str]) -> None:
    config, _ = load_expr_config(argv, GRPOConfig)
    train_dataset = load_dataset("json", data_files=config.train_dataset.path, split="train")
    workflow_kwargs = {
        "reward_fn": "single_controller_launch.answer_share",
        "gconfig": config.gconfig,
        "tokenizer": config.tokenizer_path,
    }
    with PPOTrainer(config, train_dataset=train_dataset) as trainer:
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=workflow_kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])
