"""What tokenization hands on: each split's shards, Parquet files of SHARD_SCHEMA rows under
<root>/tokenized/<content-key>/<split>/ (tasks/core/layout.py), which training reads."""

from __future__ import annotations

import pyarrow as pa

SHARD_SCHEMA = pa.schema({"row": pa.int64(), "label": pa.int64(), "input_ids": pa.list_(pa.int32())})
