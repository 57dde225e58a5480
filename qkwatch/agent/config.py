"""The agent's settings: explicit argument, then environment variable, then default, then validate.

:func:`qkwatch.agent.attach` takes every setting as a flat keyword (``every=``, ``sample_rows=``,
``flush_seconds=``...). :meth:`AgentConfig.resolve` reads the nine the environment may give
(:class:`AgentEnvironment`, ``QKWATCH_URL``... as the collector reads its own with
pydantic-settings) and hands each remaining keyword to the component that owns it: the probe
(:class:`qkwatch.agent.probe.probe.ProbeConfig`), the spool
(:class:`qkwatch.agent.shipping.disk_spool.SpoolConfig`), the sender
(:class:`qkwatch.agent.shipping.shipper.SenderConfig`), the lambdas
(:class:`qkwatch.agent.lambdas.lambdas.LambdasConfig`) and the sinks
(:class:`qkwatch.agent.sinks.config.SinkConfig`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from qkwatch.agent.checks import SettingError, cadences, positive_ints, positive_seconds
from qkwatch.agent.lambdas.lambdas import LambdasConfig
from qkwatch.agent.probe.probe import ProbeConfig
from qkwatch.agent.shipping.disk_spool import SpoolConfig
from qkwatch.agent.shipping.shipper import SenderConfig
from qkwatch.agent.shipping.transport import clean_token
from qkwatch.agent.sinks.config import SinkConfig
from qkwatch.contract.values import check_notes, tag_set

NAME = re.compile(r"^[^\s/\x00-\x1f\x7f]{1,200}$")
COMPONENTS = {
    "probe": ProbeConfig,
    "spooling": SpoolConfig,
    "sender": SenderConfig,
    "lambdas": LambdasConfig,
    "sinking": SinkConfig,
}
"""AgentConfig's component slots and their configs; every setting of theirs is also a keyword of attach()."""


class AgentEnvironment(BaseSettings):
    """The settings the environment may give; an unset or empty variable gives nothing (None)."""

    model_config = SettingsConfigDict(case_sensitive=True, env_ignore_empty=True, extra="ignore")

    url: str | None = Field(None, validation_alias="QKWATCH_URL")
    token: str | None = Field(None, validation_alias="QKWATCH_TOKEN")
    project: str | None = Field(None, validation_alias="QKWATCH_PROJECT")
    run: str | None = Field(None, validation_alias="QKWATCH_RUN")
    spool: str | None = Field(None, validation_alias="QKWATCH_SPOOL")
    every: int | None = Field(None, validation_alias="QKWATCH_EVERY")
    tags: str | None = Field(None, validation_alias="QKWATCH_TAGS")
    notes: str | None = Field(None, validation_alias="QKWATCH_NOTES")
    sinks: str | None = Field(None, validation_alias="QKWATCH_SINKS")

    @classmethod
    def variable(cls, key: str) -> str:
        """The environment variable of setting ``key``."""
        alias = cls.model_fields[key].validation_alias
        assert isinstance(alias, str), "every field above names one variable"
        return alias

    @classmethod
    def read(cls) -> dict[str, Any]:
        """The settings the environment gives, by setting name.

        Raises:
            ValueError: naming the variable, its value and the setting, for a value of the wrong type.
        """
        try:
            return cls().model_dump(exclude_none=True)
        except ValidationError as exc:
            error = exc.errors()[0]
            var = error["loc"][0]
            key = next(k for k in cls.model_fields if cls.variable(k) == var)
            raise ValueError(f"{var}={error['input']!r}: {key}: {error['msg']}") from None


