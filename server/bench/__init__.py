"""``lossreduce bench``: the coordinator against gloo, TCPStore and a Ray actor.

Nothing in :mod:`lossreduce.server` imports this package; it is the one place
where the server side may import the client (its contenders run the shipped
clients). ``cli`` is the command; ``contenders``, ``hosts``, ``servers`` and
``ray_contender`` are what it measures; ``run``, ``stats`` and ``report`` time,
summarize and plot it; ``workload`` is the data every contender reduces;
``e2e`` is ``--e2e``, the training-step comparison.
"""
