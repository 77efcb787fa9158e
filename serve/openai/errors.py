"""OpenAI-style API errors: one exception type and the JSON body every error response carries."""

from __future__ import annotations

from http import HTTPStatus

import pydantic
from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, *, status: int = HTTPStatus.BAD_REQUEST, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(message, param=param, code=code)


def internal_server_error() -> APIError:
    """The 500 for an unexpected exception: no exception text reaches the client (the server log has it)."""
    return APIError("Internal server error.", status=HTTPStatus.INTERNAL_SERVER_ERROR, type="internal_server_error")


def service_unavailable(message: str, *, retry_after_s: int, code: str) -> APIError:
    """A 503 the client may retry after ``retry_after_s`` seconds (overload, shutting down, engine stopped)."""
    return APIError(message, status=HTTPStatus.SERVICE_UNAVAILABLE, type="service_unavailable_error", code=code,
                    headers={"Retry-After": str(retry_after_s)})


def request_timeout(timeout_s: float, *, param: str | None) -> APIError:
    """A 408: the request did not finish within its timeout (``param`` "timeout" when the client set it)."""
    return APIError(f"The request did not finish within its timeout of {timeout_s:g} s and was stopped.",
                    status=HTTPStatus.REQUEST_TIMEOUT, type="timeout_error", param=param, code="request_timeout")


def engine_failed(message: str) -> APIError:
    """The 500 of a request the engine failed (a failed step, non-finite logits): ``message`` says so."""
    return APIError(message, status=HTTPStatus.INTERNAL_SERVER_ERROR, type="internal_server_error",
                    code="engine_request_failed")


_UNION_BRANCH_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_field(loc_part: str | int) -> bool:
    """Whether a pydantic error location part names a field or an index, not a union branch like `list[str]`."""
    if isinstance(loc_part, int):
        return True
    return loc_part.isidentifier() and loc_part.islower() and loc_part not in _UNION_BRANCH_NAMES


def from_validation_error(err: pydantic.ValidationError) -> APIError:
    """A 400 naming the offending field (dotted path, list indices included).

    Of several errors (one per union branch) the deepest is reported: for content given as parts, the bad part.
    """
    first = max(err.errors(), key=lambda e: len(e["loc"]))
    param = ".".join(str(part) for part in first["loc"] if _is_field(part)) or None
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    return bad_request(message, param=param, code="invalid_type" if "type" in first["type"] else "invalid_value")
