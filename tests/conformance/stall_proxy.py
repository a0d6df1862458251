"""A TCP proxy in front of a real redis-server that can make the remote tier late or stalled.

Modes (``proxy.mode``, switched at any moment, on every connection at once):

* ``pass``: bytes go through as they come.
* ``late``: a reply of ``late_bytes`` or more (a block's value; a probe's few bytes pass) is held
  ``late_s`` before it goes on, and what follows it on that connection waits behind it: the
  server answered, the answer arrives after the copy's deadline.
* ``stall``: nothing goes through either way; connections stay open and new ones are accepted
  (a hung host or a partitioned network, not a refused connection). Switching back to ``pass``
  delivers what was held, in order.
"""

from __future__ import annotations

import socket
import threading
import time

MODES = ("pass", "late", "stall")


class StallProxy:
    def __init__(self, host: str, port: int, late_s: float = 5.0, late_bytes: int = 4096) -> None:
        self.target = (host, port)
        self.late_s = late_s
        self.late_bytes = late_bytes
        self.mode = "pass"
        self.held_late = 0  # replies held back in late mode
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = "127.0.0.1", int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name="stall-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while not self._closed.is_set():
                data = source.recv(1 << 16)
                if not data:
                    break
                while self.mode == "stall" and not self._closed.is_set():
                    time.sleep(0.02)
                if replies and self.mode == "late" and len(data) >= self.late_bytes:
                    self.held_late += 1
                    self._closed.wait(self.late_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()
