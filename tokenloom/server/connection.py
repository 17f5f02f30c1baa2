"""Connection hygiene for uvicorn: a client must send a whole request within a bound.

uvicorn arms its keep-alive timer only after a response, and cancels it as soon as any byte
arrives, so a client that opens a socket and sends nothing, or dribbles headers a byte at a time
(slowloris), keeps the socket forever. `ReadTimeoutH11Protocol` arms a deadline when a connection
opens and after every response; it is cleared only once a whole request (headers and body) has
arrived. A connection still short of that at the deadline is closed (the app, if it was reading the
body, sees a disconnect). Header size is bounded by h11 (`h11_max_incomplete_event_size`).

Malformed framing (a garbage request line, `Content-Length: -1`, a bad chunk size, oversized
headers) is answered by uvicorn itself, before any app runs, as `text/plain`; here it is the same
400 in the OpenAI error shape every other error has, with h11's reason, when nothing was sent yet on
the connection (otherwise the connection is just closed, as uvicorn does).

Writes are bounded too. Every streaming response (SSE completions and chats: `WriteTimeoutStreamingResponse`;
the dashboard's stream: dashboard.py) gives each write WRITE_TIMEOUT_S to be taken, else the stream is cut
off and its request aborted, its slot freed. A write blocks only once the connection's buffers are full,
so they are kept small (SEND_BUFFER_BYTES of kernel send buffer instead of the megabytes autotuning may
give): a client that stops reading is felt after that much, not after minutes of frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

import h11
from fastapi.responses import StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 5.0
MAX_HEADER_BYTES = 64 * 1024
WRITE_TIMEOUT_S = 10.0  # a streaming response whose client takes nothing for this long is cut off
SEND_BUFFER_BYTES = 64 * 1024  # the kernel's send buffer per connection (Linux doubles it)

logger = logging.getLogger("tokenloom.server")


class WriteTimeoutStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every write must be taken within `write_timeout_s`: a client whose socket
    stays full is cut off (the body iterator is closed, so its request is aborted)."""

    write_timeout_s: float = WRITE_TIMEOUT_S
    cut_off = 0  # streams cut off in this process (for the tests and the log)

    async def __call__(self, scope, receive, send) -> None:
        timed_out = False

        async def timed_send(message) -> None:
            nonlocal timed_out
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                timed_out = True
                raise OSError("the client took no data within the write timeout") from None

        try:
            await super().__call__(scope, receive, timed_send)
        except OSError:
            if not timed_out:
                raise
        finally:
            if timed_out:
                type(self).cut_off += 1
                logger.warning("a stream's client took no data for %.0fs; the stream is closed", self.write_timeout_s)
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()  # its `finally` aborts the engine's requests


class ReadTimeoutH11Protocol(H11Protocol):
    read_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small buffers: a client that stops reading blocks our writes soon (see above)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._framing_error: str | None = None
        next_event = self.conn.next_event

        def remembering_next_event():  # uvicorn drops h11's reason; keep it for the 400's message
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._framing_error = str(exc)
                raise

        self.conn.next_event = remembering_next_event
        self._arm_read_timer()

    def send_400_response(self, msg: str) -> None:
        reason = self._framing_error or msg
        body = json.dumps({"error": {"message": f"malformed HTTP request: {reason}", "type": "invalid_request_error",
                                     "param": None, "code": "bad_http_request"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass  # a response had begun on this connection already: nothing more can be said on it
        self.transport.close()

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
            self._read_timer = None

    def _request_complete(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and not cycle.more_body

    def handle_events(self) -> None:
        super().handle_events()
        if self._request_complete():
            self._cancel_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._request_complete() or self.transport.is_closing():
            return
        self.logger.info("closing a connection that did not send a whole request within %.0fs", self.read_timeout_s)
        self.transport.close()


def connection_limits(read_timeout_s: float) -> dict:
    """Keyword arguments for `uvicorn.Config`."""
    protocol = type("ReadTimeoutH11", (ReadTimeoutH11Protocol,), {"read_timeout_s": read_timeout_s})
    return {"http": protocol, "timeout_keep_alive": KEEP_ALIVE_S, "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
