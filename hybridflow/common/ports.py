"""Rendezvous ports: a TCP store's port picked and held by the process that will host the store."""

from __future__ import annotations

import socket


def find_free_port() -> int:
    """A TCP port free on this host right now (and maybe not later: the project's own stores use hold_free_port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


# Listening sockets this process holds for a rendezvous store it will host, by (address, port).
_HELD_PORTS: dict[tuple[str, int], socket.socket] = {}


def hold_free_port(addr: str) -> int:
    """Listen on a free port of `addr` now and keep the socket for this process's rendezvous store (listen_fd).

    A port only looked up (bound, closed, bound again when the store starts) can be taken in between by any socket
    on the host, Ray's among them, and the store then fails with "address already in use". A held port cannot be
    taken; a client that connects before the store starts waits in the socket's backlog.
    """
    sock = socket.create_server((addr, 0), backlog=128)
    port = int(sock.getsockname()[1])
    _HELD_PORTS[(addr, port)] = sock
    return port


def listen_fd(addr: str, port: int) -> int:
    """A listening socket on (addr, port) for a TCPStore server, detached (the store closes it): the one
    hold_free_port keeps if there is one, else a new one."""
    sock = _HELD_PORTS.pop((addr, port), None)
    if sock is None:
        sock = socket.create_server((addr, port), backlog=128)
    return sock.detach()


def release_held_port(addr: str, port: int) -> None:
    """Close the socket held on (addr, port) if its store never started (a host closed before its group met)."""
    sock = _HELD_PORTS.pop((addr, port), None)
    if sock is not None:
        sock.close()
