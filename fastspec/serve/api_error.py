"""The API's error: an OpenAI error object with its HTTP status (every serve module raises it)."""

from __future__ import annotations


class APIError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def type_name(value) -> str:
    """A JSON value's type as an error names it ("null" for None)."""
    return "null" if value is None else type(value).__name__
