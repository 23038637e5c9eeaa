"""The `ftflow` command as a person uses it: bad input in one line, --help with every field, a whole
run on a quiet console with its logs beside it, then batch inference with the champion."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import FTFLOW, fault_injected, free_port, read_jsonl, session_prefect, write_jsonl
from rich.console import Console
from test_flow import params
from test_train import checkpoint_committed
from tiny_model import tiny_model_files, tiny_random_model

from ftflow import console
from ftflow.params import value
from tasks.core.config import SHIPPED_DATA, BatchInferParams, FinetuneParams
from tasks.core.storage import read_json

ROOT = Path(__file__).resolve().parents[1]


def ftflow_env(**env: str) -> dict[str, str]:
    """The driver's own Prefect server and Ray, as from a terminal: none of the test session's."""
    return {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "RAY_ADDRESS"))} | env


def ftflow(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [FTFLOW, *args], cwd=ROOT, env=ftflow_env(**env), capture_output=True, text=True, timeout=timeout
    )


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


@pytest.mark.parametrize(
    "args, line",
    [
        (["run", "--set", "train.epoch=3"], "ftflow run: train: unknown parameter 'epoch': did you mean 'epochs'?"),
        (
            ["run", "--set", "train.batch_size=lots"],
            "ftflow run: train.batch_size: Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            ["run", "--params", "{file}"],
            "ftflow run: {file}: data: unknown parameter 'train': did you mean 'train_uri'?",
        ),
        (
            ["run", "--set", "train.batch_size=7", "--set", "train.num_workers=2"],
            "ftflow run: train: batch_size=7 is not divisible by 2 workers x micro_batch_size=3; use a batch_size that "
            "is a multiple of 6 or change micro_batch_size/num_workers",
        ),
        (["run", "--epochs", "3"], "ftflow run: No such option: --epochs (see --help)"),
        (
            ["sweep", "--set", "sweep.space.train.learnin_rate={{loguniform: [1e-5, 5e-4]}}"],
            "ftflow sweep: sweep.space.train.learnin_rate: 1e-05: unknown parameter 'learnin_rate': did you mean "
            "'learning_rate'?",
        ),
        (
            ["sweep", "--set", "sweep.space.train.learning_rate={{loguniform: [0, 5e-4]}}"],
            "ftflow sweep: sweep.space.train.learning_rate: loguniform [0, 0.0005]: low must be above 0",
        ),
        (
            ["infer", "m", "in.jsonl", "out", "--device", "tpu"],
            "ftflow infer: device: Input should be 'auto', 'cpu' or 'gpu'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, line):
    """Before Prefect or Ray start: no traceback, nothing on stdout."""
    file = tmp_path / "params.yaml"
    file.write_text("data:\n  train: reviews.jsonl\n")
    run = ftflow(*(arg.format(file=file) for arg in args))
    assert (run.returncode, run.stdout, run.stderr) == (2, "", line.format(file=file) + "\n")


def test_a_set_value_yaml_reads_as_nothing_is_the_text_typed(tmp_path):
    """`--set data.label_separator=|` was refused as "an empty separator splits nothing": YAML reads a lone
    `|` as an empty block. What YAML reads as nothing but its own syntax is the text typed; quotes, brackets
    and null say what they say."""
    typed = ["|", ">", "-", "!!str", '""', "[]", "null", "3", "[a, b]"]
    assert [value(text) for text in typed] == ["|", ">", "-", "!!str", "", [], None, 3, ["a", "b"]]
    tags = write_jsonl(
        tmp_path / "tags.jsonl", [{"text": "both", "label": "joy|anger"}, {"text": "one", "label": "joy"}]
    )
    # the data read with the separator |, then a model that is not there: refused before anything starts
    settings = {f"data.{split}_uri": str(tags) for split in ("train", "validation", "test")} | {
        "data.task": "multi_label",
        "data.label_names": "[joy, anger]",
        "data.label_separator": "|",
        "model.name_or_path": "/nonexistent/model",
    }
    refused = ftflow("run", *(arg for name, text in settings.items() for arg in ("--set", f"{name}={text}")))
    assert (refused.returncode, refused.stderr) == (
        2,
        "ftflow run: model.name_or_path /nonexistent/model: no such folder\n",
    )


@pytest.mark.parametrize(
    "case",
    [
        "missing file",
        "empty split",
        "bad labels",
        "corrupt parquet",
        "unknown bucket",
        "unwritable folder",
        "no model",
        "unsplittable model",
        "no weights",
        "conll columns",
        "token classifier split",
        "lora target",
        "too long",
        "infer: no model",
        "infer: no champion",
        "infer: no input",
    ],
)
def test_data_model_and_storage_are_refused_before_anything_starts(tmp_path, s3_endpoint, tiny_model, case):
    """The flow's own checks and words, run by the command before it starts Prefect or Ray: the
    Prefect API it is given is a closed port, so a check made in the flow could not answer at all."""
    bad_labels = write_jsonl(tmp_path / "labels.jsonl", [{"text": "fine", "label": 1}, {"text": "odd", "label": 7}])
    write_jsonl(tmp_path / "empty.jsonl", [])
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 not parquet at all")
    (tmp_path / "bad.conll").write_text("Anna\tNNP\tB-person\nsings\tO\n")
    (tmp_path / "good.conll").write_text("Anna\tB-person\nsings\tO\n")

    def tokens(conll: str) -> list[str]:
        splits = [f"data.{split}_uri={tmp_path}/{conll}" for split in ("train", "validation", "test")]
        return [arg for setting in ("data.task=token_classification", *splits) for arg in ("--set", setting)]

    deberta = tiny_random_model(tmp_path / "deberta", "deberta-v2")
    unweighted = tiny_model_files(tmp_path / "unweighted", "bert")
    test = str(SHIPPED_DATA / "test.jsonl")
    args, line = {
        "missing file": (
            ["run", "--set", f"data.train_uri={tmp_path}/nope.jsonl"],
            f"{tmp_path}/nope.jsonl: file not found",
        ),
        "empty split": (
            ["run", "--set", f"data.test_uri={tmp_path}/empty.jsonl"],
            f"{tmp_path}/empty.jsonl: the test split is empty",
        ),
        "bad labels": (
            ["run", "--set", f"data.validation_uri={bad_labels}"],
            f"{bad_labels}: column 'label' has labels outside ['negative', 'positive'] (or ids 0..1): 7 at rows [1]",
        ),
        "corrupt parquet": (
            ["run", "--set", f"data.train_uri={tmp_path}/corrupt.parquet"],
            f"{tmp_path}/corrupt.parquet: cannot be read as parquet: ",
        ),
        "unknown bucket": (
            ["run", "--set", "storage_root=s3://no-such-bucket/ftflow"],
            "storage_root s3://no-such-bucket/ftflow: bucket 'no-such-bucket' does not exist; ftflow creates no buckets: "
            "create it or fix the name",
        ),
        "unwritable folder": (  # root may write anywhere by its permissions, yet /proc takes no folder
            ["run", "--set", "storage_root=/proc/ftflow"],
            "storage_root /proc/ftflow: nothing can be written under /proc: ",
        ),
        "no model": (
            ["run", "--set", "model.name_or_path=/nonexistent/model"],
            "model.name_or_path /nonexistent/model: no such folder",
        ),
        "unsplittable model": (  # refused in the flow, once Prefect's server answered
            ["run", "--set", f"model.name_or_path={deberta}", "--set", "train.pipeline_parallel_size=2"],
            f"train.pipeline_parallel_size=2: {deberta} is a 'deberta-v2' model, and pipeline_parallel_size splits "
            "only bert, electra, gemma, llama, mistral, qwen2, qwen3, roberta, xlm-roberta: set it to 1",
        ),
        "no weights": (
            ["run", "--set", f"model.name_or_path={unweighted}"],
            f"model.name_or_path {unweighted}: a folder without weights (none of model.safetensors, "
            "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json)",
        ),
        "conll columns": (
            ["run", *tokens("bad.conll")],
            f"{tmp_path}/bad.conll: line 2 has 2 columns, the file's first token line 3",
        ),
        "token classifier split": (
            ["run", *tokens("good.conll"), "--set", "train.pipeline_parallel_size=2"],
            "train.pipeline_parallel_size=2: ftflow splits sequence classifiers only; a token classifier trains with "
            "data parallelism and ZeRO 0-3 (offload fits a larger one): set it to 1",
        ),
        "lora target": (
            ["run", "--set", f"model.name_or_path={tiny_model}", "--set", "train.lora.target_modules=[query, q_proj]"],
            f"train.lora.target_modules: {tiny_model} has no linear layer 'q_proj'; its linear layers are dense, key, "
            "query, value (or all-linear)",
        ),
        "too long": (
            ["run", "--set", f"model.name_or_path={tiny_model}", "--set", "model.max_length=1024"],
            f"model.max_length 1024: {tiny_model} reads at most 512 tokens (its learned positions): set it to 512 or less",
        ),
        "infer: no model": (
            ["infer", "/nonexistent/model", test, f"{tmp_path}/out"],
            "model_uri /nonexistent/model: no such folder",
        ),
        "infer: no champion": (
            ["infer", "models/nobody@champion", test, f"{tmp_path}/out", "--storage-root", str(tmp_path)],
            f"model_uri models/nobody@champion: the registry entry 'nobody' under {tmp_path} has no champion yet "
            f"(no {tmp_path}/models/nobody/champion): a finetune run with promotion.model_name='nobody' and this "
            "storage_root promotes one",
        ),
        "infer: no input": (
            ["infer", str(tiny_model), f"{tmp_path}/nope.jsonl", f"{tmp_path}/out"],
            f"{tmp_path}/nope.jsonl: file not found",
        ),
    }[case]
    refused = ftflow(
        *args, PREFECT_API_URL=f"http://127.0.0.1:{free_port()}/api", FTFLOW_STORAGE_ROOT=str(tmp_path / "store")
    )
    command = f"ftflow {args[0]}: "
    assert (refused.returncode, refused.stdout) == (2, "") and refused.stderr.startswith(command + line), refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and "\x1b" not in refused.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "out").exists()


def test_an_error_line_carries_no_terminal_colour_codes(capfd):
    """Ray colours names in its errors' messages (seen: an inference actor that died starting)."""
    console.error(
        "ftflow infer: The actor died because of an error raised in its creation task, "
        "\x1b[36mray::MapWorker(MapBatches(Labeller)).__init__()\x1b[39m (ActorDiedError)"
    )
    assert capfd.readouterr().err == (
        "ftflow infer: The actor died because of an error raised in its creation task, "
        "ray::MapWorker(MapBatches(Labeller)).__init__() (ActorDiedError)\n"
    )


