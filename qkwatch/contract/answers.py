"""What the agent accepts from the collector: the two answers it reads, checked before any is used.

The collector's full answers are :mod:`qkwatch.contract.responses`' ``RunPublic`` and ``LambdasPublic``;
these models hold only the fields the agent uses, bounded so that no value can hurt the
training process (a ``version`` of 400 digits, a run id of a megabyte). Other fields are
ignored, so a newer collector's answers still fit. Each lambda value is checked later, layer by
layer, by ``agent.lambdas`` (so that one bad value does not lose the others).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict

from qkwatch.contract.values import MAX_LAYERS

MAX_VERSION = 2**53
"""A lambdas version above this would not survive the ranks' float64 exchange."""
MAX_ATTEMPT = 2**31 - 1


class RunAnswer(BaseModel):
    """``POST /v1/runs``: the run's id and the attempt to report under."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: Annotated[str, Strict()] = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$")
    attempt: Annotated[int, Strict()] = Field(default=1, ge=1, le=MAX_ATTEMPT)


class LambdasAnswer(BaseModel):
    """``GET /v1/runs/{id}/lambdas``: a vector of lambdas (values checked one by one later) and its version."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    lambdas: list[Any] = Field(max_length=MAX_LAYERS)
    version: Annotated[int, Strict()] = Field(default=0, ge=0, le=MAX_VERSION)


class ReportsAnswer(BaseModel):
    """``POST /v1/runs/{id}/reports``: how many points were stored, and how many were already there.

    Only an answer that fits takes reports out of the spool: a proxy or a captive portal that
    answers 200 with a page, or ``{}``, has stored nothing.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    inserted: Annotated[int, Strict()] = Field(ge=0, le=MAX_VERSION)
    duplicates: Annotated[int, Strict()] = Field(default=0, ge=0, le=MAX_VERSION)
