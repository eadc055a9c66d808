"""A rendezvous port is held listening from the moment it is picked until the store takes it over, so nothing else on
the host can bind it in between (the race that made a replaced rank's init_distributed fail with EADDRINUSE)."""

from __future__ import annotations

import datetime
import errno
import socket
import threading

import pytest

from hybridflow.common.ports import hold_free_port, release_held_port, tcp_store

ADDR = "127.0.0.1"


def test_a_held_port_cannot_be_bound_by_another_socket_until_released():
    port = hold_free_port(ADDR)
    for _ in range(2):  # a plain bind, and one with SO_REUSEADDR as servers set it
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as err:
                other.bind((ADDR, port))
            assert err.value.errno == errno.EADDRINUSE
    release_held_port(ADDR, port)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind((ADDR, port))  # free again once released


def test_the_store_takes_over_the_held_socket_and_a_client_that_came_first_waits_in_its_backlog():
    port = hold_free_port(ADDR)
    timeout = datetime.timedelta(seconds=30)
    got = {}

    def client():  # connects while the port is held but no store serves it yet
        store = tcp_store(ADDR, port, 2, False, timeout)
        store.set("from_client", "1")
        got["value"] = store.get("from_server")

    thread = threading.Thread(target=client)
    thread.start()
    server = tcp_store(ADDR, port, 2, True, timeout)
    server.set("from_server", "2")
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert server.get("from_client") == b"1" and got["value"] == b"2"
    with pytest.raises(OSError):  # the held socket is the store's now: nothing was left behind to rebind
        socket.create_server((ADDR, port))
    del server


def test_a_store_on_a_port_that_was_not_held_binds_it_on_the_address_alone():
    with socket.socket() as probe:
        probe.bind((ADDR, 0))
        port = probe.getsockname()[1]
    server = tcp_store(ADDR, port, 1, True, datetime.timedelta(seconds=30))
    server.set("k", "v")
    assert server.get("k") == b"v"
    with pytest.raises(OSError):
        socket.create_server((ADDR, port))
    del server
