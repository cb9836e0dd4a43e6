"""SkyRL 0.4 on a machine without a GPU: its FSDP workers' CPU platform (``platform``),
a stand-in for its vLLM inference server and weight sync (``inference``), and a tiny
offline ``main_base`` launch (``launch``). For the tests, the bench and demos only;
the integration (:mod:`lossreduce.trainer_worker.integrations.skyrl`) never imports
it. Importing this package imports no SkyRL."""
