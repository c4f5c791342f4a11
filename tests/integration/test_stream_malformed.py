"""A stream message that does not parse, on a real gRPC server over the toy feature core: the stream ends
INVALID_ARGUMENT "malformed request" once the messages before it are answered. The interceptor used to
abort the call from the request iterator, beside the stage's writes: the answer being computed was lost
(its write then failed, an "exception was never retrieved" traceback), and a status sent while a write
was in flight was refused by gRPC's core, which left the stream open with no status until its caller's
deadline (a gateway hop's stream has none)."""

from __future__ import annotations

import logging
import time

import grpc
import pytest
from toy_stages import ToyFeatureCore

from recpipe.features.servicer import FeatureStage
from recpipe.v1 import features_pb2, features_pb2_grpc

GARBAGE = b"\x0f\xff\xff"  # wire type 7: parses as no message
STREAM = "/recpipe.v1.FeatureService/AugmentUserStream"


def _message(sequence: int, users: int = 1) -> bytes:
    return features_pb2.AugmentUserBatchRequest(
        entries=[features_pb2.AugmentUserRequest(user_id=i) for i in range(users)], sequence=sequence,
    ).SerializeToString()


@pytest.fixture
def stage(servers, world):
    core = ToyFeatureCore(world)
    # workers=1: AugmentUser computes on a thread, so the loop reads the next message meanwhile
    server = servers.start(FeatureStage(lambda: core, workers=1))
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield core, channel
    finally:
        servers.stop(server)


def _stream(channel: grpc.Channel, messages: list[bytes], timeout: float = 5.0) -> tuple[list[int], grpc.RpcError]:
    """The sequences answered before the stream ended, and its error."""
    answered = []
    call = channel.stream_stream(STREAM, response_deserializer=features_pb2.AugmentUserBatchResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        for reply in call(iter(messages), timeout=timeout):
            answered.append(reply.sequence)
    return answered, info.value


def test_a_malformed_message_ends_the_stream_after_the_messages_before_it_are_answered(stage, caplog) -> None:
    core, channel = stage
    caplog.set_level(logging.WARNING)
    core.delay_s = 0.3  # message 1 is still computing when the malformed one is read
    answered, error = _stream(channel, [_message(1), GARBAGE])
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "malformed request")
    assert answered == [1]
    core.delay_s = 0.0
    # the answer is written when the malformed message comes: the status is sent, at once, every time
    for attempt in range(30):
        started = time.monotonic()
        answered, error = _stream(channel, [_message(1, 3), GARBAGE, _message(2)])
        assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "malformed request"), attempt
        assert answered == [1] and time.monotonic() - started < 2.0, attempt
    # nothing logged with a traceback, and the stage keeps serving streams
    assert not [r for r in caplog.records if r.exc_info or "never retrieved" in r.getMessage()]
    stub = features_pb2_grpc.FeatureServiceStub(channel)
    request = features_pb2.AugmentUserBatchRequest(entries=[features_pb2.AugmentUserRequest(user_id=2)], sequence=9)
    (reply,) = list(stub.AugmentUserStream(iter([request]), timeout=5))
    assert reply.sequence == 9 and reply.entries[0].ok.user_id == 2
