"""Data in: every format, any fsspec location, and a clear early error for each bad input."""

from __future__ import annotations

import codecs
import hashlib

import pandas as pd
import pytest
from conftest import BUCKET, write_jsonl
from pydantic import ValidationError

from tasks.core import files, storage
from tasks.core.config import DataConfig, InferenceConfig
from tasks.core.data import DataError, Split, labelled_frames, load_split, load_splits
from tasks.core.files import CHUNK_ROWS, iter_frames
from tasks.validate.checks import files_to_label

ROWS = [{"text": "a fine film", "label": 1}, {"text": "a dull film", "label": 0}, {"text": "great", "label": 1}]


def write(frame: pd.DataFrame, path, fmt: str):
    """`frame` in `fmt`, compressed by pandas where the path's last suffix names a codec."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif fmt == "parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, sep="\t" if fmt == "tsv" else ",", index=False)
    return path


def rows_of(split: Split) -> pd.DataFrame:
    """The split's rows as the workers read them, piece by piece: text, label id, and the row number
    in the split."""
    frames = [
        frame.set_axis(frame.index - piece.file_row + piece.first_row, axis=0)
        for piece in split.pieces
        for frame in labelled_frames(piece.uri, split.schema, piece=piece)
    ]
    return pd.concat(frames)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tsv", "parquet"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    path = write(pd.DataFrame(ROWS), tmp_path / f"train.{fmt}", fmt)
    split = load_split("train", str(path), DataConfig())
    assert split.uris == (str(path),) and split.total_rows == 3 and split.classes == {0, 1}
    rows = rows_of(split)
    assert rows["text"].tolist() == [r["text"] for r in ROWS]
    assert rows["label"].tolist() == [1, 0, 1]
    assert split.sha256 == storage.sha256(str(path))


def test_custom_columns_and_label_names(tmp_path):
    frame = pd.DataFrame({"review": ["good", "bad", "meh"], "sentiment": ["pos", "neg", "neu"]})
    path = write(frame, tmp_path / "train.csv", "csv")
    cfg = DataConfig(text_column="review", label_column="sentiment", label_names=["neg", "neu", "pos"])
    assert rows_of(load_split("train", str(path), cfg))["label"].tolist() == [2, 0, 1]


def test_reads_from_s3(s3_endpoint, tmp_path):
    path = write(pd.DataFrame(ROWS), tmp_path / "train.parquet", "parquet")
    uri = f"s3://{BUCKET}/data-test/train.parquet"
    storage.filesystem(uri)[0].put_file(str(path), uri)
    split = load_split("train", uri, DataConfig())
    assert split.uris == (uri,) and rows_of(split)["label"].tolist() == [1, 0, 1]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_utf8_byte_order_mark_is_read_as_if_absent(tmp_path, monkeypatch, request, where):
    """Spreadsheets and many Windows tools start a file with one: as a labelled split and as files to
    label, read in byte-range pieces (the mark is in the first only). The content hash keeps it."""
    monkeypatch.setattr(files, "PIECE_BYTES", 300)
    rows = pd.DataFrame({"text": [f"review {i}" for i in range(60)], "label": [i % 2 for i in range(60)]})
    for fmt in ("jsonl", "csv"):
        path = write(rows, tmp_path / f"train.{fmt}", fmt)
        path.write_bytes(codecs.BOM_UTF8 + path.read_bytes())
        uri = str(path)
        if where == "s3":
            request.getfixturevalue("s3_endpoint")
            uri = f"s3://{BUCKET}/bom-test/{path.name}"
            storage.filesystem(uri)[0].put_file(str(path), uri)
        split = load_split("train", uri, DataConfig())
        assert len(split.pieces) == (1 if fmt == "csv" else 7)
        assert rows_of(split)[["text", "label"]].reset_index(drop=True).equals(rows)
        assert split.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        assert files_to_label(InferenceConfig(input_uri=uri, text_column="text", id_column=None)) == [uri]
        assert (
            pd.concat([frame for piece in split.pieces for frame in iter_frames(uri, piece=piece)])["text"].tolist()
            == rows["text"].tolist()
        )


def mixed_split(folder, rows: list[dict]) -> tuple[list[str], pd.DataFrame]:
    """`rows` in four files: a directory of JSONL, CSV and Parquet files (labels as names in the
    Parquet one, as ids elsewhere) and a TSV named by a glob. Returns the inputs, and the rows in
    sorted-path order, which is the order the files are listed here."""
    quarter = -(-len(rows) // 4)
    paths = [
        folder / "dir" / "a.jsonl",
        folder / "dir" / "b.csv",
        folder / "dir" / "c.parquet",
        folder / "extra" / "d.tsv",
    ]
    for path, start in zip(paths, range(0, len(rows), quarter), strict=True):
        piece = pd.DataFrame(rows[start : start + quarter])
        if path.suffix == ".parquet":
            piece["label"] = piece["label"].map(dict(enumerate(DataConfig().targets.names)))
        path.parent.mkdir(parents=True, exist_ok=True)
        write(piece, path, path.suffix[1:])
    return [str(folder / "dir"), str(folder / "extra" / "*.tsv")], pd.DataFrame(rows)


def test_a_split_is_directories_globs_and_lists_of_them(tmp_path):
    inputs, expected = mixed_split(tmp_path / "here", [{"text": f"t{i}", "label": i % 2} for i in range(10)])
    split = load_split("train", inputs, DataConfig())
    assert [uri.removeprefix(str(tmp_path / "here")) for uri in split.uris] == [
        "/dir/a.jsonl",
        "/dir/b.csv",
        "/dir/c.parquet",
        "/extra/d.tsv",
    ]
    assert [(piece.rows, piece.first_row) for piece in split.pieces] == [(3, 0), (3, 3), (3, 6), (1, 9)]
    rows = rows_of(split)
    assert rows.index.tolist() == list(range(10))
    assert rows["text"].tolist() == expected["text"].tolist() and rows["label"].tolist() == expected["label"].tolist()

    elsewhere = mixed_split(tmp_path / "there", expected.to_dict("records"))[0]
    assert load_split("train", elsewhere, DataConfig()).sha256 == split.sha256, "the same content, elsewhere"
    (tmp_path / "there" / "dir" / "b.csv").write_text("text,label\nt3,1\nt4,1\nt5,1\n")
    assert load_split("train", elsewhere, DataConfig()).sha256 != split.sha256


def test_unknown_format_is_refused(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("a fine film\n")
    with pytest.raises(DataError, match=f"{path}: cannot tell the format from '.txt'"):
        load_split("train", str(path), DataConfig())
    compressed = write(pd.DataFrame(ROWS), tmp_path / "train.parquet.gz", "parquet")
    with pytest.raises(DataError, match=f"{compressed}: a Parquet file compresses its own pages"):
        load_split("train", str(compressed), DataConfig())


@pytest.mark.parametrize("codec", ["gz", "bz2", "xz", "zst"])
def test_a_compressed_file_reads_as_its_format_in_one_piece(tmp_path, monkeypatch, codec):
    """pandas writes train.jsonl.gz compressed, as it reads it: ftflow reads it as it streams, found in
    a directory too; it cannot be cut by bytes, so it is one piece however small pieces are."""
    monkeypatch.setattr(files, "PIECE_BYTES", 300)
    rows = pd.DataFrame({"text": [f"review {i}" for i in range(200)], "label": [i % 2 for i in range(200)]})
    for fmt in ("jsonl", "csv", "tsv"):
        path = write(rows, tmp_path / fmt / f"train.{fmt}.{codec}", fmt)
        split = load_split("train", str(path.parent), DataConfig())
        assert split.uris == (str(path),) and len(split.pieces) == 1 and split.total_rows == 200
        read = rows_of(split)
        assert read["text"].tolist() == rows["text"].tolist() and read["label"].tolist() == rows["label"].tolist()
        assert split.sha256 == hashlib.sha256(path.read_bytes()).hexdigest(), "the content key: the bytes stored"
        assert 0.5 < files.rows_per_byte(str(path)) * path.stat().st_size / 200 < 2, "rows per byte as stored"


def test_problems_past_the_first_chunk_name_the_row_in_the_file(tmp_path):
    texts = ["fine"] * (CHUNK_ROWS + 5)
    texts[CHUNK_ROWS + 3] = " "
    path = write(pd.DataFrame({"text": texts, "label": 1}), tmp_path / "train.parquet", "parquet")
    with pytest.raises(DataError, match=f"empty texts at rows \\[{CHUNK_ROWS + 3}\\]"):
        load_split("train", str(path), DataConfig())


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_file_read_in_pieces_gives_every_row_once(tmp_path, monkeypatch, fmt):
    """JSONL cut by bytes (a line belongs to the piece it starts in), Parquet by row groups: one big
    file is read by many tasks. Errors still name the row in the file."""
    monkeypatch.setattr(files, "PIECE_BYTES", 300)
    rows = pd.DataFrame(
        {"text": [f"review {i}" + "!" * (i % 7) for i in range(200)], "label": [i % 3 % 2 for i in range(200)]}
    )
    path = tmp_path / f"train.{fmt}"
    rows.to_parquet(path, row_group_size=16) if fmt == "parquet" else write(rows, path, fmt)
    split = load_split("train", str(path), DataConfig())
    assert len(split.pieces) > 5 and split.total_rows == 200
    read = rows_of(split)
    assert read.index.tolist() == list(range(200))
    assert read["text"].tolist() == rows["text"].tolist() and read["label"].tolist() == rows["label"].tolist()

    rows.loc[150, "text"] = " "
    rows.to_parquet(path, row_group_size=16) if fmt == "parquet" else write(rows, path, fmt)
    with pytest.raises(DataError, match=f"{path}: column 'text' has empty texts at rows \\[150\\]"):
        load_split("train", str(path), DataConfig())


BAD_INPUTS = {
    "missing file": (None, "file not found"),
    "missing column": ([{"body": "x", "label": 1}], "column 'text' not found"),
    "empty split": ([], "split is empty"),
    "non-string text": ([{"text": 42, "label": 1}, {"text": "ok", "label": 0}], "non-string values at rows [0]"),
    "empty text": ([{"text": "ok", "label": 1}, {"text": "  ", "label": 0}], "empty texts at rows [1]"),
    "label outside set": (
        [{"text": "ok", "label": 1}, {"text": "no", "label": 7}],
        "labels outside ['negative', 'positive']",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_file_and_problem(tmp_path, case):
    rows, message = BAD_INPUTS[case]
    path = tmp_path / "train.jsonl"
    if rows is not None:
        path.write_text("") if not rows else write_jsonl(path, rows)
    with pytest.raises(DataError) as err:
        load_split("train", str(path), DataConfig())
    assert str(path) in str(err.value) and message in str(err.value)


def test_single_class_training_split_is_refused(tmp_path, small_data):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "good", "label": 1}, {"text": "fine", "label": 1}])
    cfg = DataConfig(
        train_uri=str(train), validation_uri=str(small_data["validation"]), test_uri=str(small_data["test"])
    )
    with pytest.raises(DataError, match=f"{train}: the training split has a single class \\('positive'\\)"):
        load_splits(cfg)


def test_an_empty_split_of_several_files_names_them(tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("")
    with pytest.raises(DataError, match=f"{tmp_path / 'a.jsonl'}, {tmp_path / 'b.jsonl'}: the train split is empty"):
        load_split("train", [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], DataConfig())


@pytest.mark.parametrize("split", ["train", "validation"])
def test_a_csv_split_of_its_header_alone_is_refused_as_empty_naming_it(tmp_path, small_data, split):
    """pandas reads a CSV of its header alone as a chunk of no rows, which was tallied as rows: `zero-size array
    to reduction operation minimum which has no identity`, naming no file."""
    header = tmp_path / f"{split}.csv"
    header.write_text("text,label\n")
    given = {f"{name}_uri": str(path) for name, path in small_data.items()} | {f"{split}_uri": str(header)}
    with pytest.raises(DataError, match=f"^{header}: the {split} split is empty$"):
        load_splits(DataConfig(**given))


CORRUPT = {
    "jsonl": b'{"text": "cut short\n',
    "csv": b'text,label\n"unclosed,1\n',
    "tsv": b'text\tlabel\n"unclosed\t1\n',
    "parquet": b"PAR1 not parquet at all",
}


@pytest.mark.parametrize("fmt", CORRUPT)
def test_a_corrupt_file_of_any_format_is_refused_naming_it(tmp_path, fmt):
    """As a labelled split and as files to label: one line naming the file, not the parser's alone."""
    path = tmp_path / f"reviews.{fmt}"
    path.write_bytes(CORRUPT[fmt])
    with pytest.raises(DataError, match=f"^{path}: cannot be read as {fmt}: "):
        load_split("train", str(path), DataConfig())
    with pytest.raises(DataError, match=f"^{path}: cannot be read as {fmt}: "):
        files_to_label(InferenceConfig(input_uri=str(path), text_column="text", id_column=None))


