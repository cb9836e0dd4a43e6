"""The causal transformer policy."""

from __future__ import annotations

import pytest
import torch

from lossreduce.trainer_worker.train.engines.torch.model import CausalTransformer, PolicyConfig
from lossreduce.trainer_worker.train.rollouts import response_logprobs


def _model() -> CausalTransformer:
    torch.manual_seed(0)
    return CausalTransformer(PolicyConfig(d_model=16, n_heads=2, n_layers=1, max_len=8))


def test_logits_shape() -> None:
    logits = _model()(torch.randint(0, 12, (3, 5)))
    assert logits.shape == (3, 5, 11)


def test_attention_is_causal() -> None:
    model = _model()
    tokens = torch.randint(0, 10, (2, 6))
    changed = tokens.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % 10
    # Changing later tokens must not change earlier positions' logits.
    assert torch.allclose(model(tokens)[:, :4], model(changed)[:, :4])
    assert not torch.allclose(model(tokens)[:, 4:], model(changed)[:, 4:])


def test_response_logprobs_match_a_manual_log_softmax() -> None:
    model = _model()
    tokens = torch.randint(0, 10, (2, 6))
    logp = response_logprobs(model, tokens, prompt_len=3)  # [2, 3]
    logits = model(tokens)
    for i in range(2):
        for j, t in enumerate(range(3, 6)):
            expected = torch.log_softmax(logits[i, t - 1], dim=-1)[tokens[i, t]]
            assert torch.allclose(logp[i, j], expected, atol=1e-6)


def test_too_long_input_names_max_len() -> None:
    with pytest.raises(ValueError, match="max_len=8"):
        _model()(torch.zeros(1, 9, dtype=torch.long))


def test_width_must_divide_heads() -> None:
    with pytest.raises(ValueError, match="n_heads=3"):
        CausalTransformer(PolicyConfig(d_model=16, n_heads=3))
