"""Streaming multipart receiver for POST /v1/files. The file part goes straight from the socket to
storage in constant memory, with the byte and line limits checked as it arrives; the framework's
form parser is not used because it spools whole files before a route sees them."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from server.errors import APIError, bad_request
from server.storage import PendingFile

MAX_FIELD_BYTES = 64 * 1024  # a non-file field (purpose, expires_after[...])
MAX_FIELDS = 32
DRAIN_SLACK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int  # the file part, bytes
    max_batch_lines: int  # lines, enforced when purpose=batch


@dataclass
class ReceivedUpload:
    """What arrived: the text fields and, when a `file` part came, its name, size and lines."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    bytes: int = 0
    lines: int = 0
    complete: bool = False  # the closing boundary arrived


class _Receiver:
    """python-multipart callbacks; file bytes are queued and written between parser feeds."""

    def __init__(self, pending: PendingFile, limits: UploadLimits) -> None:
        self.pending = pending
        self.limits = limits
        self.result = ReceivedUpload()
        self.rejection: APIError | None = None  # set once; the rest of the body is drained
        self.to_write: list[bytes] = []
        self._last_byte = b""
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""
        self._name: str | None = None
        self._is_file = False
        self._value = bytearray()

    # -- parser callbacks -------------------------------------------------------------------
    def on_part_begin(self) -> None:
        self._disposition, self._name, self._is_file = b"", None, False
        self._value = bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        if len(self._header_value) > MAX_FIELD_BYTES:
            raise bad_request("A multipart header is too long.")

    def on_header_end(self) -> None:
        if self._header_name.strip().lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name, self._header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise bad_request("Each multipart part needs a Content-Disposition name.")
        self._name = _text(options[b"name"], "part name")
        if self._name == "file":
            if self.result.filename is not None:
                raise bad_request("Only one 'file' part may be uploaded.", param="file")
            self._is_file = True
            self.result.filename = (
                _text(options.get(b"filename", b"upload"), "filename") or "upload"
            )
        elif len(self.result.fields) >= MAX_FIELDS:
            raise bad_request("Too many form fields.")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if not chunk:
            return
        if not self._is_file:
            self._value += chunk
            if len(self._value) > MAX_FIELD_BYTES:
                raise bad_request(f"Form field '{self._name}' is too long.", param=self._name)
            return
        self.result.bytes += len(chunk)
        self.result.lines += chunk.count(b"\n")
        self._last_byte = chunk[-1:]
        if self.rejection is None:
            self._check_limits()
        if self.rejection is None:
            self.to_write.append(chunk)

    def on_part_end(self) -> None:
        if self._is_file:
            if self.result.bytes and self._last_byte != b"\n":
                self.result.lines += 1  # a last line without a newline still counts
            self._is_file = False
        elif self._name is not None:
            self.result.fields[self._name] = _text(bytes(self._value), f"field '{self._name}'")

    def on_end(self) -> None:
        self.result.complete = True

    # -- limits ----------------------------------------------------------------------------
    def _check_limits(self) -> None:
        if self.result.bytes > self.limits.max_bytes:
            self.rejection = APIError(
                413,
                f"File is too large: the limit is {self.limits.max_bytes} bytes.",
                param="file",
                code="file_too_large",
            )
        elif (
            self.result.fields.get("purpose") == "batch"
            and self.result.lines > self.limits.max_batch_lines
        ):
            self.rejection = too_many_lines(self.limits.max_batch_lines)


def too_many_lines(limit: int) -> APIError:
    return bad_request(
        f"A batch input file may have at most {limit} lines.", param="file", code="too_many_tasks"
    )


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(f"The {what} is not valid UTF-8.") from None


async def receive_upload(
    request: Request, pending: PendingFile, limits: UploadLimits
) -> ReceivedUpload:
    """Parse the multipart body of `request`, writing the `file` part into `pending` (left
    uncommitted). Raises APIError for a malformed body or a broken limit; after a limit breaks
    the rest of the body is read and dropped (up to a cap), so the client receives the answer
    instead of a reset connection."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data":
        raise bad_request("Uploads must be multipart/form-data with 'file' and 'purpose' fields.")
    boundary = params.get(b"boundary")
    if not boundary:
        raise bad_request("The multipart/form-data Content-Type has no boundary.")
    rx = _Receiver(pending, limits)
    drain_cap = 2 * limits.max_bytes + DRAIN_SLACK_BYTES
    received = 0
    try:
        parser = MultipartParser(
            boundary,
            {
                "on_part_begin": rx.on_part_begin,
                "on_part_data": rx.on_part_data,
                "on_part_end": rx.on_part_end,
                "on_header_field": rx.on_header_field,
                "on_header_value": rx.on_header_value,
                "on_header_end": rx.on_header_end,
                "on_headers_finished": rx.on_headers_finished,
                "on_end": rx.on_end,
            },
        )
        async for chunk in request.stream():
            received += len(chunk)
            parser.write(chunk)
            if rx.to_write:
                data = b"".join(rx.to_write)
                rx.to_write.clear()
                await anyio.to_thread.run_sync(pending.write, data)
            if rx.rejection is not None and received > drain_cap:
                break  # a client that keeps sending gets the answer and a closed connection
        else:
            parser.finalize()
    except FormParserError:
        raise bad_request("The multipart/form-data body is malformed.") from None
    except ClientDisconnect:
        raise bad_request("The upload was interrupted.") from None
    if rx.rejection is not None:
        raise rx.rejection
    if not rx.result.complete:
        raise bad_request("The multipart/form-data body ended before its closing boundary.")
    return rx.result