def test_files_to_label_without_the_text_or_id_column_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "corpus" / "reviews.jsonl", [{"body": "no text column", "doc": "d1"}])
    with pytest.raises(DataError, match=f"^{path}: column 'text' not found; columns are \\['body', 'doc'\\]"):
        files_to_label(InferenceConfig(input_uri=str(tmp_path / "corpus"), text_column="text", id_column=None))
    with pytest.raises(DataError, match=f"^{path}: column 'id' not found"):
        files_to_label(InferenceConfig(input_uri=str(tmp_path / "corpus"), text_column="body", id_column="id"))
    assert files_to_label(InferenceConfig(input_uri=str(tmp_path / "corpus"), text_column="body", id_column="doc")) == [
        str(path)
    ]


EMOTIONS = ["joy", "anger", "fear"]


def test_multi_label_rows_read_as_lists_of_names_or_ids_or_separated_strings(tmp_path):
    listed = write_jsonl(
        tmp_path / "listed.jsonl",
        [{"text": "a", "tags": ["joy", "fear"]}, {"text": "b", "tags": []}, {"text": "c", "tags": [1]}],
    )
    cfg = DataConfig(task="multi_label", label_column="tags", label_names=EMOTIONS)
    split = load_split("train", str(listed), cfg)
    assert rows_of(split)["label"].tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert split.tally.sums == (1.0, 1.0, 1.0) and split.tally.labels_per_row == 2.0

    separated = write(
        pd.DataFrame({"text": ["a", "b", "c"], "tags": ["joy,fear", "", "anger"]}), tmp_path / "s.csv", "csv"
    )
    cfg = cfg.model_copy(update={"label_separator": ","})
    assert rows_of(load_split("train", str(separated), cfg))["label"].tolist() == rows_of(split)["label"].tolist()


