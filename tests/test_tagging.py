"""Token classification's inputs as a user gives them: CoNLL files (WNUT-17 as published), words and tags
in JSONL, a text and its spans; the refusals of each, and the entity scores. No cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import write_jsonl

from tasks.contracts.metrics import TokenMetrics
from tasks.contracts.training import Predictions
from tasks.core.config import DataConfig
from tasks.core.data import DataError, labelled_frames, load_splits
from tasks.core.tagging import words_and_offsets

WNUT = Path(__file__).with_name("data") / "wnut17"  # the first 50 sentences of each split, as published


def test_wnut17_as_published_reads_as_sentences_with_sorted_tags():
    """Its quirks: a sentence break written as a lone tab, a test file named .annotated (format: conll)."""
    files = {
        name: str(WNUT / source)
        for name, source in (
            ("train", "wnut17train.conll"),
            ("validation", "emerging.dev.conll"),
            ("test", "emerging.test.annotated"),
        )
    }
    cfg = DataConfig(task="token_classification", format="conll", **{f"{k}_uri": v for k, v in files.items()})
    splits = load_splits(cfg)
    assert {name: split.total_rows for name, split in splits.items()} == {"train": 50, "validation": 50, "test": 50}
    names = splits["train"].schema.label_names
    assert names[0] == "O" and list(names[1:]) == sorted(names[1:]) and "B-location" in names
    first = next(labelled_frames(files["train"], splits["train"].schema))
    assert first["text"][0][:3] == ["@paulwalk", "It", "'s"]
    assert [names[i] for i in first["label"][0][14:17]] == ["B-location", "I-location", "I-location"]


def test_three_forms_read_as_the_same_words_and_tags(entity_data):
    """CoNLL, words and tags in JSONL, and a text with its spans: the same sentences, the same rows."""
    read = {}
    for form in ("conll", "words", "spans"):
        split = load_splits(DataConfig(**entity_data[form]))["test"]
        frames = list(labelled_frames(split.uris[0], split.schema))
        read[form] = (
            split.schema.label_names,
            [(list(w), list(t)) for f in frames for w, t in zip(f["text"], f["label"], strict=True)],
        )
    assert read["conll"] == read["words"] == read["spans"]
    assert read["conll"][0] == ("O", "B-location", "B-person", "I-location", "I-person")  # each type's B- and I-


def test_a_span_inside_a_word_cuts_it_and_words_keep_their_offsets():
    text = "Visit Paris, then New-York."
    words, offsets, _, _ = words_and_offsets(text)
    assert words == ["Visit", "Paris", ",", "then", "New", "-", "York", "."]
    assert all(text[start:end] == word for word, (start, end) in zip(words, offsets, strict=True))


def refusal(tmp_path: Path, rows_or_text, name: str = "train.jsonl", **fields) -> str:
    """The one line load_splits refuses a training file with (the other splits: a good file)."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": ["Anna", "sings"], "label": ["B-person", "O"]}])
    bad = tmp_path / name
    if isinstance(rows_or_text, str):
        bad.write_text(rows_or_text)
    else:
        write_jsonl(bad, rows_or_text)
    cfg = DataConfig(
        task="token_classification", train_uri=str(bad), validation_uri=str(good), test_uri=str(good), **fields
    )
    started = time.perf_counter()
    with pytest.raises(DataError) as refused:
        load_splits(cfg)
    assert time.perf_counter() - started < 2
    message = str(refused.value)
    assert "\n" not in message and str(bad) in message
    return message


@pytest.mark.parametrize(
    ("rows", "said"),
    [
        ([{"text": ["a", "b"], "label": ["O"]}], "row 0: 2 words but 1 tags"),
        ([{"text": ["a"], "label": ["O"]}, {"text": [], "label": []}], "row 1: an empty sentence"),
        ([{"text": ["a", "b"], "label": ["O", "I-person"]}], "row 0: word 1 is I-person after O (strict IOB2"),
        ([{"text": ["a", "b"], "label": ["B-place", "I-person"]}], "word 1 is I-person after B-place"),
        ([{"text": "Anna", "spans": [{"start": 0, "end": 9, "label": "person"}]}], "span 0 [0, 9) is outside its text"),
        (
            [
                {
                    "text": "Anna Bell",
                    "spans": [{"start": 0, "end": 9, "label": "a"}, {"start": 5, "end": 9, "label": "b"}],
                }
            ],
            "span [5, 9) crosses [0, 9)",
        ),
        ([{"text": "Anna", "spans": [{"start": 0, "label": "person"}]}], "span 0 is not {start, end, label}"),
        ([{"text": ["a"], "label": [7]}], "tags given as ids ([7]) need their names"),
    ],
)
def test_bad_rows_are_refused_in_one_line_naming_the_row(tmp_path, rows, said):
    fields = {"label_column": "spans"} if isinstance(rows[0]["text"], str) else {}
    assert said in refusal(tmp_path, rows, **fields)


