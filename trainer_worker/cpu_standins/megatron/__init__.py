"""Megatron-Core without a GPU: one CPU platform (:mod:`.platform`) for every framework
whose Megatron engine builds its model through mbridge. Each framework's own fixes stay
beside it (AReaL's: :mod:`lossreduce.trainer_worker.cpu_standins.areal.megatron`)."""
