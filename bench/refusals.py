"""How long `ftflow` takes to refuse bad input (issue 30, point 4): each case through the console
script, as a person runs it, 3 times, the median; beside a refusal of the parameters alone
(`--set train.epoch=3`), the baseline measured in the same run.

    .venv/bin/python bench/refusals.py

Every case but the last is checked before Prefect or Ray start. The last, more workers than the
cluster fits, needs the cluster: it is refused by the flow before tokenization.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ftflow.temporary_api import free_port

ROOT = Path(__file__).resolve().parents[1]
FTFLOW = str(Path(sys.executable).with_name("ftflow"))
TEST = str(ROOT / "data" / "rotten_tomatoes" / "test.jsonl")


def cases(folder: Path) -> dict[str, list[str]]:
    (folder / "labels.jsonl").write_text(
        json.dumps({"text": "fine", "label": 1}) + "\n" + json.dumps({"text": "odd", "label": 7}) + "\n"
    )
    (folder / "empty.jsonl").write_text("")
    (folder / "corrupt.parquet").write_bytes(b"PAR1 not parquet at all")
    return {
        "parameters alone (baseline)": ["run", "--set", "train.epoch=3"],
        "missing file": ["run", "--set", f"data.train_uri={folder}/nope.jsonl"],
        "empty split": ["run", "--set", f"data.test_uri={folder}/empty.jsonl"],
        "bad labels": ["run", "--set", f"data.validation_uri={folder}/labels.jsonl"],
        "corrupt Parquet": ["run", "--set", f"data.train_uri={folder}/corrupt.parquet"],
        "unknown bucket (S3 endpoint on loopback)": ["run", "--set", "storage_root=s3://no-such-bucket/ftflow"],
        "run: no such model": ["run", "--set", "model.name_or_path=/nonexistent/model"],
        "infer: no such model": ["infer", "/nonexistent/model", TEST, f"{folder}/out"],
        "infer: no champion": ["infer", "models/nobody@champion", TEST, f"{folder}/out", "--storage-root", str(folder)],
        "too many workers (the flow, before tokenizing)": ["run"]
        + ["--set", "train.num_workers=64", "--set", "train.batch_size=64"],
    }


def refused_in(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run([FTFLOW, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - started
    assert done.returncode == 2, (args, done.stderr)
    return seconds


def main() -> None:
    from moto.server import ThreadedMotoServer

    port = free_port()  # for the S3 endpoint
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with tempfile.TemporaryDirectory() as folder:
        env["FTFLOW_STORAGE_ROOT"] = f"{folder}/store"
        timed = {
            name: statistics.median(refused_in(args, env) for _ in range(3))
            for name, args in cases(Path(folder)).items()
        }
    server.stop()
    baseline = timed["parameters alone (baseline)"]
    print("| case | seconds (median of 3) | x the parameters' refusal |\n|---|---|---|")
    for name, seconds in timed.items():
        print(f"| {name} | {seconds:.2f} | {seconds / baseline:.2f}x |")


if __name__ == "__main__":
    main()
