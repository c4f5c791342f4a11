"""The frame-level fixed-reply target (recpipe.querygen.frametarget), in its own process as ``recpipe
bench querygen`` runs it, against real clients on loopback: grpc's, and a raw socket speaking HTTP/2
frames where the test needs to hold the client's side."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest

from recpipe.errors import UsageError
from recpipe.querygen import frametarget as ft
from recpipe.querygen.testserver import TestServerConfig, TestServerProcess, fixed_reply_bytes
from recpipe.v1 import info_pb2, info_pb2_grpc, recommend_pb2, recommend_pb2_grpc

RECOMMEND = "/recpipe.v1.RecommendService/Recommend"


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    with TestServerProcess(TestServerConfig({}, fixed_reply=True, frames=True)) as server:
        yield server.target


def test_a_grpc_client_gets_the_fixed_reply_and_unimplemented_for_an_empty_message(target: str) -> None:
    want = recommend_pb2.RecommendResponse.FromString(fixed_reply_bytes())
    with grpc.insecure_channel(target) as channel:
        stub = recommend_pb2_grpc.RecommendServiceStub(channel)
        got = stub.Recommend(recommend_pb2.RecommendRequest(user_id=3, num_candidates=500), timeout=5)
        assert got == want and list(got.item_ids) == list(range(10))
        with pytest.raises(grpc.RpcError) as e:
            info_pb2_grpc.InfoServiceStub(channel).GetInfo(info_pb2.GetInfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
        assert "fixed reply" in (e.value.details() or "")  # type: ignore[attr-defined]
        # and the connection still serves
        assert stub.Recommend(recommend_pb2.RecommendRequest(user_id=4), timeout=5) == want


def test_thousands_of_calls_in_flight_and_a_message_larger_than_a_default_window(target: str) -> None:
    reply = fixed_reply_bytes()
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(RECOMMEND)  # raw bytes both ways
        # 3,000 answers are ~10x the 65,535-byte window a client starts the connection with
        futures = [call.future(b"\x08" + bytes((i % 100 + 1,)), timeout=30) for i in range(3000)]
        assert all(f.result() == reply for f in futures)
        # a 300-kB request: past the 65,535-byte default stream and connection windows
        assert call(b"\x08\x01" + b"\x00" * 300_000, timeout=10) == reply


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos:pos + 3], "big")
        if len(data) - pos - 9 < length:
            break
        out.append((data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5:pos + 9], "big"),
                    data[pos + 9:pos + 9 + length]))
        pos += 9 + length
    return out


def _read_frames(sock: socket.socket, want: int, timeout: float = 5.0) -> list[tuple[int, int, int, bytes]]:
    """Frames from ``sock`` until ``want`` of them have come (fewer if it goes quiet for ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    while len(_frames(data)) < want:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
    return _frames(data)


def test_answers_wait_for_the_clients_window_and_follow_its_update(target: str) -> None:
    reply = fixed_reply_bytes()
    per_answer = 5 + len(reply)  # DATA payload: the gRPC prefix and the message
    fit = ft.DEFAULT_WINDOW // per_answer
    streams = fit + 40
    host, port = target.rsplit(":", 1)

    def client() -> tuple[int, int, bool]:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(ft.PREFACE + ft.frame(ft.SETTINGS, 0, 0) + ft.frame(ft.PING, 0, 0, b"recpipe!"))
            requests = b""
            for i in range(streams):
                sid = 2 * i + 1
                requests += ft.frame(ft.HEADERS, ft.END_HEADERS, sid, b"\x83")  # never decoded
                requests += ft.frame(ft.DATA, ft.END_STREAM, sid, b"\x00\x00\x00\x00\x02\x08\x01")
            sock.sendall(requests)
            # server preface (SETTINGS, WINDOW_UPDATE), the ACKs of our SETTINGS and PING, 3 frames an answer
            before = _read_frames(sock, 4 + 3 * fit + 1, timeout=1.0)
            assert (ft.PING, ft.ACK, 0, b"recpipe!") in before
            sock.sendall(ft.frame(ft.WINDOW_UPDATE, 0, 0, (1 << 20).to_bytes(4, "big")))
            after = _read_frames(sock, 3 * (streams - fit))
            ended = {s for k, f, s, _ in before + after if k == ft.HEADERS and f & ft.END_STREAM}
            return (sum(1 for k, *_ in before if k == ft.DATA), sum(1 for k, *_ in after if k == ft.DATA),
                    ended == {2 * i + 1 for i in range(streams)})

    sent_before, sent_after, all_ended = client()
    assert sent_before == fit  # no more than the window allowed
    assert sent_after == streams - fit and all_ended


def test_a_client_that_breaks_the_framing_is_disconnected(target: str) -> None:
    host, port = target.rsplit(":", 1)

    def client() -> bytes:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(5)
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
            return data

    data = client()  # returns: the target closed the connection
    assert [k for k, *_ in _frames(data)] == [ft.SETTINGS, ft.WINDOW_UPDATE]  # its preface, nothing else


def test_frames_is_a_form_of_the_fixed_reply_and_a_stall_signal_does_not_kill_it() -> None:
    with pytest.raises(UsageError, match="--frames"):
        TestServerConfig({}, frames=True)
    with TestServerProcess(TestServerConfig({}, fixed_reply=True, frames=True)) as server:
        server.stall()  # SIGUSR1: a freeze of no length, as in the grpc.aio form
        with grpc.insecure_channel(server.target) as channel:
            assert channel.unary_unary(RECOMMEND)(b"\x08\x05", timeout=10) == fixed_reply_bytes()


def test_a_message_split_over_padded_frames_is_told_from_an_empty_one(target: str) -> None:
    host, port = target.rsplit(":", 1)

    def data(sid: int, payload: bytes, end: bool, pad: int = 0) -> bytes:
        flags = (ft.END_STREAM if end else 0) | (ft.PADDED if pad else 0)
        return ft.frame(ft.DATA, flags, sid, (bytes((pad,)) + payload + b"\0" * pad) if pad else payload)

    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(ft.PREFACE + ft.frame(ft.SETTINGS, 0, 0)
                     # stream 1: a 2-byte message, its prefix cut in two, the first part padded
                     + ft.frame(ft.HEADERS, ft.END_HEADERS, 1, b"\x83")
                     + data(1, b"\x00\x00\x00", False, pad=7) + data(1, b"\x00\x02\x08\x01", True)
                     # stream 3 reset before it ends, never answered; stream 5: an empty message, padded
                     + ft.frame(ft.HEADERS, ft.END_HEADERS, 3, b"\x83") + data(3, b"\x00\x00\x00", False)
                     + ft.frame(ft.RST_STREAM, 0, 3, (8).to_bytes(4, "big"))
                     + ft.frame(ft.HEADERS, ft.END_HEADERS, 5, b"\x83") + data(5, b"\x00" * 5, True, pad=4))
        frames = _read_frames(sock, 3 + 3 + 1)
    by_stream: dict[int, list[int]] = {}
    for kind, _, sid, _ in frames:
        by_stream.setdefault(sid, []).append(kind)
    assert by_stream[1] == [ft.HEADERS, ft.DATA, ft.HEADERS]  # the reply
    assert by_stream[5] == [ft.HEADERS]  # trailers only: UNIMPLEMENTED
    assert b"grpc-status\x0212" in next(p for k, _, s, p in frames if s == 5)
    assert 3 not in by_stream
