"""The HTTP exposition of the operator's metrics: ``GET /metrics`` on a port of its own.

It runs in a daemon thread (prometheus-client's WSGI server), so a busy event loop never delays a
scrape and a scrape never blocks a reconcile.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    """Serves ``registry`` at ``http://address:port/metrics`` from :meth:`start` until :meth:`close`.

    ``port`` 0 takes a free port (``port`` says which once started). Raises ``OSError`` when the
    address cannot be bound.
    """

    def __init__(self, registry: CollectorRegistry, port: int, address: str = "0.0.0.0") -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be 0-65535, got {port}")
        self.registry = registry
        self.address = address
        self.port = port
        self._server = None
        self._thread = None

    def start(self) -> MetricsServer:
        """Bind and start serving; returns self."""
        self._server, self._thread = start_http_server(self.port, addr=self.address, registry=self.registry)
        self.port = self._server.server_port
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None