def test_help_shows_every_field_with_its_description_and_params_writes_the_defaults():
    shown = ftflow("run", "--help")
    text = " ".join(shown.stdout.split())
    for name, field in [
        ("train.zero_stage", FinetuneParams.model_fields["train"].annotation.model_fields["zero_stage"]),
        ("inference.precision", FinetuneParams.model_fields["inference"].annotation.model_fields["precision"]),
    ]:
        assert name in text and " ".join(field.description.split())[:40] in text
    # infer: an option per field of the flow's parameters but its three arguments, with its description
    shown = " ".join(ftflow("infer", "--help", COLUMNS="400").stdout.split())
    for name, field in BatchInferParams.model_fields.items():
        if name not in ("model_uri", "input_uri", "output_uri"):
            assert f"--{name.replace('_', '-')} {name.upper()} {' '.join(field.description.split())[:60]}" in shown, (
                name
            )
    written = ftflow("params")
    assert FinetuneParams.model_validate(yaml.safe_load(written.stdout)) == FinetuneParams()
    assert "# DeepSpeed ZeRO: 0 replicates the model" in written.stdout


def killed_once_resumable(args: list[str], resumable: Callable[[], bool], step: int = 15, **env: str) -> None:
    """`ftflow <args>` SIGKILLed once `resumable()` says a checkpoint is committed (its rank 0 then hangs
    at `step`, so that the kill lands in training): within 60 s none of its processes (its Prefect
    server unless `env` names one, its Ray's, the watcher) is left."""
    with fault_injected(step=step, rank=0, hang_s=120):
        driver = subprocess.Popen(
            [FTFLOW, *args], cwd=ROOT, env=ftflow_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 300
        while not resumable():
            assert driver.poll() is None and time.monotonic() < deadline, (
                "the run ended or took too long before its first checkpoint"
            )
            time.sleep(0.1)
        started = psutil.Process(driver.pid).children(recursive=True)
        started_by_it = {"raylet"} | (set() if "PREFECT_API_URL" in env else {"uvicorn"})
        assert all(any(name in " ".join(p.cmdline()) for p in started) for name in started_by_it)
        driver.kill()
        driver.wait()
    _, left = psutil.wait_procs(started, timeout=60)
    assert not left, f"still running 60 s after the driver was killed: {[' '.join(p.cmdline())[:80] for p in left]}"


def test_a_run_killed_then_run_again_resumes_on_a_quiet_console_then_its_champion_labels_a_corpus(
    tiny_model, small_data, tmp_path, model_hub
):
    """A run killed mid-training leaves no process, and its log in the user's state folder, not in /tmp;
    the same command again resumes it, showing ftflow's lines only, the full log in the run's folder;
    then `ftflow infer` with the champion. Neither asks a model hub anything about a model folder,
    HF_HUB_OFFLINE unset as a user leaves it."""
    store, (hub, asked), logs = tmp_path / "store", model_hub, tmp_path / "state" / "ftflow" / "logs"
    online = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub, "XDG_STATE_HOME": str(tmp_path / "state")}
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump(params(tiny_model, small_data, str(store)).model_dump(mode="json"))
    )
    # One epoch of the tiny model learns nothing (test accuracy 0.5000): no floor, so that it becomes the champion.
    args = ["run", "--params", str(tmp_path / "params.yaml"), "--set", "run_id=killed", "--set", "train.epochs=1"]
    args += ["--set", "train.checkpoint_every_steps=10", "--set", "promotion.min_score=0"]
    killed_once_resumable(args, lambda: checkpoint_committed(store / "runs" / "killed"), **online)
    [killed_log] = logs.iterdir()
    assert "Beginning flow run" in killed_log.read_text()

    # Again, and then `ftflow infer`, on the session's Prefect server: the killed run's own temporary server
    # was checked above (~13 s to start each), and its silence on the terminal in the test below.
    run = ftflow(*args, timeout=600, **online, **session_prefect())
    assert run.returncode == 0 and run.stderr == "", run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for stage in ("tokenize", "train", "evaluate", "promote", "batch inference"):
        assert f"▶ {stage}" in lines and any(re.fullmatch(rf"✓ {stage}: \d+\.\d s", line) for line in lines), run.stdout
    assert len(lines) <= 30 and not [
        line for line in lines if re.search(r"\| INFO|\(pid=|Ray|DeepSpeed|Traceback", line)
    ], run.stdout
    run_dir = store / "runs" / "killed"
    assert [path.name for path in (store / "runs").iterdir()] == ["killed"] and f"artifacts:     {run_dir}" in lines
    assert any(re.fullmatch(r"  train: \d+ / 64 steps, .* samples/s", line) for line in lines), (
        run.stdout
    )  # no bar on a pipe
    [log] = (run_dir / "logs").iterdir()
    assert re.search(r"Finished in state Completed", log.read_text()) and "train: 60 / 64 steps" in log.read_text()
    assert list(logs.iterdir()) == [killed_log], "the run's log moved to its folder"
    history = read_json(str(run_dir / "manifest.json"))["metrics"]["training"]["history"]
    assert history[-1]["resumed_from_step"] >= 10, "the re-run trained from step 0"

    labelled = ftflow(
        "infer",
        "models/sentiment@champion",
        str(small_data["test"]),
        str(tmp_path / "labels"),
        "--storage-root",
        str(store),
        "--actors",
        "1",
        timeout=600,
        **online,
        **session_prefect(),
    )
    assert labelled.returncode == 0 and labelled.stderr == "", labelled.stdout + labelled.stderr
    assert "✓ batch inference: " in labelled.stdout and f"predictions: {tmp_path / 'labels'}" in labelled.stdout
    assert pq.read_table(tmp_path / "labels").num_rows == len(read_jsonl(small_data["test"]))
    assert asked() == 0


