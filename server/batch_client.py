"""`blendserve batches list|watch|get ID`: a terminal client over the HTTP API, for people who do
not write Python. It finds the server and key as the OpenAI SDK does: `--base-url` / `--api-key`,
else OPENAI_BASE_URL / OPENAI_API_KEY (the base URL ends in /v1), else the local server.

On a terminal `watch` draws one progress bar per batch (rich); piped into a file or a log it
prints a line whenever a batch's status or count changes. Exit codes: 0 done, 1 the API answered
an error, 2 the server cannot be reached, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Self

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Table

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
TIMEOUT_S = 30.0


class ClientError(Exception):
    """The API answered with an error envelope (exit 1) or could not be reached (exit 2)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Api:
    base_url: str  # ends in /v1, no trailing slash
    api_key: str | None

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        params = {k: v for k, v in query.items() if v is not None}
        url = f"{self.base_url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return dict(json.load(response))
        except urllib.error.HTTPError as e:
            raise ClientError(f"HTTP {e.code}: {_error_message(e)}", 1) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ClientError(f"cannot reach {self.base_url}: {reason}", 2) from None

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.get(f"/batches/{urllib.parse.quote(batch_id, safe='')}")

    def batches(self, limit: int) -> list[dict[str, Any]]:
        """The newest `limit` batches (following `has_more` pages)."""
        out: list[dict[str, Any]] = []
        after = None
        while len(out) < limit:
            page = self.get("/batches", limit=min(100, limit - len(out)), after=after)
            out.extend(page.get("data", []))
            if not page.get("has_more") or not page.get("data"):
                break
            after = page["data"][-1]["id"]
        return out


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read() or b"{}")
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(e.reason)


def api_from(args: argparse.Namespace) -> Api:
    base = args.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return Api(base.rstrip("/"), key)


# --- rendering ---------------------------------------------------------------------------------


def progress(batch: dict[str, Any]) -> tuple[int, int]:
    """(finished requests, total requests)."""
    counts = batch.get("request_counts") or {}
    return int(counts.get("completed", 0)) + int(counts.get("failed", 0)), int(
        counts.get("total", 0)
    )


def bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total) if total else 0
    return "█" * filled + "░" * (width - filled)


def _when(ts: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def list_table(batches: Iterable[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold")
    for column in (
        "batch",
        "status",
        "progress",
        "ok",
        "failed",
        "total",
        "tokens in/out",
        "created",
    ):
        table.add_column(column, no_wrap=True)
    for b in batches:
        done, total = progress(b)
        counts = b.get("request_counts") or {}
        usage = b.get("usage") or {}
        pct = f"{100 * done / total:5.1f}%" if total else "     -"
        table.add_row(
            b["id"],
            b["status"],
            f"{bar(done, total)} {pct}",
            str(counts.get("completed", 0)),
            str(counts.get("failed", 0)),
            str(total),
            f"{usage.get('input_tokens', 0)}/{usage.get('output_tokens', 0)}",
            _when(b.get("created_at")),
        )
    return table


def describe(b: dict[str, Any]) -> list[str]:
    done, total = progress(b)
    counts = b.get("request_counts") or {}
    usage = b.get("usage") or {}
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    lines = [
        f"id          {b['id']}",
        f"status      {b['status']}",
        f"progress    {bar(done, total)} {done}/{total}",
        f"requests    {counts.get('completed', 0)} completed, {counts.get('failed', 0)} failed",
        f"endpoint    {b.get('endpoint')}  model {b.get('model') or '-'}",
        (
            f"tokens      {usage.get('input_tokens', 0)} in ({cached} cached), "
            f"{usage.get('output_tokens', 0)} out"
        ),
        (
            f"files       input {b.get('input_file_id')}  "
            f"output {b.get('output_file_id') or '-'}  errors {b.get('error_file_id') or '-'}"
        ),
        f"created     {_when(b.get('created_at'))}  expires {_when(b.get('expires_at'))}",
    ]
    for stamp in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at"):
        if b.get(stamp):
            lines.append(f"{stamp:<12}{_when(b[stamp])}")
    if b.get("metadata"):
        lines.append("metadata    " + ", ".join(f"{k}={v}" for k, v in b["metadata"].items()))
    for err in ((b.get("errors") or {}).get("data") or [])[:20]:
        lines.append(f"error       line {err.get('line')}: {err.get('code')}: {err.get('message')}")
    return lines


# --- commands -----------------------------------------------------------------------------------


def cmd_list(api: Api, args: argparse.Namespace, console: Console) -> int:
    batches = api.batches(args.limit)
    if args.json:
        console.print_json(json.dumps(batches))
    elif not batches:
        console.print("no batches")
    else:
        console.print(list_table(batches))
    return 0


def cmd_get(api: Api, args: argparse.Namespace, console: Console) -> int:
    batch = api.batch(args.id)
    if args.json:
        console.print_json(json.dumps(batch))
    else:
        for line in describe(batch):
            console.print(line, highlight=False, markup=False)
    return 0


def cmd_watch(api: Api, args: argparse.Namespace, console: Console) -> int:
    """Follow the named batches (default: every unfinished one) until each is terminal."""
    ids = list(args.ids) or [b["id"] for b in api.batches(100) if b["status"] not in TERMINAL]
    if not ids:
        console.print("no unfinished batches")
        return 0
    watcher = _BarWatch(console) if console.is_terminal else _LineWatch(console)
    with watcher:
        while True:
            batches = [api.batch(i) for i in ids]
            for b in batches:
                watcher.show(b)
            if all(b["status"] in TERMINAL for b in batches):
                return 0
            time.sleep(args.interval)


class _BarWatch:
    """One rich progress bar per batch, redrawn in place."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:>6.0f}/{task.total:<6.0f}"),
            TextColumn("{task.fields[status]}"),
            console=console,
        )
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def show(self, b: dict[str, Any]) -> None:
        done, total = progress(b)
        if b["id"] not in self.tasks:
            self.tasks[b["id"]] = self.progress.add_task(b["id"], total=total or None, status="")
        self.progress.update(
            self.tasks[b["id"]], completed=done, total=total or None, status=b["status"]
        )


class _LineWatch:
    """Not a terminal: one line per change, fit for logs and pipes."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.seen: dict[str, tuple[str, int, int]] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def show(self, b: dict[str, Any]) -> None:
        done, total = progress(b)
        state = (b["status"], done, total)
        if self.seen.get(b["id"]) != state:
            self.seen[b["id"]] = state
            self.console.print(
                f"{b['id']} {b['status']} {bar(done, total)} {done}/{total}",
                highlight=False,
                markup=False,
            )


def batches_main(args: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal:  # a pipe or a log: whole rows, never wrapped at 80 columns
        console = Console(width=240)
    commands = {"list": cmd_list, "get": cmd_get, "watch": cmd_watch}
    try:
        return commands[args.verb](api_from(args), args, console)
    except ClientError as e:
        Console(stderr=True).print(f"error: {e}", highlight=False, markup=False)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
