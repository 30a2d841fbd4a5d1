"""The one "invalid request" exception, importable from every layer.

Whatever rejects input (the op-history rules in ``cache/ops``, the HTTP body schema in
``serving/protocol``, the engine's model-dependent limits) raises :class:`InvalidField`
naming the field and index of the first problem; the HTTP API turns it into a 400 with
that field, the command line into one line.
"""

from __future__ import annotations


class InvalidField(ValueError):
    """An invalid request; ``field`` names where (e.g. ``cache.drop["5"][1]``,
    ``input_ids[2][5]``, ``sampling_params.top_p``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
