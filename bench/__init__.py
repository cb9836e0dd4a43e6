"""``lossreduce bench``: the coordinator against gloo, TCPStore and a Ray actor, and
what lossreduce costs inside each framework's training step.

The benches have a room of their own, apart from what they measure: they import the
server, the client and the trainer side alike, and nothing of lossreduce imports them
but the ``lossreduce`` command's dispatcher (by module name). ``cli`` is the command;
``contenders``, ``hosts``, ``servers``, ``echo`` and ``ray_contender`` are what it
measures; ``run``, ``stats`` and ``report`` time, summarize and plot it; ``workload``
is the data every contender reduces; ``e2e`` is ``--e2e``, the training-step
comparison, over the framework benches of :mod:`lossreduce.bench.frameworks`;
``m2po`` is ``--m2po`` and ``many_runs`` is ``--many-runs``.
"""
