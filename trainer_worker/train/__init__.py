"""``lossreduce train``: the main job, GRPO-style training on Ray trainer workers.

``cli`` parses the flags into :class:`~lossreduce.trainer_worker.train.train_settings.TrainSettings`;
``driver`` starts (or joins) Ray, the coordinator actor
(:mod:`lossreduce.trainer_worker.integrations.coordinator_actor`, with the run's
own TLS over several nodes), the placement group (``placement``) and the node
agents (``agent_actor``), then drives the engine of
``--engine`` (:mod:`~lossreduce.trainer_worker.train.engines`: one folder per
engine behind one interface and one registry) on the worker group
(``worker_group``: bounded waits, failure reports). ``task`` is the built-in
digit task every engine trains on; ``outputs`` and ``metrics`` record the run;
``verify`` compares ``--verify``'s gradients; ``rollouts`` and ``hf_policy`` are
the sampling pipeline and the Hugging Face policy engines share.

Nothing here is imported by the reduction library, which therefore never
imports Ray.
"""
