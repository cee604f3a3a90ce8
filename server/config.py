"""Settings, read once at the edge from BLENDSERVE_* environment variables (pydantic-settings)."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_PROJECT = "default"  # every object's project when no API keys are configured


class WebhookTarget(BaseModel):
    """Where one project's batch events go, and the Standard Webhooks secret that signs them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str  # http(s) URL the events are POSTed to
    secret: str = Field(repr=False)  # "whsec_" + base64 of the HMAC key

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"webhook url {v!r} is not an http(s) URL")
        return v

    @field_validator("secret")
    @classmethod
    def _whsec(cls, v: str) -> str:
        if not v.startswith("whsec_"):
            raise ValueError("webhook secret must start with 'whsec_'")
        try:
            key = base64.b64decode(v.removeprefix("whsec_"), validate=True)
        except binascii.Error:
            raise ValueError("webhook secret after 'whsec_' is not valid base64") from None
        if not key:
            raise ValueError("webhook secret is empty after 'whsec_'")
        return v

    @property
    def key(self) -> bytes:
        """The HMAC-SHA256 key: the secret's base64 part, decoded."""
        return base64.b64decode(self.secret.removeprefix("whsec_"))


class Settings(BaseSettings):
    # Inputs stay out of error messages: DATABASE_URL, API_KEYS and WEBHOOKS carry secrets.
    model_config = SettingsConfigDict(
        env_prefix="BLENDSERVE_", extra="ignore", hide_input_in_errors=True
    )

    data_dir: Path = Path("./data")
    database_url: str | None = None  # None = sqlite:///<data_dir>/blendserve.db
    redis_url: str | None = None  # None = in-process queue (SQL row claims)
    api_keys: str | None = None  # "key:project,key:project"; None = no auth (loopback only)
    model: str = "smollm2-135m-instruct"  # served model: a name, an HF folder, a .gguf, dummy:<shape>
    policy: str = "blend"  # admission policy the worker uses: fcfs | dfs | blend
    host: str = "127.0.0.1"
    port: int = 8000

    # Limits
    max_file_bytes: int = 200 * 1024 * 1024
    max_batch_lines: int = 50_000
    max_metadata_pairs: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 512

    # Engine
    # tokens (decode + prefill) per engine step; None = by device: 8192 on a CPU, 2048 on a GPU
    max_batch_tokens: int | None = Field(default=None, ge=1)
    kv_memory_bytes: int | None = Field(default=None, ge=1)  # None = the runtime's default budget
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # auto (flashinfer on CUDA if installed) | torch | flashinfer
    # CUDA + flashinfer: two nano-batches per step on two streams; off by default, slower than
    # one stream where it was measured (runtime.engine.EngineConfig.overlap)
    overlap: bool = False
    # Device profile for the planner: auto = cached under DATA_DIR/profiles or measured on first
    # use; a path = that file (`blendserve profile --out`); none = do not measure
    profile: str = "auto"

    # Abuse limits (server/limits.py, server/rate_limit.py)
    rate_limit_per_minute: int | None = Field(default=None, ge=1)  # per project; None = off
    rate_limit_burst: int | None = Field(default=None, ge=1)  # None = rate_limit_per_minute
    body_idle_timeout_seconds: float = Field(default=60.0, gt=0)  # no body bytes this long: 408
    body_min_bytes_per_second: int = Field(default=1024, ge=0)  # average, after the idle window
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)  # all request headers: else 431

    # Observability (server/metrics.py)
    metrics_key: str | None = None  # Bearer for GET /metrics; None = any API key (or none)
    metrics_snapshot_seconds: float = Field(default=1.0, gt=0)  # how often a worker publishes

    # Worker
    worker_poll_seconds: float = Field(default=0.5, gt=0)
    worker_stall_seconds: float = Field(default=60.0, gt=0)  # a claim idle this long is taken over
    # A database/Redis outage or a full disk: retry a journal write this long before pausing the
    # batch (it resumes when the dependency is back; it is never failed for an outage)
    outage_retry_seconds: float = Field(default=30.0, ge=0)
    # Several batches on one engine (server/shared_run.py). A worker claims more batches while
    # the requests it holds (prompt + max_tokens each) stay under this budget; a batch of a
    # higher-priority project, or one past its expires_at, joins whatever the budget.
    worker_max_inflight_tokens: int = Field(default=1 << 20, ge=1)
    project_max_inflight_tokens: int | None = Field(default=None, ge=1)  # per project; None = off
    project_priorities: str | None = None  # "project:level,...": higher runs first (default 0)
    # With Redis and k >= 2 live workers, a batch of at least this many lines is cut into k
    # shards of equal predicted work that the workers run side by side (server/shards.py).
    shard_min_lines: int = Field(default=1000, ge=2)

    # Webhooks (server/webhooks.py): JSON {"project": {"url": ..., "secret": "whsec_..."}}
    webhooks: Annotated[dict[str, WebhookTarget], NoDecode] = Field(default_factory=dict)

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("profile")
    @classmethod
    def _profile_choice(cls, v: str) -> str:
        if v not in ("auto", "none") and not Path(v).expanduser().is_file():
            raise ValueError(f"BLENDSERVE_PROFILE {v!r} is neither auto, none nor a file")
        return v if v in ("auto", "none") else str(Path(v).expanduser().resolve())

    @field_validator("project_priorities")
    @classmethod
    def _priorities_parse(cls, v: str | None) -> str | None:
        _parse_priorities(v)
        return v

    @field_validator("webhooks", mode="before")
    @classmethod
    def _webhooks_json(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v  # already a dict (Settings(**fields) in a spawned worker)
        try:
            return json.loads(v) if v.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"BLENDSERVE_WEBHOOKS is not valid JSON: {e}") from None

    @model_validator(mode="after")
    def _webhooks_name_known_projects(self) -> Settings:
        """A misspelt project would silently never fire: refuse it at start."""
        projects = set(self.key_projects.values()) or {DEFAULT_PROJECT}
        unknown = sorted(set(self.webhooks) - projects)
        if unknown:
            raise ValueError(
                f"BLENDSERVE_WEBHOOKS names projects no API key maps to: {unknown}; "
                f"known: {sorted(projects)}"
            )
        return self

    @model_validator(mode="after")
    def _refuse_open_server_off_loopback(self) -> Settings:
        if not self.api_keys and not _is_loopback(self.host):
            raise ValueError(
                f"refusing to serve without BLENDSERVE_API_KEYS on non-loopback host {self.host!r}"
            )
        return self

    @cached_property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'blendserve.db'}"

    @cached_property
    def key_projects(self) -> dict[str, str]:
        """API key → project; empty when auth is off."""
        out: dict[str, str] = {}
        for pair in (self.api_keys or "").split(","):
            pair = pair.strip()
            if not pair:
                continue
            key, sep, project = pair.partition(":")
            if not sep or not key or not project:
                raise ValueError(f"BLENDSERVE_API_KEYS entry {pair!r} is not key:project")
            out[key] = project
        return out


    @cached_property
    def priorities(self) -> dict[str, int]:
        """Project → priority level (projects not named are at 0)."""
        return _parse_priorities(self.project_priorities)


def _parse_priorities(v: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for pair in (v or "").split(","):
        if not pair.strip():
            continue
        project, sep, level = pair.strip().rpartition(":")
        try:
            out[project] = int(level)
        except ValueError:
            project = ""
        if not sep or not project:
            raise ValueError(f"BLENDSERVE_PROJECT_PRIORITIES entry {pair!r} is not project:level")
    return out


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