def test_the_temporary_prefect_server_sends_no_telemetry_and_prints_nothing_on_the_terminal(tmp_path):
    """Offline, the telemetry of a Prefect server with analytics on (Prefect's default: only `make` set
    PREFECT_SERVER_ANALYTICS_ENABLED=false) was every command's first line, `ERROR | prefect.server.services.telemetry
    - Failed to send telemetry`. The command's own server runs with analytics off whatever the environment
    says, and what it prints (here its DEBUG records) goes to the command's log, as the rest of Prefect's."""
    script = (
        "import os, httpx; from ftflow.cli import flow_console\n"
        "with flow_console(verbose=False) as (say, api_answering):\n"
        "    api_answering()\n"
        "    server = httpx.get(os.environ['PREFECT_API_URL'] + '/admin/settings').json()['server']\n"
        "    say.result({'analytics': str(server['analytics_enabled'])})\n"
    )
    env = ftflow_env(
        PREFECT_SERVER_ANALYTICS_ENABLED="true", PREFECT_LOGGING_SERVER_LEVEL="DEBUG", XDG_STATE_HOME=str(tmp_path)
    )
    shown = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert shown.stderr == "" and shown.stdout.split()[:2] == ["analytics:", "False"], shown.stdout + shown.stderr
    [log] = (tmp_path / "ftflow" / "logs").iterdir()
    assert shown.stdout.split()[2:] == ["logs:", str(log)] and "| DEBUG   | prefect.server" in log.read_text()


