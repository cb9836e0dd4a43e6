"""``rollout_server.py`` started by the command line of AReaL's vLLM launch.

In single-controller mode the rollout worker starts its inference server itself:
``VLLMBackend.launch_server`` runs ``python3 -m areal.engine.vllm_ext.areal_vllm_server
--model M --host H --port P --seed S ...`` (``vLLMConfig.build_cmd_from_args``), with
``python3`` found on the worker's ``PATH``. ``single_controller.py`` puts a ``python3``
first on that PATH (the rollout worker's ``scheduling_spec`` ``env_vars``) which runs this
module for that one command and the real interpreter for anything else, so AReaL's
scheduler, worker and ``RemotevLLMEngine`` launch, wait for and talk to this CPU server
in place of vLLM.

Of vLLM's flags it reads ``--model``, ``--host``, ``--port`` and ``--seed``; the others
(memory, parallelism, scheduling) mean nothing to a one-process CPU server. It serves
what ``rollout_server.py`` serves, and since AReaL kills it when the run ends, it writes
its log (``GET /test/log``) to ``$KEEP_DIR/log.json`` after every POST, beside the weight
versions it keeps there (``v<version>.pt``).

Run: ``python cpu_vllm_server.py --model M --host H --port P --seed S [vLLM flags]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import torch

from tests.trainer_worker.integrations.areal.rollout_server import Model, handler

KEEP_DIR = "KEEP_DIR"
"""The environment variable naming where the weights and the log go."""


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args, _vllm_only = parser.parse_known_args(argv)
    keep = Path(os.environ[KEEP_DIR])
    keep.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    model = Model(args.model, args.seed, str(keep))
    log_path = keep / "log.json"
    writing = threading.Lock()

    class Logged(handler(model)):  # type: ignore[misc]
        def do_POST(self) -> None:  # noqa: N802 (BaseHTTPRequestHandler's name)
            super().do_POST()
            # Whole-file replace: a reader never sees half a log.
            with writing:
                partial = log_path.with_suffix(".tmp")
                partial.write_text(json.dumps(model.log))
                partial.replace(log_path)

    server = ThreadingHTTPServer((args.host, args.port), Logged)
    print(f"CPU rollout server for AReaL's vLLM launch on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
