"""Backends from DNS: every A/AAAA record of a host, one ``http://IP:PORT`` each, re-resolved every
``refresh_s``. A headless Service answers one record per ready pod, so the list follows the pods.

A name that does not exist (NXDOMAIN: a headless Service with no ready pod) means no backends; any
other failure (the resolver timing out) keeps the last list and is counted in ``errors``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

# getaddrinfo's answers for "no such name" / "no address for it"; EAI_NODATA is not on every platform.
_NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def parse_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); raises ValueError naming what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.removeprefix("[").removesuffix("]")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"the port of {value!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"the port of {value!r} is out of range (0-65535)")
    return host, number


def backend_url(address: str, port: int) -> str:
    """``http://IP:PORT`` with an IPv6 address bracketed."""
    if ipaddress.ip_address(address).version == 6:
        return f"http://[{address}]:{port}"
    return f"http://{address}:{port}"


class DnsBackends:
    """The backends behind ``host``:``port``; :meth:`refresh` resolves once, :meth:`run` forever.
    ``urls`` is the current list, sorted."""

    def __init__(self, host: str, port: int, *, refresh_s: float = 2.0, logger: Any = None) -> None:
        self.host = host
        self.port = port
        self.refresh_s = refresh_s
        self.logger = logger
        self.urls: list[str] = []
        self.errors = 0

    async def refresh(self) -> list[str]:
        """Resolve now; returns (and keeps) the new list."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_RECORDS:
                self.urls = []
            else:
                self.errors += 1
                if self.logger is not None:
                    self.logger.warning(f"router: resolving {self.host} failed ({exc}); keeping {self.urls}")
            return self.urls
        addresses = {info[4][0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}
        self.urls = sorted(backend_url(a.split("%")[0], self.port) for a in addresses)
        return self.urls

    async def run(self) -> None:
        """Refresh every ``refresh_s`` until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)
