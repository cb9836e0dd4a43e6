"""Stand-ins that let RL frameworks run on a machine without a GPU.

What lives here exists only so that the tests, the benches and the demo can run a
framework's real training code on CPU; no production launch imports it, and the
integrations (:mod:`lossreduce.trainer_worker.integrations`) never do. One subpackage
per engine family:

- :mod:`~lossreduce.trainer_worker.cpu_standins.skyrl`: SkyRL's FSDP workers on CPU
  (``platform``), a stand-in inference server and weight sync (``inference``) and a
  tiny offline ``main_base`` launch (``launch``).

Importing this package imports no framework; each module imports its own.
"""
