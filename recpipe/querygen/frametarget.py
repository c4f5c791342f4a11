"""The cheapest gRPC target: one fixed answer, written at the HTTP/2 frame level.

``recpipe bench querygen`` measures the generator, so the target it sends to must cost as little CPU
as possible: on a 2-core machine the target's CPU is taken from the same cores as the senders', and n
sender processes can offer at most ``cores / (generator + target CPU per query)``. The grpc.aio
fixed-reply server (``testserver --fixed-reply``) spends 70-75 us of CPU per query at best; this one
spends a fraction of that, because it does no gRPC server work at all:

- it speaks HTTP/2 (RFC 9113) over a real TCP socket to a real gRPC client, and answers each request
  stream with three frames prepared at start (response headers, the reply message, trailers with
  ``grpc-status: 0``), the stream id patched in;
- it never decodes the client's header blocks (HPACK): what a stream asked for is told by its message
  alone. A stream whose message has a body gets the fixed reply (a ``RecommendResponse``: the requests
  the generator sends); one with an empty message (``GetInfo``, health checks) gets ``UNIMPLEMENTED``,
  so a client learns the target serves no such thing, as from a server without the service;
- its own headers use HPACK literals without indexing (no dynamic table to keep), and it opens every
  receive window to the largest size at start, so it never has to throttle a client; its own sends
  keep to the client's connection window.

It is a measuring instrument, not a server: it answers any method with the reply, and checks nothing
of a request but its framing. A connection that breaks the framing is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# frame types and flags (RFC 9113, section 6)
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
MAX_WINDOW = 2**31 - 1
#: the initial connection window in either direction, before any WINDOW_UPDATE (RFC 9113, 6.9.2)
DEFAULT_WINDOW = 65_535
#: received bytes after which the connection's receive window is topped up again
_TOP_UP = 2**30
_GRPC_PREFIX = 5  # a gRPC message on the wire: 1 byte compressed flag, 4 bytes length
UNIMPLEMENTED = 12


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 9-byte header (length, type, flags, stream id) and the payload."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _string(value: bytes) -> bytes:
    if len(value) >= 127:  # one length byte (7-bit prefix, no Huffman) is all these headers need
        raise ValueError(f"header string of {len(value)} bytes: too long for one HPACK length byte")
    return bytes((len(value),)) + value


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name (RFC 7541, 6.2.2)."""
    return b"\x00" + _string(name) + _string(value)


#: ``:status: 200`` (static table index 8) and ``content-type: application/grpc`` (a literal without
#: indexing on the static table's name 31: prefix 0x0f, then 31 - 15 = 16)
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _string(b"application/grpc")


class _Template:
    """The bytes of one answer for any stream: the frames with a placeholder where the stream id goes."""

    def __init__(self, frames: list[tuple[int, int, bytes]]) -> None:
        self.parts: list[bytes] = []
        self.size = 0  # DATA payload bytes: what the answer takes of the client's connection window
        head = b""
        for kind, flags, payload in frames:
            self.parts.append(head + len(payload).to_bytes(3, "big") + bytes((kind, flags)))
            head = payload
            if kind == DATA:
                self.size += len(payload)
        self.tail = head

    def render(self, stream: int) -> bytes:
        sid = stream.to_bytes(4, "big")
        return sid.join(self.parts) + sid + self.tail


def answer_templates(reply: bytes) -> tuple[_Template, _Template]:
    """(the fixed reply, UNIMPLEMENTED): every stream's answer bar its id."""
    ok = _Template([
        (HEADERS, END_HEADERS, RESPONSE_HEADERS),
        (DATA, 0, b"\x00" + len(reply).to_bytes(4, "big") + reply),
        (HEADERS, END_HEADERS | END_STREAM, literal(b"grpc-status", b"0")),
    ])
    # trailers-only: the status in the one HEADERS frame that ends the stream
    refused = _Template([(HEADERS, END_HEADERS | END_STREAM, RESPONSE_HEADERS
                          + literal(b"grpc-status", str(UNIMPLEMENTED).encode())
                          + literal(b"grpc-message", b"the frame-level target serves only a fixed reply"))])
    return ok, refused


class FrameTargetProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, ok: _Template, refused: _Template) -> None:
        self._ok, self._refused = ok, refused
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self._bodies: dict[int, int] = {}  # open stream -> DATA bytes received on it, padding aside
        self._received = 0  # DATA bytes since the connection's receive window was last topped up
        self._send_window = DEFAULT_WINDOW  # what the client lets this side send on the connection
        self._waiting: deque[tuple[_Template, int]] = deque()  # answers held for the client's window

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        # the server preface: streams open with the largest window; then the connection's, likewise
        settings = SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + MAX_WINDOW.to_bytes(4, "big")
        transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if not self._preface:
            if len(buf) < len(PREFACE):
                return
            if buf[:len(PREFACE)] != PREFACE:
                self._close()
                return
            del buf[:len(PREFACE)]
            self._preface = True
        out = bytearray()
        pos, end = 0, len(buf)
        while end - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            start = pos + 9
            if end - start < length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = int.from_bytes(buf[pos + 5:start], "big") & MAX_WINDOW
            pos = start + length
            if kind == DATA:
                self._received += length
                padding = 1 + buf[start] if flags & PADDED and length else 0
                self._bodies[stream] = self._bodies.get(stream, 0) + length - padding
                if flags & END_STREAM:
                    self._answer(stream, out)
            elif kind == HEADERS:
                if flags & END_STREAM:  # no message at all
                    self._answer(stream, out)
            elif kind == SETTINGS:
                if not flags & ACK:
                    out += frame(SETTINGS, ACK, 0)
            elif kind == PING:
                if not flags & ACK:
                    out += frame(PING, ACK, 0, bytes(buf[start:pos]))
            elif kind == WINDOW_UPDATE:
                if stream == 0 and length == 4:
                    self._send_window += int.from_bytes(buf[start:pos], "big") & MAX_WINDOW
                    self._flush(out)
            elif kind == RST_STREAM:
                self._bodies.pop(stream, None)
            elif kind == GOAWAY:
                self._write(out)
                self._close()
                return
            # PRIORITY, CONTINUATION, unknown types: nothing to do
        del buf[:pos]
        if self._received >= _TOP_UP:
            out += frame(WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big"))
            self._received = 0
        self._write(out)

    def _answer(self, stream: int, out: bytearray) -> None:
        # an empty message is its 5-byte gRPC prefix alone
        template = self._ok if self._bodies.pop(stream, 0) > _GRPC_PREFIX else self._refused
        self._waiting.append((template, stream))
        self._flush(out)

    def _flush(self, out: bytearray) -> None:
        """Render the answers in order while the client's connection window takes them."""
        waiting = self._waiting
        while waiting and waiting[0][0].size <= self._send_window:
            template, stream = waiting.popleft()
            self._send_window -= template.size
            out += template.render(stream)

    def _write(self, out: bytearray) -> None:
        if out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(bytes(out))

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None


async def start(reply: bytes, host: str = "127.0.0.1", port: int = 0) -> tuple[asyncio.Server, int]:
    """Serve ``reply`` (a serialized response message) on ``host:port``; -> (server, bound port)."""
    ok, refused = answer_templates(reply)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FrameTargetProtocol(ok, refused), host, port)
    bound = int(server.sockets[0].getsockname()[1])
    return server, bound


async def stop(server: asyncio.Server) -> None:
    server.close()
    with contextlib.suppress(Exception):
        await server.wait_closed()
