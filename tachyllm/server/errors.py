"""Errors answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from tachyllm.outputs import RequestOutput
from tachyllm.server import protocol as p
from tachyllm.server.async_engine import EngineDeadError


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


def engine_dead(e: EngineDeadError, failed: bool) -> APIError:
    """`failed`: the engine failed, as opposed to being shut down."""
    # 503 either way: a failed engine makes the server exit, so a supervisor restarts it.
    code = "engine_failed" if failed else "shutting_down"
    return APIError(503, str(e), "service_unavailable_error", code=code)


def request_aborted() -> APIError:
    # Clients never see their own aborts (they hung up); this abort came from a server shutdown.
    return APIError(
        503, "the request was aborted: the server is shutting down", "service_unavailable_error", code="aborted"
    )


def request_rejected(out: RequestOutput, param: str) -> APIError:
    """The request's own input failed once it ran (finish_reason "rejected": its constraint, carried by
    `param`, broke at a token): bad input, answered as a constraint refused at compile time is."""
    return bad_request(f"{param}: {out.error}", param=param)


def request_failed(out: RequestOutput) -> APIError:
    message = out.error or "the engine failed while running this request"
    return APIError(500, message, "internal_error", code="engine_error")