def test_an_unknown_tag_is_refused_with_the_known_ones(tmp_path):
    message = refusal(tmp_path, [{"text": ["a"], "label": ["B-thing"]}], label_names=["O", "B-person", "I-person"])
    assert "row 0: word 0 has tag 'B-thing', not one of ['O', 'B-person', 'I-person']" in message


def test_a_conll_line_of_other_columns_is_refused_by_its_line(tmp_path):
    message = refusal(tmp_path, "Anna\tNNP\tB-person\nsings\tO\n", name="train.conll")
    assert "line 2 has 2 columns, the file's first token line 3" in message


def test_a_conll_sentence_is_named_by_its_first_line(tmp_path):
    message = refusal(tmp_path, "a\tO\n\nb\tO\nc\tI-person\n", name="train.conll")
    assert "sentence 1 (line 3): word 1 is I-person after O" in message


def test_entity_scores_are_seqevals_strict_iob2_and_plain_tags_are_runs():
    """Strict IOB2 (seqeval's mode="strict"): an entity begun by I- is none, which the default mode counts."""
    names = ("O", "B-person", "I-person", "B-place")
    gold = [[1, 2, 0, 3], [0, 1, 0, 0]]
    tags = [[1, 2, 0, 0], [0, 2, 0, 3]]  # a person right, one begun by I- (none), a place missed, one made up
    metrics = TokenMetrics.of_predictions(Predictions(task="token_classification", tags=tags, gold=gold), names)
    assert (metrics.entity_precision, metrics.entity_recall) == (1 / 2, pytest.approx(1 / 3))
    assert metrics.token_accuracy == 5 / 8 and metrics.floor.scores["entity_f1"] == 0
    assert metrics.floor.scores["token_accuracy"] == 4 / 8  # its words tagged O
    assert {kind.name: kind.support for kind in metrics.types} == {"person": 2, "place": 1}
    assert metrics.type_names == ["O", "person", "place"] and sum(map(sum, metrics.confusion_matrix)) == 8
    plain = TokenMetrics.of(Predictions(task="token_classification", tags=[[1, 1, 0]], gold=[[1, 1, 0]]), ("O", "x"))
    assert plain.entity_f1 == 1 and plain.types[0].support == 1  # "x x" is one entity


def test_label_names_without_o_are_refused():
    with pytest.raises(ValueError, match="token_classification needs the tag O"):
        DataConfig(task="token_classification", label_names=["B-person", "I-person"])
    with pytest.raises(ValueError, match="text_pair_column: token_classification tags the words of one text"):
        DataConfig(task="token_classification", text_pair_column="other")
    assert json.loads(DataConfig(task="token_classification").model_dump_json())["stride"] == 32


def window_labels(words: list[str], tags: list[int], names, subtokens: str, max_length: int = 16) -> list[dict]:
    """The shard rows tokenization writes for one row (tasks/tokenize/worker.py), with the tiny vocabulary."""
    from tiny_model import tiny_tokenizer

    from tasks.core.data import Schema
    from tasks.core.text import windowing
    from tasks.tokenize.worker import tagged_columns

    schema = Schema("auto", "text", ("label",), "token_classification", names, subtokens=subtokens, stride=4)
    frame = pd.DataFrame({"text": [words], "label": [tags]})
    columns = tagged_columns(windowing(tiny_tokenizer(), max_length, 4), frame, np.array([7]), schema)
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def test_a_long_row_is_windowed_and_each_word_starts_in_some_window():
    words = ["the", "unwatchable", "film", "is", "a", "masterpiece", "of", "dullness"] * 6
    rows = window_labels(words, [0] * len(words), ("O", "B-x", "I-x"), "first")
    assert len(rows) > 3 and {row["row"] for row in rows} == {7}
    started = {word for row in rows for word in row["words"] if word >= 0}
    assert started == set(range(len(words))), "every word's first sub-token in some window"
    for row in rows:  # a label on each word's first sub-token, none elsewhere
        assert [label != -100 for label in row["label"]] == [word >= 0 for word in row["words"]]


def test_subtokens_all_tags_a_words_later_pieces_as_inside():
    names = ("O", "B-x", "I-x")
    first, every = (window_labels(["unwatchable"], [1], names, subtokens)[0]["label"] for subtokens in ("first", "all"))
    pieces = sum(label != -100 for label in every)
    assert pieces > 1 and first[1] == every[1] == 1 and every[2 : 1 + pieces] == [2] * (pieces - 1)
    assert sum(label != -100 for label in first) == 1


def test_byte_level_tokenizers_read_words_with_a_prefix_space():
    """RoBERTa's and GPT-2's BPE mark a word's start with Ġ: pre-split words get it as a text's words do."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from tasks.core.text import windowing, windows

    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(["a film about the sea and the city"] * 20, vocab_size=300, min_frequency=1)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)
    encoding = windows(windowing(tokenizer, 32, 4), [["film", "city"]])[0][0]
    assert encoding.tokens == tokenizer.tokenize(" film city") == ["Ġfilm", "Ġcity"]