def test_regression_targets_read_as_numbers_one_output_per_column(tmp_path):
    path = write(
        pd.DataFrame({"text": ["a", "b"], "valence": ["3.5", "1"], "arousal": [2, 4.25]}), tmp_path / "t.csv", "csv"
    )
    cfg = DataConfig(task="regression", label_column=["valence", "arousal"])
    split = load_split("train", str(path), cfg)
    assert rows_of(split)["label"].tolist() == [[3.5, 2.0], [1.0, 4.25]]
    assert split.tally.means == (2.25, 3.125) and cfg.targets.names == ("valence", "arousal")


TASK_INPUTS = {
    "unknown label name": (
        {"task": "multi_label", "label_names": EMOTIONS},
        [{"text": "a", "label": ["joy"]}, {"text": "b", "label": ["joy", "glee"]}],
        "column 'label' has labels outside ['joy', 'anger', 'fear'] (or ids 0..2): ['joy', 'glee'] at rows [1]",
    ),
    "separator that splits nothing": (
        {"task": "multi_label", "label_names": ["joy", "joy;fear"], "label_separator": ","},
        [{"text": "a", "label": "joy"}, {"text": "b", "label": "joy;fear"}],
        "data.label_separator ',' splits no row of column 'label' into several labels",
    ),
    "non-numeric target": (
        {"task": "regression"},
        [{"text": "a", "label": 1.5}, {"text": "b", "label": "high"}],
        "column 'label' has values that are not finite numbers: 'high' at rows [1]",
    ),
    "NaN target": (
        {"task": "regression", "format": "csv"},
        "text,label\na,1.5\nb,nan\n",
        "column 'label' has values that are not finite numbers: 'nan' at rows [1]",
    ),
    "infinite target": (
        {"task": "regression", "format": "csv"},
        "text,label\na,1.5\nb,inf\n",
        "column 'label' has values that are not finite numbers: 'inf' at rows [1]",
    ),
    "missing pair column": (
        {"text_pair_column": "answer"},
        [{"text": "a", "label": 1}, {"text": "b", "label": 0}],
        "column 'answer' not found; columns are ['text', 'label']",
    ),
    "constant target": (
        {"task": "regression"},
        [{"text": "a", "label": 2}, {"text": "b", "label": 2.0}],
        "column 'label' is constant (2) in the training split: nothing to learn",
    ),
}


