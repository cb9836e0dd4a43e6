"""verl without a GPU: its CPU platform, a CPU rollout, and a tiny offline launch.

- :mod:`.env`: the environment a process sets before it imports verl
  (:data:`~.env.CPU_ENV`; imports no verl);
- :mod:`.platform`: the ``cpu`` platform (``VERL_PLATFORM=cpu``), loaded by verl through
  ``VERL_USE_EXTERNAL_MODULES``;
- :mod:`.rollout`: the ``cpu`` rollout (``actor_rollout_ref.rollout.name=cpu``), loaded
  the same way;
- :mod:`.launch`: the inputs and the command of a tiny ``python -m
  verl.trainer.main_ppo`` run on 2 CPU ranks.
"""
