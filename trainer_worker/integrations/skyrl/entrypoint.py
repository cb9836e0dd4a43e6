"""SkyRL's ``main_base`` launch with lossreduce: ``trainer.override_entrypoint`` names this module.

::

    python -m skyrl.train.entrypoints.main_base \\
        trainer.override_entrypoint=lossreduce.trainer_worker.integrations.skyrl.entrypoint \\
        trainer.lossreduce.mode=prompt_mean ...your usual arguments...

SkyRL's ``main()`` peeks at ``trainer.override_entrypoint`` before it parses the
arguments and calls :func:`main` here, which does what SkyRL's does with
:data:`~.config.LossReduceSkyRLConfig` (SkyRL's config with the ``trainer.lossreduce``
block) and :class:`~.trainer.LossReducePPOExp`:

1. parse the arguments (without the dispatch flag);
2. check lossreduce's settings and the SkyRL options they need, in this process,
   before Ray starts: a bad value stops the launch in seconds with one
   :class:`~lossreduce.errors.ReductionConfigError` naming the key, the value and
   what is allowed;
3. fix the run's identity (``trainer.lossreduce.run``, else ``LOSSREDUCE_RUN``, else
   a fresh id) so that every policy worker reduces under the same run;
4. SkyRL's own ``validate_cfg`` and ``initialize_ray``, then the experiment in a Ray
   task, as SkyRL runs its own.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["main", "prepared_config", "run_experiment"]


def prepared_config(argv: list[str]) -> Any:
    """The launch's config from ``argv`` (SkyRL's ``key.path=value`` arguments), checked,
    with the run fixed; raises before anything starts if lossreduce cannot run it."""
    from lossreduce.trainer_worker.integrations.skyrl.version import require_skyrl

    require_skyrl()
    from lossreduce.trainer_worker.integrations.run_identity import resolve_run
    from lossreduce.trainer_worker.integrations.skyrl.config import (
        LossReduceSkyRLConfig,
        check_launch,
    )

    given = [a for a in argv if not a.startswith("trainer.override_entrypoint=")]
    cfg = LossReduceSkyRLConfig.from_cli_overrides(given)
    settings = check_launch(cfg)
    cfg.trainer.lossreduce = {**cfg.trainer.lossreduce, "run": resolve_run(settings.run)}
    return cfg


def main() -> None:
    """SkyRL's ``main`` with lossreduce's config, check and experiment."""
    cfg = prepared_config(sys.argv[1:])
    import ray
    from skyrl.train.utils import validate_cfg
    from skyrl.train.utils.utils import initialize_ray

    validate_cfg(cfg)
    initialize_ray(cfg)
    # One CPU, off the head's driver, as SkyRL runs its own experiment.
    ray.get(ray.remote(num_cpus=1)(run_experiment).remote(cfg))


def run_experiment(cfg: Any) -> None:
    """SkyRL's experiment with :class:`~.trainer.LossReducePPOExp` (in a Ray task)."""
    from lossreduce.trainer_worker.integrations.skyrl.trainer import LossReducePPOExp

    LossReducePPOExp(cfg).run()


if __name__ == "__main__":
    main()
