"""What lossreduce's normalizers cost inside each framework's own training step.

One module per framework, each run by ``lossreduce bench --e2e`` and needing that
framework's environment: :mod:`.trl` (a TRL GRPO step), :mod:`.verl` (verl's actor
update), :mod:`.verl_main_ppo` (a whole ``main_ppo`` step), :mod:`.areal` (AReaL's
PPO update, per engine) and :mod:`.skyrl` (SkyRL's policy update), sharing :mod:`.abba`
(the ABBA order, its timing loop and the small Qwen2). On a machine without a GPU they run
the frameworks on the CPU stand-ins of :mod:`lossreduce.trainer_worker.cpu_standins`.
"""
