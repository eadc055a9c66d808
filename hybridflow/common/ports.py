"""Rendezvous ports: a TCP store's port picked and held by the process that will host the store."""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


def find_free_port() -> int:
    """A TCP port free on this host right now (and maybe not later: the project's own stores use hold_free_port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


# Listening sockets this process holds for a rendezvous store it will host, by (address, port).
_HELD_PORTS: dict[tuple[str, int], socket.socket] = {}


def hold_free_port(addr: str) -> int:
    """Listen on a free port of `addr` now and keep the socket for this process's rendezvous store (tcp_store).

    A port only looked up (bound, closed, bound again when the store starts) can be taken in between by any socket
    on the host, Ray's among them, and the store then fails with "address already in use". A held port cannot be
    taken; a client that connects before the store starts waits in the socket's backlog.
    """
    sock = socket.create_server((addr, 0), backlog=128)
    port = int(sock.getsockname()[1])
    _HELD_PORTS[(addr, port)] = sock
    return port


def tcp_store(addr: str, port: int, world_size: int, is_server: bool, timeout: datetime.timedelta,
              wait_for_workers: bool = True) -> dist.TCPStore:
    """A rendezvous store on (addr, port). The server listens on `addr` only (torch's own TCPStore server binds every
    interface), on the socket hold_free_port keeps for that port if there is one (else a new one); the store owns
    that socket from then on and closes it."""
    if not is_server:
        return dist.TCPStore(addr, port, world_size, False, timeout, wait_for_workers=wait_for_workers)
    sock = _HELD_PORTS.pop((addr, port), None)
    fd = (sock or socket.create_server((addr, port), backlog=128)).detach()
    try:
        return dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def release_held_port(addr: str, port: int) -> None:
    """Close the socket held on (addr, port) if its store never started (a host closed before its group met)."""
    sock = _HELD_PORTS.pop((addr, port), None)
    if sock is not None:
        sock.close()
