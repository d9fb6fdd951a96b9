"""Hugging Face datasets on disk: parquet shards with embedded images, written row by row.

`ShardWriter` writes one config's rows (`successes/`, `failures/`, `sft/`) to parquet files of
at most `rows_per_shard` rows, in row groups of `rows_per_group`, so an export of any size
holds one row group in memory. Each file carries the `datasets` library's feature metadata
(images are `Image` features: `{"bytes", "path"}` structs), so

    datasets.load_dataset("path/to/export", "successes")

decodes screenshots as PIL images. `dataset_card` writes the README.md that names the configs
and says what the data is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])

STEP_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.int64()),
        ("step_index", pa.int32()),
        ("task", pa.string()),
        ("instruction", pa.string()),
        ("run_id", pa.int64()),
        ("source", pa.string()),
        ("status", pa.string()),
        ("reward", pa.float64()),
        ("image", _IMAGE),
        ("screen_width", pa.int32()),
        ("screen_height", pa.int32()),
        ("action", pa.string()),  # core.protocol.Action JSON, screen pixels
        ("action_type", pa.string()),
        ("thought", pa.string()),
        ("raw_output", pa.string()),
        ("error", pa.string()),
        ("policy_version", pa.int32()),
    ]
)
_TEXT = pa.struct([("type", pa.string()), ("text", pa.string())])
SFT_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.int64()),
        ("step_index", pa.int32()),
        ("task", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(_TEXT))]))),
        ("images", pa.list_(_IMAGE)),
    ]
)


def _features(schema: pa.Schema) -> dict[str, Any]:
    """The `datasets` library's description of `schema`'s columns (its parquet metadata)."""

    def value(tp: pa.DataType) -> dict[str, Any]:
        if tp == _IMAGE:
            return {"_type": "Image"}
        if pa.types.is_list(tp):
            return {"feature": value(tp.value_type), "_type": "List"}
        if pa.types.is_struct(tp):
            return {f.name: value(f.type) for f in tp}
        return {"dtype": str(tp).replace("double", "float64"), "_type": "Value"}

    return {f.name: value(f.type) for f in schema}


class ShardWriter:
    """Rows into `<root>/<config>/part-NNNNN.parquet`."""

    def __init__(
        self,
        root: Path,
        config: str,
        schema: pa.Schema,
        *,
        rows_per_shard: int = 5000,
        rows_per_group: int = 64,
    ) -> None:
        meta = {b"huggingface": json.dumps({"info": {"features": _features(schema)}}).encode()}
        self.schema = schema.with_metadata(meta)
        self.dir = root / config
        self.rows_per_shard = rows_per_shard
        self.rows_per_group = rows_per_group
        self.rows = 0
        self._buffer: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._in_shard = 0
        self._shards = 0

    def add(self, row: dict[str, Any]) -> None:
        self._buffer.append(row)
        self.rows += 1
        if len(self._buffer) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        if self._writer is None or self._in_shard >= self.rows_per_shard:
            if self._writer is not None:
                self._writer.close()
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"part-{self._shards:05d}.parquet"
            self._writer = pq.ParquetWriter(path, self.schema)
            self._shards += 1
            self._in_shard = 0
        self._writer.write_table(pa.Table.from_pylist(self._buffer, schema=self.schema))
        self._in_shard += len(self._buffer)
        self._buffer = []

    def close(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()


def dataset_card(
    root: Path, *, title: str, configs: dict[str, int], query: str, licence: str, notes: list[str]
) -> None:
    """README.md: the `datasets` configs (each a folder of parquet files), what was exported
    (the trajectory filter), the row counts, the licence and the columns."""
    front = ["---", f"license: {licence}", "configs:"]
    for name in configs:
        front += [f"- config_name: {name}", f"  data_files: {name}/*.parquet"]
    front += ["---", ""]
    body = [
        f"# {title}",
        "",
        "Trajectories of GUI agents exported from Dartboard: one row per step, with the "
        "screenshot the agent acted on (embedded PNG), its action, thought and raw output, "
        "the trajectory's reward and status, and the policy version that acted.",
        "",
        f"Filter (the trajectory list's query): `{query or 'all trajectories'}`",
        "",
        "| config | rows |",
        "|---|---:|",
        *[f"| {name} | {rows} |" for name, rows in configs.items()],
        "",
        "Columns of `successes` and `failures`: "
        + ", ".join(f"`{f.name}`" for f in STEP_SCHEMA)
        + ". `action` is Dartboard's action JSON in screen pixels; `error` is the step's parse "
        "error or the trajectory's error.",
        "",
        "`sft`: each step as the chat the policy saw (`messages`, image placeholders in order) "
        "and the reply to learn as the last message; `images` holds the screenshots.",
        "",
        *notes,
    ]
    (root / "README.md").write_text("\n".join(front + body) + "\n")
