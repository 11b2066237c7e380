"""Errors answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from tachyllm.server import protocol as p


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
