"""The `batch_infer` flow: many files, several formats, exactly one prediction per input row."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import BATCH_INFER, cpus_freed, read_jsonl, run_batch_infer, session_prefect, write_jsonl
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

from tasks.contracts.labels import Labelled
from tasks.contracts.training import Curve, Predictions, Result
from tasks.core import cluster, layout, progress, storage
from tasks.core.config import DataConfig, InferenceConfig
from tasks.core.data import DataError, load_split
from tasks.core.files import iter_frames
from tasks.core.layout import MARKER
from tasks.core.predictor import Predictor
from tasks.infer import driver as infer
from tasks.infer.labels import columns
from tasks.infer.task import write_test_labels
from tasks.infer.worker import Counts


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    write_jsonl(folder / "a.jsonl", [{"text": f"review {i} was good"} for i in range(300)])
    (folder / "sub").mkdir()
    films = pd.DataFrame({"text": [f"film {i} bored me" for i in range(200)]})
    films.to_csv(folder / "sub" / "b.csv.gz", index=False)  # gzipped, as its suffix says
    pd.DataFrame({"text": [f"plot {i}" for i in range(100)], "doc": [f"d{i}" for i in range(100)]}).to_parquet(
        folder / "c.parquet"
    )
    return folder


def prefect_records(flow_run_id) -> tuple[list[str], dict[str, object]]:
    """The flow run's log messages and artifacts by key, as the Prefect UI shows them; log records are
    shipped in the background, so wait for the final one."""
    with get_client(sync_client=True) as client:
        for _ in range(40):
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            if any("rows/s)" in log.message for log in logs):
                break
            time.sleep(0.5)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return [log.message for log in logs], {a.key: a.data for a in artifacts}


def test_every_row_of_every_file_gets_one_prediction(ray_cluster, tiny_model, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "REPORT_EVERY_S", 0.5)
    state = run_batch_infer(str(tiny_model), str(corpus), str(tmp_path / "predictions"), return_state=True)
    out = state.result()
    assert out.seconds > 0 and out.rows_per_s > 0 and out.parts == 3
    assert out.actors == 1, "600 rows: one actor with every CPU, not two each starting a model"
    assert (out.output_uri, out.rows, out.files) == (str(tmp_path / "predictions"), 600, 3)
    messages, artifacts = prefect_records(state.state_details.flow_run_id)
    # Progress every 0.5 s once an actor has labelled rows (none while the actors load: a line of
    # zeros read like a result), then the final tick and line.
    ticks = [m for m in messages if re.match(r"batch inference: [\d,]+( / [\d,]+)? rows, ", m)]
    assert not [m for m in ticks if m.startswith("batch inference: 0 ")], ticks
    assert re.fullmatch(r"batch inference: 600 / 600 rows, [\d,]+ rows/s", ticks[-1])
    assert any(m.startswith("labelled 600 rows from 3 file(s)") for m in messages)
    assert "batch-inference-throughput" in artifacts
    report = artifacts["batch-inference-report"]
    assert report.startswith("# batch_infer: 600 rows labelled") and f"(file://{tmp_path / 'predictions'})" in report
    table = pq.read_table(tmp_path / "predictions").to_pandas().set_index("id")
    expected = {f"a.jsonl:{i}": f"review {i} was good" for i in range(300)}
    expected |= {f"sub/b.csv.gz:{i}": f"film {i} bored me" for i in range(200)}
    expected |= {f"c.parquet:{i}": f"plot {i}" for i in range(100)}
    assert table.index.is_unique and table["text"].to_dict() == expected
    assert set(table["label"]) <= {"LABEL_0", "LABEL_1"}
    marker = json.loads((tmp_path / "predictions" / MARKER).read_text())
    assert marker["rows"] == 600 and marker["model"]["fingerprint"] == storage.fingerprint(str(tiny_model))
    assert marker["inputs"] == {
        str(p): storage.fingerprint(str(p))
        for p in (corpus / "a.jsonl", corpus / "c.parquet", corpus / "sub" / "b.csv.gz")
    }


def test_the_test_split_of_a_regression_model_is_written_as_scores_not_labels(task_data, tmp_path, caplog):
    """The finetune flow's batch inference of the test split writes what evaluation predicted: a regression
    model's numbers, which its line called labels ("wrote the 128 test rows' labels")."""
    data = DataConfig(**task_data["regression"])
    test = load_split("test", data.test_uri, data)
    numbers = [[1.0, 0.5, 0.25]] * test.total_rows
    training = Result(
        history=[],
        curve=Curve(),
        validation=Predictions(),
        nodes=[],
        test=Predictions.of("regression", numbers, numbers),
    )
    (model := tmp_path / "model").mkdir()
    inference = InferenceConfig(input_uri=list(test.uris), text_column="text")

    @flow
    def labelled_test_split() -> Labelled:  # the task as the finetune flow runs it
        return write_test_labels(training, test, str(model), inference, str(tmp_path / "predictions"))

    with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
        written = labelled_test_split()
    [line] = [record.getMessage() for record in caplog.records if record.getMessage().startswith("wrote ")]
    assert re.fullmatch(r"wrote the 128 test rows' scores, as evaluation predicted them, in \d+\.\d s", line), line
    columns = pq.read_table(tmp_path / "predictions").column_names
    assert written.rows == 128 and columns[-3:] == ["stars", "words", "letters"], "a score per output"


