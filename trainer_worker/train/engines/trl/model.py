"""The policy checkpoint of ``lossreduce train --engine trl``, checked on the driver.

``--model PATH`` must be a local Hugging Face causal-LM checkpoint with its
tokenizer; it is checked before any Ray worker starts, so bad input costs
nothing. A tokenizer without a pad token but with an EOS token pads with EOS
(the usual choice for causal LMs; TRL's completion mask stops at the first EOS
either way), and the run says so; one with neither is refused. Without
``--model``, the built-in tiny Qwen2 is saved to ``<out>/model``: TRL loads the
KL reference model from the policy's path.

Imports transformers (``pip install 'lossreduce[trl]'``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from lossreduce.errors import UsageError
from lossreduce.trainer_worker.train.engines.trl.task import save_tiny_qwen2
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["PolicyCheckpoint", "check_causal_lm", "prepare_policy"]


@dataclass(frozen=True)
class PolicyCheckpoint:
    """Where the workers load the policy from, and what the driver has to say about it."""

    path: Path
    built_in: bool
    pad_with_eos: bool = False
    """The tokenizer lacks a pad token: the workers pad with EOS."""
    notes: tuple[str, ...] = ()


def check_causal_lm(path: Path) -> tuple[str, ...]:
    """Raise :class:`UsageError` unless ``path`` holds a causal LM and a usable tokenizer;
    return notes for the run's log (a pad token set to EOS)."""
    if not path.is_dir():
        raise UsageError(f"--model {path}: no such directory (a local checkpoint folder)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        found = sorted(p.name for p in path.iterdir())[:8]
        raise UsageError(
            f"--model {path}: not a Hugging Face checkpoint (found {found}): {err}".splitlines()[0]
        ) from err
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(
            f"--model {path}: found a {config.model_type!r} model "
            f"(architectures {config.architectures}), not a causal LM"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model {path}: no tokenizer: {err}".splitlines()[0]) from err
    vocab = config.vocab_size
    if _embedded(tokenizer.pad_token_id, vocab):
        return ()
    if not _embedded(tokenizer.eos_token_id, vocab):
        raise UsageError(
            f"--model {path}: the tokenizer has neither a pad token nor an EOS token among the "
            f"model's {vocab} token ids to pad with; set pad_token in its tokenizer_config.json"
        )
    return (
        f"--model {path}: the tokenizer has no pad token among the model's {vocab} token ids; "
        f"padding with EOS {tokenizer.eos_token!r}",
    )


def _embedded(token_id: int | None, vocab_size: int) -> bool:
    # A tokenizer class may add a default special token (e.g. Qwen2's <|endoftext|>)
    # that the checkpoint's embedding does not have.
    return token_id is not None and 0 <= token_id < vocab_size


def prepare_policy(settings: TrainSettings, out_dir: Path) -> PolicyCheckpoint:
    """Check ``--model``, or save the built-in tiny Qwen2 to ``<out_dir>/model``."""
    if settings.model is not None:
        notes = check_causal_lm(settings.model)
        return PolicyCheckpoint(
            settings.model.resolve(), built_in=False, pad_with_eos=bool(notes), notes=notes
        )
    return PolicyCheckpoint(save_tiny_qwen2(settings, (out_dir / "model").resolve()), built_in=True)
