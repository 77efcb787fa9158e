"""OpenAI-style API errors: one exception type and the JSON body every error response carries."""

from __future__ import annotations

from http import HTTPStatus

import pydantic
from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, *, status: int = HTTPStatus.BAD_REQUEST, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(message, param=param, code=code)


def internal_server_error() -> APIError:
    """The 500 for an unexpected exception: no exception text reaches the client (the server log has it)."""
    return APIError("Internal server error.", status=HTTPStatus.INTERNAL_SERVER_ERROR, type="internal_server_error")


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
