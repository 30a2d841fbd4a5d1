"""The body of ``POST /generate`` as a pydantic model: token-id segments, cache operations
and ``sampling_params`` (the shared field types are :mod:`.body_fields`'s)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict

from akv_jax.serving.body_fields import (
    STRICT,
    CacheOps,
    Count,
    InputIds,
    SamplingFields,
    at_most,
)

__all__ = ["GenerateBody", "SamplingBody"]


class SamplingBody(SamplingFields):
    """``sampling_params`` of /generate; unknown keys are errors, not ignored."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    max_new_tokens: Annotated[Count, at_most("max_new_tokens")] | None = None



class GenerateBody(BaseModel):
    """The body of ``POST /generate``: token-id segments plus cache operations."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    input_ids: InputIds
    cache: CacheOps = None
    sampling_params: SamplingBody | None = None
    return_logprob: bool | None = None
    stream: bool | None = None

