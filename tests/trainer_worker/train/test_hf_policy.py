"""The built-in Hugging Face policy over the task's token ids."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from lossreduce.trainer_worker.train.hf_policy import TaskLogits, save_task_qwen2
from lossreduce.trainer_worker.train.rollouts import sample_responses
from lossreduce.trainer_worker.train.task import BOS, EOS, OUTPUT_VOCAB, DigitTask
from lossreduce.trainer_worker.train.train_settings import TrainSettings


def test_the_same_seed_saves_the_same_weights_and_another_seed_does_not(tmp_path: Path) -> None:
    settings = TrainSettings(d_model=16, layers=1, heads=2)
    first = Qwen2ForCausalLM.from_pretrained(save_task_qwen2(settings, tmp_path / "a"))
    again = Qwen2ForCausalLM.from_pretrained(save_task_qwen2(settings, tmp_path / "b"))
    other = Qwen2ForCausalLM.from_pretrained(
        save_task_qwen2(settings.model_copy(update={"seed": settings.seed + 1}), tmp_path / "c")
    )
    weights = [dict(m.named_parameters()) for m in (first, again, other)]
    assert all(torch.equal(p, weights[1][name]) for name, p in weights[0].items())
    assert not all(torch.equal(p, weights[2][name]) for name, p in weights[0].items())
    assert first.config.hidden_size == 16
    assert first.config.eos_token_id == EOS


def test_the_sampler_draws_task_tokens_from_the_hf_policy(tmp_path: Path) -> None:
    settings = TrainSettings(d_model=16, layers=1, heads=2)
    policy = TaskLogits(Qwen2ForCausalLM.from_pretrained(save_task_qwen2(settings, tmp_path)))
    task = DigitTask(settings.prompt_len, settings.response_len, settings.max_step)
    prompts = task.sample_prompts(2, torch.Generator().manual_seed(0))
    assert policy(prompts.tokens).shape == (2, 1 + settings.prompt_len, OUTPUT_VOCAB)
    samples = sample_responses(
        policy,
        None,
        prompts.tokens,
        samples_per_prompt=3,
        response_len=settings.response_len,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    responses = samples.tokens[:, 1 + settings.prompt_len :]  # [6, L]
    assert responses.shape == (6, settings.response_len)
    assert int(responses.max()) <= EOS
    assert BOS not in responses
    assert bool(torch.isfinite(samples.old_logprobs).all())
