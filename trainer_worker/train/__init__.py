"""``lossreduce train``: the main job, GRPO-style training on Ray trainer workers.

``cli`` parses the flags into :class:`~lossreduce.trainer_worker.train.train_settings.TrainSettings`;
``driver`` starts (or joins) Ray, the coordinator actor (``coordinator_actor``)
and the worker group (``worker_group``, ``placement``), and runs the steps;
each ``worker`` (:class:`TrainerWorker`) samples rollouts (``rollout``) of the
digit task (``task``) from a small causal transformer (``model``), scores them
with the GRPO loss (``grpo``) and trains through the reduction library of
:mod:`lossreduce.trainer_worker`; ``outputs`` and ``metrics`` record the run;
``verify`` is ``--verify``'s single-process reference.

Nothing here is imported by the reduction library, which therefore never
imports Ray.
"""
