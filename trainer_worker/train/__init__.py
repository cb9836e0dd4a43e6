"""``lossreduce train``: the main job, GRPO-style training on Ray trainer workers.

``cli`` parses the flags into :class:`~lossreduce.trainer_worker.train.train_settings.TrainSettings`;
``driver`` starts (or joins) Ray, the coordinator actor (``coordinator_actor``),
the placement group (``placement``) and the node agents (``agent_actor``,
with ``tls`` for a run over several nodes), then drives the engine of
``--engine`` (:mod:`~lossreduce.trainer_worker.train.engines`: one folder per
engine behind one interface and one registry) on the worker group
(``worker_group``: bounded waits, failure reports). ``task`` is the built-in
digit task every engine trains on; ``outputs`` and ``metrics`` record the run;
``verify`` compares ``--verify``'s gradients.

Nothing here is imported by the reduction library, which therefore never
imports Ray.
"""
