"""Worker address resolution: an IP literal is one worker; a DNS name is every address
it resolves to (a Kubernetes headless service lists one address per pod)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from router.config import format_address, parse_address


def is_literal(address: str) -> bool:
    host, _ = parse_address(address)
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


async def resolve(address: str) -> set[str]:
    """The worker addresses ("ip:port") behind `address`; raises OSError on failure.

    IPv4 results are preferred: a name such as "localhost" that has both an IPv4 and an
    IPv6 address is one worker, not two."""
    host, port = parse_address(address)
    if is_literal(address):
        return {format_address(host, port)}
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    v4 = {info[4][0] for info in infos if info[0] == socket.AF_INET}
    v6 = {info[4][0] for info in infos if info[0] == socket.AF_INET6}
    return {format_address(ip, port) for ip in (v4 or v6)}
