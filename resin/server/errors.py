"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with a matching status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
          500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.counted = False  # its request already has an outcome (it failed or was abandoned after admission)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param)


def _utf8(text: str | None) -> str | None:
    """Client text quoted in an error (a model name, a parameter) may hold lone surrogates: escape them, since
    the error itself must encode."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode()


def error_body(status: int, message: str, param: str | None = None) -> dict:
    message, param = _utf8(message), _utf8(param)
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def param_of_sampling_error(message: str) -> str | None:
    """'SamplingParams.top_p=1.5 is invalid: ...' -> 'top_p'."""
    if message.startswith("SamplingParams."):
        return message.split(".", 1)[1].split("=", 1)[0]
    return None
