"""A Prometheus ``/metrics`` HTTP endpoint on its own thread.

Shared by the coordinator (``lossreduce serve``) and the node agent
(``lossreduce agent``): one registry per endpoint, scrapes not logged.
"""

from __future__ import annotations

import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

__all__ = ["MetricsServer"]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood stderr."""


class MetricsServer:
    """The ``/metrics`` HTTP endpoint of one registry, on its own thread."""

    # prometheus_client's start_http_server polls for shutdown every 0.5 s;
    # coordinators and agents start and stop often (tests, Ray actor restarts).
    _POLL_INTERVAL_S = 0.05

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, *, name: str = "lossreduce-metrics"
    ) -> None:
        self._server = make_server(
            host, port, make_wsgi_app(registry), ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(self._POLL_INTERVAL_S,),
            name=name,
            daemon=True,
        )
        self._thread.start()
        self.host = host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
