"""Stand-ins that let RL frameworks run on a machine without a GPU.

What lives here exists only so that the tests, the benches and the demo can run a
framework's real training code on CPU: a platform that answers the framework's device
questions with the CPU and gloo, a rollout server that samples with Hugging Face
``generate`` where the framework ships GPU inference engines only, the settings a
framework's engine needs on CPU, and a whole CPU launch. None of it is needed on a
GPU, and no production launch imports it: the integrations
(:mod:`lossreduce.trainer_worker.integrations`) never import this package (checked by
``tests/test_import_rules.py``); the train job (``lossreduce train``), the benches and
the tests do.

One subpackage per engine family, shared by every framework that runs that engine:

- :mod:`~lossreduce.trainer_worker.cpu_standins.verl`: verl's CPU platform
  (``platform``), a CPU rollout (``rollout``), the environment that selects them
  before verl is imported (``env``) and a tiny offline ``main_ppo`` launch
  (``launch``); used by the verl tests, ``lossreduce train --engine verl`` and
  ``lossreduce bench --e2e``.
- :mod:`~lossreduce.trainer_worker.cpu_standins.megatron`: one CPU platform for
  Megatron-Core models built by mbridge (``platform``), for every framework whose
  Megatron engine builds its model that way.
- :mod:`~lossreduce.trainer_worker.cpu_standins.areal`: AReaL's Archon engine on CPU
  (``archon``: its two CPU settings) and AReaL's Megatron engine on the Megatron
  platform (``megatron``: that platform plus AReaL's version fixes).
- :mod:`~lossreduce.trainer_worker.cpu_standins.skyrl`: SkyRL's FSDP workers on CPU
  (``platform``), a stand-in for its vLLM inference server and weight sync
  (``inference``), a SkyRL-gym task (``letters_env``) and a tiny offline ``main_base``
  launch (``launch``); used by the SkyRL tests and ``lossreduce bench --e2e``.

Importing this package imports no framework; each module imports its own.
"""
