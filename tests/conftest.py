"""Real parts for every test: a local Ray cluster, a Prefect test server, an S3 endpoint (moto)."""

from __future__ import annotations

import atexit
import gzip
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The tests' hooks inside every process the session starts, Ray's workers included (tests/hooks/):
# set before any Ray starts, so that its workers inherit them. Every training worker of every test
# checks that each collective's tensor is on its training device (tests/hooks/devices.py): what NCCL
# demands, which gloo on a CPU would let pass.
HOOKS_DIR = Path(tempfile.mkdtemp(prefix="ftflow-test-hooks-"))
atexit.register(shutil.rmtree, HOOKS_DIR, ignore_errors=True)
# The commands' logs (ftflow/console.py) in the session's folder, not the user's ~/.local/state.
os.environ["XDG_STATE_HOME"] = str(HOOKS_DIR / "state")
# Prefect's cache records (the tokenize task's) in the session's folder too, not the user's
# ~/.prefect/storage: there a record of an earlier session whose tmp folder had the same path (pytest
# numbers them from 0 again on a clean /tmp) made a first tokenization "Cached" (CI at e7640c4).
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(HOOKS_DIR / "prefect-results")
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(Path(__file__).parent / "hooks"), os.environ.get("PYTHONPATH")])
)
os.environ["FTFLOW_TEST_HOOKS_DIR"] = str(HOOKS_DIR)
os.environ.setdefault("FTFLOW_TEST_CHECK_DEVICES", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_model import make_tiny_bert  # noqa: E402

from ftflow.temporary_api import free_port  # noqa: E402 -- the tests' free ports, as the command finds its own
from tasks.core.config import SHIPPED_DATA  # noqa: E402
from tasks.core.tagging import entities  # noqa: E402

S3_KEY, S3_SECRET = "ftflow-test-key", "ftflow-test-secret-do-not-log"
BUCKET = "ftflow-test"
FTFLOW = str(Path(sys.executable).with_name("ftflow"))  # the console script, as a person runs it


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on loopback; its endpoint and dummy credentials go into the environment
    before Ray starts, so Ray workers see the same store."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    wait_for_port(port)
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=S3_KEY,
        AWS_SECRET_ACCESS_KEY=S3_SECRET,
        AWS_DEFAULT_REGION="us-east-1",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    yield endpoint
    server.terminate()
    server.wait()


@pytest.fixture(scope="session")
def s3_data(small_data, s3_endpoint) -> dict[str, str]:
    """small_data in the S3 bucket: what every node of a cluster can read. The training split is
    gzipped, as corpora often are stored: tokenized and hashed as it is."""
    import boto3

    keys = {}
    for split, path in small_data.items():
        key, body = f"small-data/{path.name}", path.read_bytes()
        if split == "train":
            key, body = f"{key}.gz", gzip.compress(body, mtime=0)
        boto3.client("s3").put_object(Bucket=BUCKET, Key=key, Body=body)
        keys[split] = f"s3://{BUCKET}/{key}"
    return keys


@pytest.fixture(scope="session")
def ray_cluster(s3_endpoint):
    import ray

    from tasks.core import cluster

    cluster.connect()
    yield ray
    ray.shutdown()


def cpus_freed(ray, within_s: float, holders: str) -> None:
    """Every CPU of the cluster free within `within_s` seconds, else a failure naming who holds them."""
    deadline = time.monotonic() + within_s
    while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"{holders} still hold CPUs: {ray.available_resources()}"
        time.sleep(0.5)


def wait_for_port(port: int) -> None:
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)


@pytest.fixture
def ray_stopped(ray_cluster):
    """The session's Ray stopped for the test (one that starts a Ray of its own, or starts it afresh
    with another environment), and started again after it."""
    from tasks.core import cluster

    ray_cluster.shutdown()
    try:
        yield
    finally:
        ray_cluster.shutdown()
        cluster.connect()


@pytest.fixture
def faulty_s3(s3_endpoint, ray_stopped):
    """The moto endpoint behind tests/faulty_s3.py, failing 10% of requests (500, 503 SlowDown, a dropped
    connection), for this process and a Ray started afresh for the test (workers take the endpoint
    from their environment when Ray starts). Yields a function that returns the proxy's counts."""
    from tasks.core import cluster

    port = free_port()
    proxy = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("faulty_s3.py")),
            str(port),
            s3_endpoint.removeprefix("http://"),
            "0.1",
            "7",
        ]
    )
    wait_for_port(port)
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    cluster.connect()
    try:
        yield lambda: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/_faults").read())
    finally:
        import ray

        ray.shutdown()  # before ray_stopped starts it again, with the endpoint as it was
        os.environ["AWS_ENDPOINT_URL"] = s3_endpoint
        proxy.terminate()
        proxy.wait()


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture(scope="session")
def local_run(ray_cluster, tiny_model, small_data, tmp_path_factory):
    """One finetune run on local storage: its parameters, its Prefect state, and what the Prefect API
    showed while it trained. tests/test_flow.py checks it; tests/test_registry.py has it as the
    champion a second run loses to (a run costs ~75 s here: run once)."""
    from test_flow import params, watch_training

    from flows.finetune import finetune

    run_params = params(tiny_model, small_data, str(tmp_path_factory.mktemp("local-run") / "store"))
    seen = []
    with alongside(watch_training, seen):
        state = finetune(run_params, return_state=True)
    return run_params, state, seen