def test_a_log_nothing_was_written_to_is_not_kept(tmp_path):
    """A command that ends before anything printed (refused in its checks) leaves no empty file behind."""
    empty, said = tmp_path / "empty.log", tmp_path / "said.log"
    empty.touch()
    said.write_text("Started a local Ray instance.\n")
    assert console.kept(empty, None) is None and not empty.exists()
    assert console.kept(said, None) == str(said) and said.exists()


def test_the_live_table_keeps_each_trials_name_whole_on_an_80_column_terminal():
    """A sweep's rows are told apart by their trials' names: rich cut each to "trial 4c3ce_00…" there."""
    terminal = Console(width=80, force_terminal=True, color_system=None)
    bars = console.stage_bars(terminal)
    for trial in ("trial 4c3ce_00000", "trial 4c3ce_00001"):
        words = "running, learning_rate 0.0003, epochs 2, val_accuracy 0.7712 (best 0.7712)"
        bars.add_task(trial, total=None, unit="evaluations", words=words)
    with terminal.capture() as shown:
        terminal.print(bars.get_renderable())
    rows = shown.get().splitlines()
    assert [row.split()[:2] for row in rows] == [["trial", "4c3ce_00000"], ["trial", "4c3ce_00001"]]
    assert all(len(row) <= 80 for row in rows)