def test_the_total_is_estimated_from_the_bytes_of_the_parts_done():
    """Mid-run, the total is the rows per byte of the parts done times the corpus's bytes, said to be
    an estimate; unknown before a part is done; exact at the end."""
    part, window = Counts(parts=1, bytes=1_000, rows=300, labelled=300), Counts(labelled=64)
    tick = infer.progress_tick([part, window], parts=3, total_bytes=2_000, seconds=2.0)
    assert tick.line() == "batch inference: 364 / 600 rows, 182 rows/s (total estimated; 1/3 parts done)"
    assert infer.progress_tick([window], 3, 2_000, 1.0).line() == (
        "batch inference: 64 rows, 64 rows/s (total estimated; 0/3 parts done)"
    )
    assert infer.progress_tick([part], 1, 1_000, 1.0).line() == "batch inference: 300 / 300 rows, 300 rows/s"


def test_missing_input_or_model_is_refused_before_ray(tiny_model, tmp_path):
    """As a run from the UI or the on-promotion deployment meets them: in the flow, before any cluster work."""
    with pytest.raises(DataError, match="no input files found"):
        run_batch_infer(str(tiny_model), str(tmp_path / "nowhere" / "*.jsonl"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match=f"^model_uri {tmp_path}/no-model: no such folder$"):
        run_batch_infer(str(tmp_path / "no-model"), str(tmp_path / "nowhere" / "*.jsonl"), str(tmp_path / "out"))
    with pytest.raises(
        ValueError, match="^model_uri models/nobody@champion: the registry entry 'nobody' under .* has no champion yet"
    ):
        run_batch_infer(
            "models/nobody@champion",
            str(tmp_path / "nowhere" / "*.jsonl"),
            str(tmp_path / "out"),
            storage_root=str(tmp_path),
        )


def test_a_list_of_inputs_shared_by_two_actors_in_small_windows(ray_cluster, tiny_model, corpus, tmp_path):
    inputs = [str(corpus / "sub"), str(corpus / "*.jsonl"), str(corpus / "a.jsonl")]
    out = run_batch_infer(str(tiny_model), inputs, str(tmp_path / "predictions"), window_rows=64, actors=2)
    assert out.rows == 500 and out.files == 2  # a.jsonl named twice is read once
    assert out.parts > 2, "a.jsonl cut into pieces, so that both actors have work"
    table = pq.read_table(tmp_path / "predictions").to_pandas().set_index("id")
    expected = {f"a.jsonl:{i}": f"review {i} was good" for i in range(300)} | {
        f"sub/b.csv.gz:{i}": f"film {i} bored me" for i in range(200)
    }
    assert table.index.is_unique and table["text"].to_dict() == expected


def test_bf16_and_a_compiled_model_label_as_fp32_does_and_deepspeed_asks_for_a_gpu(
    ray_cluster, tiny_model, corpus, tmp_path
):
    """inference.precision bf16 on a CPU: within rounding of fp32. inference.engine compile (torch.compile):
    fp32's labels and scores. deepspeed (DeepSpeed's CUDA kernels): refused on CPUs in one line before
    any replica starts, and with device=cpu as the parameters are read. fp32's are the Predictor's, as
    the job's one actor (1 CPU: 1 thread) runs it over a.jsonl's one window, here in this process (a job
    of its own took ~8 s more)."""
    runs = {"bf16": {"precision": "bf16"}, "compile": {"precision": "fp32", "engine": "compile"}}
    for name, settings in runs.items():
        run_batch_infer(str(tiny_model), str(corpus / "a.jsonl"), str(tmp_path / name), **settings)
    rounded, compiled = (pq.read_table(tmp_path / name).to_pandas().set_index("id").sort_index() for name in runs)
    exact = fp32_labels(tiny_model, read_jsonl(corpus / "a.jsonl"), "a.jsonl").sort_index()
    assert list(rounded.index) == list(exact.index)
    gap = (rounded["score"] - exact["score"]).abs()
    assert 0 < gap.max() < 0.02  # bf16 did run (scores moved), by rounding only
    assert (rounded["label"] == exact["label"])[exact["score"] > 0.52].all()  # labels change only near ties
    assert (compiled["label"] == exact["label"]).all()
    assert 0 < (compiled["score"] - exact["score"]).abs().max() < 1e-5  # compiled kernels round otherwise: it ran
    with pytest.raises(
        ValueError, match="^inference.engine=deepspeed runs DeepSpeed's CUDA kernels, and this job labels on CPUs"
    ):
        run_batch_infer(str(tiny_model), str(corpus / "a.jsonl"), str(tmp_path / "ds"), engine="deepspeed")
    assert not (tmp_path / "ds").exists()
    with pytest.raises(ValueError, match="engine: deepspeed runs DeepSpeed's CUDA kernels, and device is cpu"):
        run_batch_infer(
            str(tiny_model), str(corpus / "a.jsonl"), str(tmp_path / "ds"), engine="deepspeed", device="cpu"
        )


def fp32_labels(model: Path, rows: list[dict], name: str) -> pd.DataFrame:
    """A file's columns as its job writes them, by the fp32 Predictor with the job's defaults, on 1 thread
    as its actor of 1 CPU."""
    threads = torch.get_num_threads()
    try:
        predictor = Predictor(str(model), InferenceConfig().batch_size, threads=1, precision="fp32")
        outputs = predictor.outputs([row["text"] for row in rows])
    finally:
        torch.set_num_threads(threads)
    ids = pd.Index([f"{name}:{i}" for i in range(len(rows))], name="id")
    return pd.DataFrame(columns(predictor.targets, predictor.thresholds, outputs), index=ids)


def test_every_row_of_a_hundred_files_gets_one_prediction(ray_cluster, tiny_model, tmp_path):
    """Every row once, named by its id column (its own test, a job on a Parquet file, was dropped: 11 s of
    CI33, the same path)."""
    # 100,000 rows: a million (bench/inference.py's size) took 59 s of the suite and proved nothing more.
    files, per_file = 100, 1_000
    for f in range(files):
        ids = range(f * per_file, (f + 1) * per_file)
        write_jsonl(
            tmp_path / "corpus" / f"part-{f:03d}.jsonl", [{"doc": f"d{i}", "text": f"film {i} was fun"} for i in ids]
        )
    inputs = [str(path) for path in sorted((tmp_path / "corpus").iterdir())]
    out = run_batch_infer(str(tiny_model), inputs, str(tmp_path / "predictions"), id_column="doc")
    assert out.rows == files * per_file
    ids = pq.read_table(tmp_path / "predictions", columns=["id"]).column("id").to_pandas()
    assert ids.is_unique and set(ids) == {f"d{i}" for i in range(files * per_file)}


def test_any_layout_of_files_is_cut_into_even_parts_that_keep_row_numbers(tmp_path):
    """Two actors get four parts each or more: 16 small files are 16 parts, one large file is cut into
    pieces. A piece's rows keep their numbers in the file (the default ids): JSONL's as the reader
    parses it (blank lines skipped), Parquet's from its row groups."""
    jsonl, parquet = tmp_path / "big.jsonl", tmp_path / "big.parquet"
    lines = [json.dumps({"text": f"review {i}"}) + ("\n\n" if i % 7 == 0 else "\n") for i in range(1000)]
    jsonl.write_text("".join(lines))
    pq.write_table(pa.table({"text": [f"review {i}" for i in range(1000)]}), parquet, row_group_size=50)
    for big in (jsonl, parquet):
        parts = infer.cut_in_parts({str(big): big.stat().st_size}, actors=2)
        assert len(parts) >= 8
        texts = {}
        for part in parts:
            frame = pd.concat(iter_frames(str(big), piece=part.piece), ignore_index=True)
            texts |= {part.file_row + i: text for i, text in enumerate(frame["text"])}
        assert texts == {i: f"review {i}" for i in range(1000)}, big.name
    small = []
    for f in range(16):
        small.append(tmp_path / f"part-{f:02d}.jsonl")
        write_jsonl(small[-1], [{"text": f"review {i}"} for i in range(625)])
    parts = infer.cut_in_parts({str(path): path.stat().st_size for path in small}, actors=2)
    assert [(part.name, part.start, part.file_row) for part in parts] == [(path.name, 0, 0) for path in small]


def test_a_job_killed_mid_way_and_run_again_labels_every_row_once(ray_stopped, tiny_model, tmp_path):
    """The driver SIGKILLed once labels are being written; the same job again ends with exactly one
    row per input row, and none of the killed job's files."""
    files, per_file = 20, 5_000  # ~12 windows of 8,192 rows: the first written, most of them to come
    for f in range(files):
        ids = range(f * per_file, (f + 1) * per_file)
        write_jsonl(
            tmp_path / "corpus" / f"part-{f:02d}.jsonl", [{"doc": f"d{i}", "text": f"film {i} was fun"} for i in ids]
        )
    output = tmp_path / "predictions"
    job = (str(tiny_model), str(tmp_path / "corpus"), str(output))
    driver = subprocess.Popen(
        [sys.executable, "-c", f"{BATCH_INFER}, id_column='doc'))", *job],
        cwd=Path(__file__).parents[1],
        env={**os.environ, **session_prefect()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not list(output.glob("*.parquet")):
        assert driver.poll() is None and time.monotonic() < deadline, (
            "the job ended or took too long before writing labels"
        )
        time.sleep(0.05)
    driver.kill()
    driver.wait()
    assert not (output / MARKER).exists(), "a killed job's output looks complete"

    cluster.connect()
    assert run_batch_infer(*job, id_column="doc").rows == files * per_file
    ids = pq.read_table(output, columns=["id"]).column("id").to_pandas()
    assert ids.is_unique and set(ids) == {f"d{i}" for i in range(files * per_file)}
    marker = json.loads((output / MARKER).read_text())
    assert layout.OutputFolder(str(output)).files() == {*marker["files"], MARKER}


def test_a_job_past_its_timeout_fails_marks_nothing_complete_and_frees_its_actors(ray_cluster, tiny_model, tmp_path):
    """timeout_s stops a job mid-way: it fails saying so, its output has no marker, and its actors'
    CPUs are free again (Ray Data leaves a stopped pipeline's actors to the garbage collector)."""
    write_jsonl(tmp_path / "corpus.jsonl", [{"text": f"film {i} was fun"} for i in range(200_000)])
    output = tmp_path / "labels"
    with pytest.raises(TimeoutError, match="timed out after 10"):
        run_batch_infer(str(tiny_model), str(tmp_path / "corpus.jsonl"), str(output), actors=2, timeout_s=10)
    assert not (output / MARKER).exists()
    cpus_freed(ray_cluster, 10, "the stopped job's actors")
