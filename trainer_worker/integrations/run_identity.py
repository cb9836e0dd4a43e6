"""One run identity for every integration: the same on all ranks of a run, new for every run.

A coordinator outlives the runs that dial it, so two runs of one script (or a
run and its own resume) must not meet in one round. Every integration reduces
under a *run* it resolves once, in this order:

1. an explicit ``run`` setting (``LOSSREDUCE_RUN``): the operator's choice;
2. the launcher's own id for the run, the same on every rank and on ranks it
   restarts: torchrun's rendezvous id ``TORCHELASTIC_RUN_ID`` (drawn fresh by
   ``--standalone``; multi-node launches pass one per job, e.g. the scheduler's
   job id). Its placeholder ``none`` (torchrun without a rendezvous id) does not
   count;
3. otherwise rank 0 draws a short random id and shares it over the process group
   the framework already has (``broadcast_object_list``; gloo on CPU, the
   framework's own backend on GPU), so every rank agrees without any other
   channel.

The integration's default job name then carries the run (``trl-grpo-<run>``),
so runs with the default job never share a round; an explicit job keeps its
name and the run only travels on the wire, where the coordinator refuses a
second run claiming the same job. The pure parts (:func:`launcher_run`,
:func:`draw_run`, :func:`clean_run`) take no process group and are unit
tested alone.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

__all__ = [
    "RUN_ENV",
    "RUN_PATTERN",
    "clean_run",
    "draw_run",
    "launcher_run",
    "resolve_run",
    "run_job",
    "share_run",
]

RUN_ENV = "LOSSREDUCE_RUN"
"""The environment variable an explicit run id is read from."""

RUN_PATTERN = r"^[A-Za-z0-9_.\-]{1,40}$"
"""What a run id may be: it becomes part of job names, Ray actor names and file names."""

_ELASTIC_RUN_ENV = "TORCHELASTIC_RUN_ID"
# torchrun's default --rdzv-id when none is given: the same for every launch.
_ELASTIC_PLACEHOLDER = "none"
_MAX_LENGTH = 40


def clean_run(value: str) -> str:
    """``value`` as a run id: characters outside ``[A-Za-z0-9_.-]`` become ``-``, cut to
    40 characters (a launcher's id may be a UUID or a scheduler's job id)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.\-]", "-", value.strip())[:_MAX_LENGTH]
    if not cleaned:
        raise ValueError(f"run id {value!r} has no usable character")
    return cleaned


def draw_run() -> str:
    """A fresh random run id: 8 hex digits (collisions among concurrent runs of one
    job prefix are ~1 in 4 billion per pair)."""
    return secrets.token_hex(4)


def launcher_run(environ: Mapping[str, str] | None = None) -> str | None:
    """The launcher's id for this run, if it has a usable one (see the module docstring)."""
    env = os.environ if environ is None else environ
    value = env.get(_ELASTIC_RUN_ENV, "").strip()
    if not value or value == _ELASTIC_PLACEHOLDER:
        return None
    return clean_run(value)


def share_run(candidate: str, group: Any = None, device: Any = None) -> str:
    """Rank 0's ``candidate`` on every rank of ``group`` (a torch.distributed process
    group; None: the default one). A collective: every rank of the group calls it.
    Without an initialized process group, or in a group of one, ``candidate`` itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return candidate
    if dist.get_world_size(group) == 1:
        return candidate
    source = 0 if group is None else dist.get_global_rank(group, 0)
    box: list[Any] = [candidate]
    dist.broadcast_object_list(box, src=source, group=group, device=device)
    shared = box[0]
    assert isinstance(shared, str), "rank 0 broadcasts its run id"
    return shared


def resolve_run(
    explicit: str | None,
    *,
    group: Any = None,
    device: Any = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """This run's id: ``explicit`` if given, else the launcher's, else rank 0's draw
    shared over ``group``. Every rank of ``group`` must call it (the last case is a
    collective, and whether it is reached depends only on settings and environment
    that every rank of one launch shares)."""
    if explicit:
        return explicit
    found = launcher_run(environ)
    if found is not None:
        return found
    return share_run(draw_run(), group, device)


def run_job(job: str, run: str, *, explicit_job: bool) -> str:
    """The job name a run's rounds carry: an explicit ``job`` as given (stable names on
    dashboards; the run still goes on the wire), else the framework's default
    ``job`` with the run appended, so runs with the default job never meet."""
    return job if explicit_job else f"{job}-{run}"
