"""The `ftflow` command as a person uses it: bad input in one line, --help with every field, a whole
run on a quiet console with its logs beside it, then batch inference with the champion."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import FTFLOW, read_jsonl
from tasks.config import FinetuneParams
from test_flow import params

ROOT = Path(__file__).resolve().parents[1]


def ftflow(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    # The driver's own Prefect server and Ray, as from a terminal: none of the test session's.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "RAY_ADDRESS"))} | env
    return subprocess.run([FTFLOW, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def model_hub():
    """A stand-in for the Hugging Face hub that counts the connections made to it and answers none:
    (HF_ENDPOINT, a function returning the count so far)."""
    server, connections = socket.create_server(("127.0.0.1", 0)), []

    def accept() -> None:
        while True:
            try:
                connections.append(server.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", lambda: len(connections)
    server.close()
    for connection in connections:
        connection.close()


@pytest.mark.parametrize("args, line", [
    (["run", "--set", "train.epoch=3"], "ftflow run: train: unknown parameter 'epoch': did you mean 'epochs'?"),
    (["run", "--set", "train.batch_size=lots"], "ftflow run: train.batch_size: Input should be a valid integer, unable to parse string as an integer"),
    (["run", "--params", "{file}"], "ftflow run: {file}: data: unknown parameter 'train': did you mean 'train_uri'?"),
    (["run", "--epochs", "3"], "ftflow run: No such option: --epochs (see --help)"),
    (["infer", "m", "in.jsonl", "out", "--device", "tpu"], "ftflow infer: device: Input should be 'auto', 'cpu' or 'gpu'"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, line):
    """Before Prefect or Ray start: no traceback, nothing on stdout."""
    file = tmp_path / "params.yaml"
    file.write_text("data:\n  train: reviews.jsonl\n")
    run = ftflow(*(arg.format(file=file) for arg in args))
    assert (run.returncode, run.stdout, run.stderr) == (2, "", line.format(file=file) + "\n")


def test_help_shows_every_field_with_its_description_and_params_writes_the_defaults():
    shown = ftflow("run", "--help")
    text = " ".join(shown.stdout.split())
    for name, field in [("train.zero_stage", FinetuneParams.model_fields["train"].annotation.model_fields["zero_stage"]),
                        ("inference.precision", FinetuneParams.model_fields["inference"].annotation.model_fields["precision"])]:
        assert name in text and " ".join(field.description.split())[:40] in text
    assert "--batch-size" in ftflow("infer", "--help").stdout
    written = ftflow("params")
    assert FinetuneParams.model_validate(yaml.safe_load(written.stdout)) == FinetuneParams()
    assert "# DeepSpeed ZeRO: 0 replicates the model" in written.stdout


def test_a_run_shows_its_stages_on_a_quiet_console_then_its_champion_labels_a_corpus(tiny_model, small_data, tmp_path, model_hub):
    """ftflow's lines only, the full log in the run's folder; then `ftflow infer` with the champion.
    Neither asks a model hub anything about a model folder, HF_HUB_OFFLINE unset as a user leaves it."""
    store, (hub, asked) = tmp_path / "store", model_hub
    online = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params(tiny_model, small_data, str(store)).model_dump(mode="json")))
    run = ftflow("run", "--params", str(tmp_path / "params.yaml"), "--set", "train.epochs=1", timeout=600, **online)
    assert run.returncode == 0 and run.stderr == "", run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for stage in ("tokenize", "train", "evaluate", "promote", "batch inference"):
        assert f"▶ {stage}" in lines and any(re.fullmatch(rf"✓ {stage}: \d+\.\d s", line) for line in lines), run.stdout
    assert len(lines) <= 30 and not [line for line in lines if re.search(r"\| INFO|\(pid=|Ray|DeepSpeed|Traceback", line)], run.stdout
    [run_dir] = (store / "runs").iterdir()
    assert f"artifacts:     {run_dir}" in lines
    [log] = (run_dir / "logs").iterdir()
    assert re.search(r"Finished in state Completed", log.read_text()) and "train: 60 / 64 steps" in log.read_text()

    labelled = ftflow("infer", "models/sentiment@champion", str(small_data["test"]), str(tmp_path / "labels"),
                      "--storage-root", str(store), "--actors", "1", timeout=600, **online)
    assert labelled.returncode == 0 and labelled.stderr == "", labelled.stdout + labelled.stderr
    assert "✓ batch inference: " in labelled.stdout and f"predictions: {tmp_path / 'labels'}" in labelled.stdout
    assert pq.read_table(tmp_path / "labels").num_rows == len(read_jsonl(small_data["test"]))
    assert asked() == 0
