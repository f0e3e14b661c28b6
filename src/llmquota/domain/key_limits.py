"""The limits one API key carries, as LiteLLM's virtual keys do.

A key may have its own tokens, requests and in-flight limits and a list of
the models it may name. The limits are a limit layer of scope `key`
(migration 0021), decided in the same statement as every other layer, all
or nothing; a refusal by it says `"scope": "key"`. The models are checked
before admission (a model the key may not use is a 403 that names it) and
bound the fallbacks the statement may pick (the layer's `allowed_models`).

Pure: the REST body, the admin service and the CLI share these rules.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmquota.domain.json_numbers import WholeNumber
from llmquota.domain.json_schemas import BURSTS_NEED_RATES
from llmquota.domain.names import ModelGlob
from llmquota.domain.policy import MAX_IN_FLIGHT, RequestRate, TokenRate
from llmquota.domain.quotas import MAX_MODELS, glob_to_like


class KeyLimits(BaseModel):
    """A key's limits; every field optional (None: that limit is not set).

    `models`: the model names and `*` globs the key may use; None: any model.
    Bursts default to one minute of refill, as a tenant's do.
    """

    # The schema says what the validator does (a burst needs its rate), so that
    # a client generating bodies from it never sends one it refuses.
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=BURSTS_NEED_RATES)

    tokens_per_minute: TokenRate | None = None
    token_burst: TokenRate | None = None
    requests_per_minute: RequestRate | None = None
    request_burst: RequestRate | None = None
    max_in_flight: Annotated[int, WholeNumber(ge=1, le=MAX_IN_FLIGHT)] | None = None
    models: Annotated[list[ModelGlob], Field(min_length=1, max_length=MAX_MODELS)] | None = None

    @model_validator(mode="after")
    def _bursts_need_rates(self) -> Self:
        if self.token_burst is not None and self.tokens_per_minute is None:
            raise ValueError("token_burst needs tokens_per_minute (the refill rate)")
        if self.request_burst is not None and self.requests_per_minute is None:
            raise ValueError("request_burst needs requests_per_minute (the refill rate)")
        return self

    @property
    def is_empty(self) -> bool:
        """No limit and no model list: the key needs no layer."""
        return all(value is None for value in self.model_dump().values())

    @property
    def effective_token_burst(self) -> int | None:
        return self.token_burst if self.token_burst is not None else self.tokens_per_minute

    @property
    def effective_request_burst(self) -> int | None:
        return self.request_burst if self.request_burst is not None else self.requests_per_minute

    @property
    def like_patterns(self) -> list[str] | None:
        """The models as the LIKE patterns the admission statement matches fallbacks by."""
        return None if self.models is None else [glob_to_like(m) for m in self.models]


# A key without limits of its own.
NO_LIMITS = KeyLimits()


@dataclass(frozen=True, slots=True)
class ModelAllowList:
    """The models one key may name, matched as admission matches them."""

    globs: tuple[str, ...]

    @classmethod
    def of(cls, globs: Sequence[str] | None) -> ModelAllowList | None:
        return None if globs is None else cls(tuple(globs))

    def allows(self, model: str) -> bool:
        return any(_glob(g).fullmatch(model) for g in self.globs)

    def first_refused(self, models: Sequence[str]) -> str | None:
        """The first of `models` the key may not use, or None."""
        return next((model for model in models if not self.allows(model)), None)


def _glob(pattern: str) -> re.Pattern[str]:
    """A `*` glob (the only wildcard of model globs) as a regular expression."""
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")))
