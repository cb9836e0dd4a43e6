"""GRPO on AReaL with lossreduce's normalizers: the launch script of docs/frameworks/areal.md.

An AReaL launch script with one import changed. ``test_areal_trainer_loop.py``
runs it under ``torchrun`` (AReaL's SPMD mode) and, with that import turned
back, as stock AReaL. The data is a JSON-lines file of chat prompts with an
``answer``; the reward is a rule: the share of the response's words that are the answer.
"""

import sys

from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.workflow.rlvr import RLVRWorkflow
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
    workflow = RLVRWorkflow(
        reward_fn=answer_share, gconfig=config.gconfig, tokenizer=config.tokenizer_path
    )
    with PPOTrainer(config, train_dataset=train_dataset) as trainer:
        trainer.train(workflow=workflow)


if __name__ == "__main__":
    main(sys.argv[1:])