@dataclass
class AgentConfig:
    """Every setting of the agent; the lifecycle's own here, each component's in its config."""

    url: str | None = None
    """Collector base URL (``QKWATCH_URL``); None works offline: everything stays in the spool."""
    token: str | None = field(default=None, repr=False)
    """Bearer token with the ``ingest`` scope (and ``read`` for lambdas) (``QKWATCH_TOKEN``); surrounding
    whitespace (a file's trailing newline) is stripped. Never shown in a log, repr or error."""
    project: str = "default"
    """Project of the run (``QKWATCH_PROJECT``)."""
    run: str | None = None
    """Run name (``QKWATCH_RUN``); the same project+name resumes a run. Default: generated."""
    spool: str = ".qkwatch/spool"
    """Spool root (``QKWATCH_SPOOL``); each run and rank writes under ``<spool>/<project>/<run>/rank-<r>``."""
    every: int = 50
    """Report cadence in steps: activation metrics on steps divisible by it (``QKWATCH_EVERY``)."""
    weight_every: int | None = None
    """Cadence of the weight metrics (QKAI, stable rank, ...); default ``every``."""
    spectra_every: int | None = None
    """Cadence of the projection SVDs (norms, ``wk_erank``); default 10 x ``weight_every``; 0 = never."""
    request_timeout: float = 10.0
    """Seconds for one HTTP request (connect: at most 3)."""
    distributed: bool | None = None
    """Share layers and lambdas over the ranks of ``torch.distributed`` (default: when it is
    initialised with more than one rank); False makes this agent see only its own process."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's config sent to the collector (recipe, model shape, ``schedule`` parameters)."""
    tags: tuple[str, ...] = ()
    """Tags of the run (``QKWATCH_TAGS``, comma-separated: ``baseline,lr=3e-4``); a list, or one string of
    comma-separated tags. Each 1-64 letters, digits and ``_.:/=-``, at most 50; kept sorted, each once. A
    resume adds them to the run's tags and never removes one (``qkwatch runs untag`` does)."""
    notes: str | None = None
    """Notes of the run (``QKWATCH_NOTES``): free text, at most 10 KiB. Stored when the run has none; a
    resume keeps notes already set (``qkwatch runs note`` changes them)."""
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    """What a report step samples."""
    spooling: SpoolConfig = field(default_factory=SpoolConfig)
    """How each rank's spool is cut and capped."""
    sender: SenderConfig = field(default_factory=SenderConfig)
    """How reports are batched and retried."""
    lambdas: LambdasConfig = field(default_factory=LambdasConfig)
    """How lambdas are fetched, exchanged and trusted."""
    sinking: SinkConfig = field(default_factory=SinkConfig)
    """Where reports go besides the collector (``sinks``, ``QKWATCH_SINKS``), and the heatmaps' cadence."""

    def __post_init__(self) -> None:
        if self.url is not None and not re.match(r"^https?://[^\s]+$", self.url):
            raise SettingError("url", f"url must be an http(s) URL, got {self.url!r}")
        self.token = _token(self.token)
        for key in ("project", "run"):
            value = getattr(self, key)
            if value is not None and not NAME.match(value):
                raise SettingError(key, f"{key} must be 1-200 characters without whitespace or '/', got {value!r}")
        self.tags = _tags(self.tags)
        if self.notes is not None:
            _check_notes(self.notes)
        positive_ints(self, "every")
        cadences(self, "weight_every", "spectra_every")
        positive_seconds(self, "request_timeout")
        if self.weight_every is None:
            self.weight_every = self.every
        if self.spectra_every is None:
            self.spectra_every = 10 * self.weight_every

    @classmethod
    def settings(cls) -> list[str]:
        """Every keyword :meth:`resolve` (and so :func:`qkwatch.agent.attach`) takes."""
        own = [f.name for f in dataclasses.fields(cls) if f.name not in COMPONENTS]
        return own + [f.name for config in COMPONENTS.values() for f in dataclasses.fields(config)]

    @classmethod
    def resolve(cls, **explicit: Any) -> AgentConfig:
        """Settings from explicit arguments (None = not given), then the environment, then defaults.

        Raises:
            ValueError: naming the setting, for an unknown setting or an invalid value (an
                environment value says which variable it came from).
        """
        known = cls.settings()
        unknown = sorted(set(explicit) - set(known))
        if unknown:
            raise ValueError(f"unknown agent setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
        given = {k: v for k, v in explicit.items() if v is not None}
        from_env = {k: v for k, v in AgentEnvironment.read().items() if k not in given}
        values = {**from_env, **given}
        try:
            parts = {
                slot: config(**{f.name: values.pop(f.name) for f in dataclasses.fields(config) if f.name in values})
                for slot, config in COMPONENTS.items()
            }
            return cls(**values, **parts)
        except SettingError as exc:
            if exc.key not in from_env:
                raise
            var = AgentEnvironment.variable(exc.key)
            shown = "(not shown)" if exc.key == "token" else repr(from_env[exc.key])
            raise ValueError(f"{var}={shown}: {exc}") from None


def _token(value: object) -> str | None:
    """The token as :func:`clean_token` leaves it, or a SettingError that does not show it."""
    if value is not None and not isinstance(value, str):
        raise SettingError("token", f"token must be a string, got {type(value).__name__}")
    try:
        return clean_token(value)
    except ValueError as exc:
        raise SettingError("token", f"token: {exc}") from None


def _tags(value: object) -> tuple[str, ...]:
    """The ``tags`` setting as sorted unique tags: a list or tuple of tags, or one string of
    comma-separated tags (``QKWATCH_TAGS``; spaces around a tag and empty items are dropped)."""
    if isinstance(value, str):
        value = [t.strip() for t in value.split(",") if t.strip()]
    elif isinstance(value, Iterable):
        value = list(value)
    try:
        return tuple(tag_set(value))
    except ValueError as exc:
        raise SettingError("tags", f"tags: {exc}") from None


def _check_notes(value: object) -> None:
    try:
        if not isinstance(value, str):
            raise ValueError(f"notes must be a string, got {type(value).__name__}")
        check_notes(value)
    except ValueError as exc:
        raise SettingError("notes", f"notes: {exc}") from None