@pytest.mark.parametrize("case", TASK_INPUTS)
def test_bad_targets_name_the_file_and_problem(tmp_path, case):
    fields, rows, message = TASK_INPUTS[case]
    path = tmp_path / "train.jsonl"
    path.write_text(rows) if isinstance(rows, str) else write_jsonl(path, rows)
    cfg = DataConfig(**fields, train_uri=str(path), validation_uri=str(path), test_uri=str(path))
    with pytest.raises(DataError) as err:
        load_splits(cfg)
    assert str(err.value) == f"{path}: {message}"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"task": "regression", "label_names": ["a", "b"]}, "label_names: regression predicts numbers"),
        ({"task": "multi_label"}, "label_names: multi_label needs its label names"),
        ({"label_names": ["only"]}, "label_names: give at least two classes"),
        ({"label_names": []}, r"label_names: give at least two classes, got \[\]"),  # not the default's two
        ({"label_column": ["a", "b"]}, "label_column: several columns are regression's outputs"),
        ({"label_separator": ","}, "label_separator: only multi_label splits labels, not single_label"),
        ({"truncation": "only_second"}, "truncation: a single text has no side to choose; set text_pair_column"),
    ],
)
def test_a_task_that_does_not_fit_its_label_fields_is_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        DataConfig(**fields)
