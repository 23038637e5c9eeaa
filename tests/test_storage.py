"""Storage: what ftflow writes is read whole or not at all, and reads back as written."""

from __future__ import annotations

import json
import threading

from tasks import storage


def test_a_reader_never_sees_a_json_file_half_written(tmp_path):
    """Markers and manifests say a result is complete: a reader racing a rewrite sees the old file
    or the new one, never part of one, and nothing is left beside it."""
    target = tmp_path / "runs" / "r1" / "manifest.json"
    big = {"rows": list(range(200_000))}  # ~1.6 MB: a non-atomic write would be caught in the middle
    storage.write_json(str(target), big)
    done, torn = threading.Event(), []

    def read_until_done() -> None:
        while not done.is_set():
            try:
                json.loads(target.read_bytes())
            except json.JSONDecodeError as error:
                torn.append(error)

    reader = threading.Thread(target=read_until_done)
    reader.start()
    for version in range(30):
        storage.write_json(str(target), big | {"version": version})
    done.set()
    reader.join()
    assert not torn, f"{len(torn)} reads saw a partly written file"
    assert storage.read_json(str(target))["version"] == 29
    assert [p.name for p in target.parent.iterdir()] == ["manifest.json"]
