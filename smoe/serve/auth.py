"""`--api-key`: the key every /v1 route asks for, as OpenAI's API (`Authorization: Bearer KEY`) and
Anthropic's (`x-api-key: KEY`, on /v1/messages) send it."""

from __future__ import annotations

import hmac

from fastapi import Request

from smoe.errors import SmoeError
from smoe.serve.api import ApiError

BEARER = "bearer"


def presented_key(request: Request) -> str | None:
    """The key the request carries: x-api-key on the Anthropic routes, else the bearer token."""
    if request.url.path.startswith("/v1/messages") and "x-api-key" in request.headers:
        return request.headers["x-api-key"]
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == BEARER and token.strip() else None


def usable_key(api_key: str) -> bytes:
    if not api_key or api_key != api_key.strip():  # HTTP drops a header value's outer spaces
        raise SmoeError("--api-key must not be empty, nor begin or end with spaces")
    return api_key.encode()


def key_check(api_key: str):
    """A FastAPI dependency that answers 401 unless the request carries `api_key`."""
    expected = usable_key(api_key)

    async def check(request: Request) -> None:
        key = presented_key(request)
        if key is None:
            how = "x-api-key: KEY or " if request.url.path.startswith("/v1/messages") else ""
            raise ApiError(401, f"this server needs an API key: send {how}Authorization: Bearer KEY")
        if not hmac.compare_digest(key.encode(), expected):  # constant time: the key cannot be guessed byte by byte
            raise ApiError(401, "the API key is not this server's")

    return check
