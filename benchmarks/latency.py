"""Round-trip latency for TCP between network namespaces, without netem: a userspace delay relay.

Why our own: these machines' kernels have neither ``sch_netem`` nor ``sch_fq`` (so no eBPF earliest-departure-time
delay either), and no kept library relays TCP with a fixed delay. A relay runs in a peer's namespace and listens on
the address the peer announces; each connection to it is forwarded to the peer's real listening address (on the
namespace's loopback), and every chunk of bytes, in each direction, is held for half the round trip before it is
written on. So every request/response across such a connection takes the drawn round trip longer, which is what
matchmaking, all-reduce and DHT RPCs see. What it does not do: delay TCP's own handshake and acknowledgements (the
relay acknowledges at once), so TCP's congestion window is not limited by the delay as on a real long link; the
link's rate is still limited by ``tc tbf`` on the namespace's link. Connections a peer dials out take the round trip
of the peer it dials (its relay); peers that accept no connections (behind NAT) have none of their own.

Usage: python benchmarks/latency.py --rtt_ms 80 --forward LISTEN_IP:PORT TARGET_IP:PORT [--forward ...]
       python benchmarks/latency.py --echo IP:PORT            (a TCP echo server, to measure the round trip)
Prints ``ready`` on stdout once listening; runs until killed.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import time
from typing import List, Optional, Sequence, Tuple

CHUNK = 1 << 16
QUEUED_CHUNKS = 256  # per direction: when the delay line holds this many, reading stops (TCP flow control)


def address(text: str) -> Tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected IP:PORT, got {text!r}")
    return host, int(port)


async def delay_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk written ``delay`` s after it was read (order kept); the end of the
    stream is passed on as a half-close; a reset on either side raises ConnectionError."""
    queue: asyncio.Queue = asyncio.Queue(QUEUED_CHUNKS)

    async def read() -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                await queue.put((time.monotonic() + delay, data))
                if not data:
                    return
        except (ConnectionError, OSError) as error:
            await queue.put((0.0, error))

    reading = asyncio.ensure_future(read())
    try:
        while True:
            due, data = await queue.get()
            if isinstance(data, Exception):
                raise ConnectionError(f"read failed: {data}")
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
    finally:
        reading.cancel()


def no_delay(*writers: asyncio.StreamWriter) -> bool:
    """Turn Nagle's algorithm off on each writer's connection; False (each one closed) if one of them is already gone:
    a client that connects and resets at once (hivemind's dialer, a peer killed mid-connect) leaves its transport
    closed by the time the relay's handler runs, and setsockopt then raises EBADF, which asyncio logs as an
    "Unhandled exception in client_connected_cb" traceback (``tests/test_latency_relay.py``)."""
    try:
        for writer in writers:
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True
    except OSError:
        for writer in writers:
            writer.close()
        return False


async def relay(listen: Tuple[str, int], target: Tuple[str, int], delay: float) -> asyncio.AbstractServer:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(*target)
        except OSError:
            client_writer.close()
            return
        if not no_delay(client_writer, target_writer):
            return
        lines = [asyncio.ensure_future(delay_line(client_reader, target_writer, delay)),
                 asyncio.ensure_future(delay_line(target_reader, client_writer, delay))]
        try:  # both directions to their end, or both cut at the first error
            await asyncio.wait(lines, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for line in lines:
                line.cancel()
            await asyncio.gather(*lines, return_exceptions=True)
            client_writer.close()
            target_writer.close()

    return await asyncio.start_server(handle, *listen, reuse_address=True)


async def echo(listen: Tuple[str, int]) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not no_delay(writer):
            return
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, *listen, reuse_address=True)


def tcp_round_trip(host: str, port: int, count: int = 5, timeout: float = 10.0) -> float:
    """The median seconds for one byte to go to a TCP echo server at ``host:port`` and back (``count`` tries over
    one connection, so the connection's setup is not counted)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(count):
            start = time.monotonic()
            sock.sendall(b"x")
            if sock.recv(1) != b"x":
                raise ConnectionError(f"{host}:{port} is not an echo server")
            times.append(time.monotonic() - start)
    return statistics.median(times)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt_ms", type=float, default=0.0, help="round trip added to each relayed connection")
    parser.add_argument("--forward", nargs=2, action="append", default=[], metavar=("LISTEN", "TARGET"),
                        type=address, help="relay connections to LISTEN (IP:PORT) on to TARGET (IP:PORT)")
    parser.add_argument("--echo", type=address, default=None, help="also run a TCP echo server at IP:PORT")
    args = parser.parse_args(argv)
    if args.rtt_ms < 0:
        parser.error(f"--rtt_ms must be >= 0, got {args.rtt_ms:g}")
    if not args.forward and args.echo is None:
        parser.error("give --forward LISTEN TARGET or --echo IP:PORT")
    return args


async def serve(args: argparse.Namespace) -> None:
    servers: List[asyncio.AbstractServer] = []
    for listen, target in args.forward:
        servers.append(await relay(listen, target, args.rtt_ms / 2000))
    if args.echo is not None:
        servers.append(await echo(args.echo))
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except OSError as error:
        print(f"latency.py: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
