"""What a processor row holds and what it gets back: the prompt (`prompt`, or chat `messages`), `sampling_params`
as a dict, and the result columns (ray.data.llm's names)."""
from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow as pa

from raylm.common.sampling_params import SamplingParams
from raylm.common.structured_outputs import StructuredOutputsParams

ERROR_COLUMN = "__inference_error__"  # ray.data.llm's: "" for a row that succeeded, else why it failed
RESULT_SCHEMA = pa.schema([
    ("generated_text", pa.string()),
    ("generated_tokens", pa.list_(pa.int64())),
    ("num_input_tokens", pa.int64()),
    ("num_generated_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("time_to_first_token", pa.float64()),  # seconds from the row reaching the engine to its first token
    ("time_taken_llm", pa.float64()),  # seconds from the row reaching the engine to its last token
])
_ID_COLUMNS = ("id", "custom_id", "request_id")
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class RowError(ValueError):
    """A row the engine cannot take or failed; the message names the row."""


def describe_row(row: dict[str, Any]) -> str:
    """The row as a user finds it again: its id column, else the start of its prompt."""
    for column in _ID_COLUMNS:
        if row.get(column) is not None:
            return f"row {column}={row[column]!r}"
    text = row.get("prompt") if row.get("prompt") is not None else row.get("messages")
    shown = repr(text)
    return f"row {shown[:80] + '...' if len(shown) > 80 else shown}"


def sampling_params_from(given: dict[str, Any] | None) -> SamplingParams:
    """SamplingParams from a row's dict. Arrow gives every row of a column the union of the struct fields, None where
    a row had none, so a None means "not set" here."""
    if given is None:
        raise ValueError("sampling_params: the row has none; give a dict of SamplingParams fields, e.g. "
                         "{'max_tokens': 64, 'temperature': 0.0}")
    settings = {name: value for name, value in given.items() if value is not None}
    unknown = sorted(set(settings) - _SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {unknown}; known: {sorted(_SAMPLING_FIELDS)}")
    if settings.get("n", 1) != 1:
        raise ValueError(f"sampling_params.n: one completion per row, got n={settings['n']}; repeat the row instead")
    if isinstance(settings.get("structured_outputs"), dict):
        settings["structured_outputs"] = StructuredOutputsParams(**settings["structured_outputs"])
    if isinstance(settings.get("logit_bias"), dict):  # JSON and Arrow keys are strings
        settings["logit_bias"] = {int(token): bias for token, bias in settings["logit_bias"].items()}
    return SamplingParams(**settings)


def result_table(batch: pa.Table, results: list[dict[str, Any]], with_error_column: bool) -> pa.Table:
    """`batch` with the result columns set (replacing input columns of the same names), typed the same in every
    batch so that the blocks of a dataset concatenate."""
    schema = pa.schema([*RESULT_SCHEMA, (ERROR_COLUMN, pa.string())]) if with_error_column else RESULT_SCHEMA
    for field in schema:
        column = pa.array([result.get(field.name) for result in results], type=field.type)
        index = batch.schema.get_field_index(field.name)
        batch = batch.set_column(index, field, column) if index >= 0 else batch.append_column(field, column)
    return batch
