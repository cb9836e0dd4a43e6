"""AReaL without a GPU: its Archon engine's CPU settings (:mod:`.archon`) and its
Megatron engine on the shared Megatron CPU platform (:mod:`.megatron`)."""
