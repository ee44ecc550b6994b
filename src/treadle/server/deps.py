"""Shared route dependencies: the Service built by the app's lifespan."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from treadle.server.service import Service


async def get_service(request: Request) -> Service:
    # async: FastAPI runs a plain-def dependency on a worker thread, a hop per request
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]