# A `python -c` script: the batch_infer flow on a model, its input and output given as arguments
# (the script closes its call: f"{BATCH_INFER}, device='gpu'))" adds a setting).
BATCH_INFER = (
    "import sys; from flows.batch_infer import batch_infer; from tasks.core.config import BatchInferParams; "
    "model, inputs, out = sys.argv[1:]; "
    "batch_infer(BatchInferParams(model_uri=model, input_uri=inputs, output_uri=out"
)


def run_batch_infer(
    model_uri: str, input_uri: str | list[str], output_uri: str, return_state: bool = False, **settings
):
    """The batch_infer flow on these, as its form or `ftflow infer` starts it."""
    from flows.batch_infer import batch_infer
    from tasks.core.config import BatchInferParams

    params = BatchInferParams(model_uri=model_uri, input_uri=input_uri, output_uri=output_uri, **settings)
    return batch_infer(params, return_state=return_state)


def session_prefect() -> dict[str, str]:
    """The environment that points a command a test starts at the test session's Prefect server, as a
    team's commands share theirs: on its own, each would start Prefect's temporary server (~10 s here)."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value()}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> dict[str, Path]:
    """Balanced slices of Rotten Tomatoes: 2048 train, 128 validation, 128 test rows."""
    folder = tmp_path_factory.mktemp("small-data")
    sizes = {"train": 2048, "validation": 128, "test": 128}
    out = {}
    for split, n in sizes.items():
        rows = read_jsonl(SHIPPED_DATA / f"{split}.jsonl")
        balanced = [r for r in rows if r["label"] == 0][: n // 2] + [r for r in rows if r["label"] == 1][: n // 2]
        out[split] = write_jsonl(folder / f"{split}.jsonl", balanced)
    return out


TAGS = ["positive", "long", "short"]  # task_data's multi-label names


@pytest.fixture(scope="session")
def task_data(small_data, tmp_path_factory) -> dict[str, dict]:
    """small_data's texts with the targets of the other tasks, made from what the text says and its
    length, so a tiny model learns some of them: multi-label tags (TAGS, a row may have none), read
    with the next row's text as a pair, and three regression targets. Each task's DataConfig fields."""
    folder = tmp_path_factory.mktemp("task-data")
    tasks = {
        "multi_label": {
            "task": "multi_label",
            "label_column": "tags",
            "label_names": TAGS,
            "text_pair_column": "next",
        },
        "regression": {"task": "regression", "label_column": ["stars", "words", "letters"]},
    }
    for split, path in small_data.items():
        rows = read_jsonl(path)
        for i, row in enumerate(rows):
            words = len(row["text"].split())
            row["tags"] = [tag for tag, on in zip(TAGS, (row["label"], words > 25, words < 12), strict=True) if on]
            row["stars"], row["words"], row["letters"] = 1 + 3 * row["label"], words / 10, len(row["text"]) / 100
            row["next"], row["next_id"] = rows[(i + 1) % len(rows)]["text"], f"{split}-{(i + 1) % len(rows)}"
        for fields in tasks.values():
            fields[f"{split}_uri"] = str(write_jsonl(folder / f"{split}.jsonl", rows))
    return tasks


# entity_data's entity words, one word or two a name: whole words of the tiny model's vocabulary, so a
# tiny model learns which words are which (their context says nothing)
PEOPLE = ("writer", "girl", "friend", "child", "master", "teen")
PLACES = ("home", "place", "cinema", "port", "class", "family")
FILLER = ("the", "film", "is", "a", "with", "and", "story", "good", "but", "not", "its", "funny", "too", "so")


def entity_sentence(draw: random.Random) -> tuple[list[str], list[str]]:
    """A sentence of filler words with a person (one or two words) and a place in it, IOB2-tagged."""
    words, tags = [], []
    for kind, names, length in (("person", PEOPLE, draw.choice((1, 2))), ("location", PLACES, 1)):
        filler = [draw.choice(FILLER) for _ in range(draw.randint(1, 5))]
        words += filler + [draw.choice(names) for _ in range(length)]
        tags += ["O"] * len(filler) + [f"B-{kind}"] + [f"I-{kind}"] * (length - 1)
    return words, tags


def write_conll(path: Path, sentences: list[tuple[list[str], list[str]]]) -> Path:
    lines = ["-DOCSTART-\tO", ""]
    for words, tags in sentences:
        lines += [f"{word}\t{tag}" for word, tag in zip(words, tags, strict=True)] + ["\t"]  # WNUT-17's breaks
    path.write_text("\n".join(lines) + "\n")
    return path


def spans_row(words: list[str], tags: list[str]) -> dict:
    """A sentence as annotation tools export it: its text (the words joined by spaces) and its entities'
    character spans."""
    starts = [sum(len(word) + 1 for word in words[:i]) for i in range(len(words))]
    spans = []
    for kind, first, last in entities(tags):
        spans.append({"start": starts[first], "end": starts[last - 1] + len(words[last - 1]), "label": kind})
    return {"text": " ".join(words), "spans": spans}


@pytest.fixture(scope="session")
def entity_data(tmp_path_factory) -> dict[str, dict]:
    """Named entities a tiny model learns (entity_sentence), each split in the three forms token
    classification reads (CoNLL, words and tags in JSONL, a text and its spans in JSONL), as their
    DataConfig fields; `mixed`, a split in each form (CoNLL to train, words to validate, spans to test,
    the JSONL forms under the same column names); and `documents`, texts and spans of 8 sentences each
    (about 80 words), several times a short max_length."""
    folder, draw = tmp_path_factory.mktemp("entity-data"), random.Random(0)
    sizes = {"train": 320, "validation": 48, "test": 48}
    forms = {form: {"task": "token_classification"} for form in ("conll", "words", "spans", "mixed", "documents")}
    forms["words"] |= {"text_column": "tokens", "label_column": "ner_tags"}
    forms["spans"] |= {"label_column": "spans"}
    forms["documents"] |= {"label_column": "spans"}
    drawn = {split: [entity_sentence(draw) for _ in range(size)] for split, size in sizes.items()}
    for split, sentences in drawn.items():
        size = len(sentences)
        documents = [
            (sum((words for words, _ in part), []), sum((tags for _, tags in part), []))
            for part in (sentences[i : i + 8] for i in range(0, size, 8))
        ]
        rows = [{"tokens": words, "ner_tags": tags} for words, tags in sentences]
        forms["conll"][f"{split}_uri"] = str(write_conll(folder / f"{split}.conll", sentences))
        forms["words"][f"{split}_uri"] = str(write_jsonl(folder / f"{split}-words.jsonl", rows))
        forms["spans"][f"{split}_uri"] = str(
            write_jsonl(folder / f"{split}-spans.jsonl", [spans_row(*s) for s in sentences])
        )
        forms["documents"][f"{split}_uri"] = str(
            write_jsonl(folder / f"{split}-documents.jsonl", [spans_row(*d) for d in documents])
        )
    as_words = [{"text": words, "label": tags} for words, tags in drawn["validation"]]
    as_spans = [{"text": row["text"], "label": row["spans"]} for row in (spans_row(*s) for s in drawn["test"])]
    forms["mixed"] |= {
        "train_uri": forms["conll"]["train_uri"],
        "validation_uri": str(write_jsonl(folder / "validation-mixed.jsonl", as_words)),
        "test_uri": str(write_jsonl(folder / "test-mixed.jsonl", as_spans)),
    }
    return forms


@contextmanager
def fault_injected(step: int, rank: int = 0, hang_s: float = 0.0) -> Iterator[None]:
    """While the block runs, at optimizer step `step` training worker `rank` raises, or with hang_s
    waits that long, once per run (tests/hooks/sitecustomize.py)."""
    with faults_injected({"step": step, "rank": rank, "hang_s": hang_s}):
        yield


@contextmanager
def faults_injected(*faults: dict) -> Iterator[Path]:
    """fault_injected's faults ({step, rank, hang_s}, and workers: only in a group of that many), several;
    yields where a hang says it started (hanging-<n>.json, n its place in `faults`), and where a file
    release-<n> ends it before its hang_s."""
    fault = HOOKS_DIR / "fault.json"
    fault.write_text(json.dumps(list(faults)))
    try:
        yield HOOKS_DIR
    finally:
        fault.unlink()
        for marker in [*HOOKS_DIR.glob("hanging-*.json"), *HOOKS_DIR.glob("release-*")]:
            marker.unlink()


@contextmanager
def alongside(watch: Callable[..., None], *args: object) -> Iterator[None]:
    """`watch(stop, *args)` on a thread of its own while the block runs (a killer, a watcher); `stop` set
    and the thread joined once the block ends, however it ends."""
    stop = threading.Event()
    thread = threading.Thread(target=watch, args=(stop, *args))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
