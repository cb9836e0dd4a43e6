"""The engines of ``lossreduce train``: one folder each, behind one interface.

:mod:`.base` defines :class:`~.base.Engine` (what the driver drives) and
:class:`~.base.EngineSpec` (what the registry lists); :mod:`.registry` maps
``--engine`` values to engine packages. Each engine's folder has the same
shape: ``worker.py`` (the Ray actor of one rank), ``task.py`` (the built-in
task as that engine's policy sees it), ``model.py`` (its policy),
``flags.py`` (which flags it honours, pure) and ``engine.py`` (the driver's
side: start, train, verify, shut down).
"""
