"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with a matching status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": status}}
    return JSONResponse(body, status_code=status)


def param_of_sampling_error(message: str) -> str | None:
    """'SamplingParams.top_p=1.5 is invalid: ...' -> 'top_p'."""
    if message.startswith("SamplingParams."):
        return message.split(".", 1)[1].split("=", 1)[0]
    return None
