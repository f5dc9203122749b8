"""benchmarks/latency.py's relay and echo server on loopback: a client that connects and resets at once (hivemind's
dialer giving up, a peer killed mid-connect) costs the relay nothing, and the relay still serves the next one."""
from __future__ import annotations

import asyncio
import socket
import struct

from benchmarks.latency import echo, relay

RESETS = 20


def reset_at_once(port: int) -> None:
    """Connect to 127.0.0.1:``port`` and close with a reset (SO_LINGER 0), as a killed dialer does."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.connect(("127.0.0.1", port))


def test_clients_that_reset_at_once_raise_nothing_and_the_relay_serves_on():
    async def run() -> tuple[list, bytes]:
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context["message"]))
        target = await echo(("127.0.0.1", 0))
        server = await relay(("127.0.0.1", 0), target.sockets[0].getsockname()[:2], delay=0.0)
        port = server.sockets[0].getsockname()[1]
        for each in (port, target.sockets[0].getsockname()[1]):  # the relay, and the echo server itself
            for _ in range(RESETS):
                reset_at_once(each)
        await asyncio.sleep(0.5)  # every handler has run
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        writer.write(b"ping")
        answer = await asyncio.wait_for(reader.readexactly(4), 5)
        writer.close()
        await asyncio.sleep(0.5)  # the relay's and the echo server's handlers see the end and finish
        for each in (server, target):
            each.close()
        return list(errors), answer

    errors, answer = asyncio.run(run())
    assert errors == []  # before: "Unhandled exception in client_connected_cb" (EBADF) for each reset
    assert answer == b"ping"
