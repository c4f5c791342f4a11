"""InfoService: every recpipe server says which stage it is, on which device, with which model."""

from __future__ import annotations

from collections.abc import Callable

from grpc import aio

from recpipe import __version__
from recpipe.serving.stage import StageInfo
from recpipe.v1 import info_pb2, info_pb2_grpc

SERVICE_NAME = info_pb2.DESCRIPTOR.services_by_name["InfoService"].full_name


class InfoServicer(info_pb2_grpc.InfoServiceServicer):
    def __init__(self, info: Callable[[], StageInfo]) -> None:
        self._info = info

    async def GetInfo(self, request: info_pb2.GetInfoRequest, context: aio.ServicerContext) -> info_pb2.ServiceInfo:
        i = self._info()
        return info_pb2.ServiceInfo(
            stage=i.stage,
            device=i.device,
            model_version=i.model_version,
            recpipe_version=__version__,
            threads=i.threads,
            details=i.details,
        )
