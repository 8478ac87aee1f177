"""A loopback TCP proxy that puts the server further away and counts round trips.

Run as its own process (``python -m bench.proxy UPSTREAM_PORT --delay-us 250``), so its threads
never compete with the measured client for the GIL. Every chunk read from one side is written to
the other *delay* later, in order, so each round trip gains twice the delay. A *round trip* is
counted each time the client speaks after the server last did: BEGIN, each statement (Parse,
Bind, Execute and Sync go out in one write) and COMMIT count one each, whatever the driver.

It listens on 127.0.0.1 only, forwards only to 127.0.0.1, accepts at most ``--max-conns``
connections, and exits after ``--seconds`` or as soon as its standard input closes (the bench
died). Standard input is also its control channel: a line ``count`` is answered with the round
trips counted so far.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

_CHUNK = 65536
_SPIN = 100e-6


class Link:
    """One direction of one connection: read a chunk, hold it for *delay*, write it.

    One thread does all three, so no hand-over between threads adds its own wake-up latency;
    a chunk that arrives while another is held waits a little longer, which a request/response
    protocol never does. The hold ends in a short spin, because a sleep alone overshoots by
    tens of microseconds.
    """

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        self.src, self.dst, self.delay = src, dst, delay

    def pump(self, on_data: Callable[[], None]) -> None:
        try:
            while data := self.src.recv(_CHUNK):
                due = time.perf_counter() + self.delay
                on_data()
                left = due - time.perf_counter() - _SPIN  # read the clock once: it moves
                if left > 0:
                    time.sleep(left)
                while time.perf_counter() < due:
                    pass
                self.dst.sendall(data)
        except OSError:
            pass
        for sock in (self.dst, self.src):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class Proxy:
    def __init__(self, upstream: int, delay: float, max_conns: int) -> None:
        self.upstream, self.delay, self.max_conns = upstream, delay, max_conns
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.lock = threading.Lock()
        self.round_trips = 0

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def serve(self) -> None:
        for _ in range(self.max_conns):
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.upstream))
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._join(client, server)

    def _join(self, client: socket.socket, server: socket.socket) -> None:
        # The client's turn starts when it sends after the server has answered.
        answered = [True]

        def client_spoke() -> None:
            if answered[0]:
                answered[0] = False
                with self.lock:
                    self.round_trips += 1

        def server_spoke() -> None:
            answered[0] = True

        up, down = Link(client, server, self.delay), Link(server, client, self.delay)
        threading.Thread(target=up.pump, args=(client_spoke,), daemon=True).start()
        threading.Thread(target=down.pump, args=(server_spoke,), daemon=True).start()


class Distant:
    """The bench's side: a proxy process in front of ``127.0.0.1:upstream``, and its counter."""

    def __init__(self, upstream: int, delay_us: float, seconds: float) -> None:
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.proxy", str(upstream)),
                *("--delay-us", str(delay_us), "--seconds", str(seconds)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout
        self.port = int(self._out.readline())

    def round_trips(self) -> int:
        """Round trips counted so far, over every connection through the proxy."""
        self._in.write("count\n")
        self._in.flush()
        return int(self._out.readline())

    def __enter__(self) -> Distant:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._in.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__)
    parser.add_argument("upstream", type=int, help="PostgreSQL port on 127.0.0.1")
    parser.add_argument("--delay-us", type=float, default=250.0, help="added each way")
    parser.add_argument("--seconds", type=float, default=300.0, help="exit after this long")
    parser.add_argument("--max-conns", type=int, default=64)
    a = parser.parse_args()
    sys.setswitchinterval(1e-4)  # a spinning link must not keep the other waiting for the GIL
    proxy = Proxy(a.upstream, a.delay_us / 1e6, a.max_conns)
    threading.Thread(target=proxy.serve, daemon=True).start()
    timer = threading.Timer(a.seconds, os._exit, (0,))
    timer.daemon = True
    timer.start()
    print(proxy.port, flush=True)
    for line in sys.stdin:  # ends when the bench closes our stdin or dies
        if line.strip() == "count":
            with proxy.lock:
                print(proxy.round_trips, flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
