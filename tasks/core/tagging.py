"""Token classification's rows, in the three forms people have them, as (words, tags) checked: a list of
words and a list of tags (JSONL, Parquet), CoNLL files (a token a line, its tag in the last column,
sentences separated by blank lines), and raw text with character spans (annotation tools' export). Also
the tag schemes (IOB2, or a plain class per token), entities decoded from tags, and the words of raw
text with their character offsets, which batch inference labels. Imports no torch, Ray or Prefect.

Every problem raises DataError naming the file, the row and the problem (tasks/core/files.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import pairwise
from typing import Literal, NamedTuple

import numpy as np
import pandas as pd

from tasks.core.files import LINE, DataError
from tasks.core.targets import label_id

OUTSIDE = "O"  # the tag of a word in no entity
IGNORED = -100  # a token's label that counts for no loss (transformers' ignore index)
Scheme = Literal["iob2", "plain"]
# A word of raw text: a run of letters and digits, or one other character that is not a space. Punctuation
# apart, as the CoNLL corpora split it and as BERT's pre-tokenizer does: "Paris," is two words.
WORD = re.compile(r"\w+|[^\w\s]")


def scheme_of(names: Sequence[str]) -> Scheme:
    """IOB2 where every tag but O is B-<type> or I-<type>; else each tag is a class of its own."""
    tagged = [name for name in names if name != OUTSIDE]
    return "iob2" if tagged and all(name[:2] in ("B-", "I-") and len(name) > 2 for name in tagged) else "plain"


def type_of(tag: str) -> str:
    """An entity's type: B-person's and I-person's is person; a plain tag is its own."""
    return tag[2:] if tag[:2] in ("B-", "I-") else tag


def entity_types(names: Sequence[str]) -> list[str]:
    """The entity types the tags name, in order of first mention (O is none)."""
    return list(dict.fromkeys(type_of(name) for name in names if name != OUTSIDE))


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """(type, first word, last word + 1) of each entity in a row's tags. B-x starts one and I-x goes on
    with it; an I-x that follows no x (a model's prediction may) starts one too, as transformers'
    token-classification pipeline reads it. Plain tags: each run of one tag but O is an entity."""
    found: list[list] = []
    previous = OUTSIDE
    for i, tag in enumerate(tags):
        kind = type_of(tag)
        goes_on = tag != OUTSIDE and not tag.startswith("B-") and previous != OUTSIDE and type_of(previous) == kind
        if goes_on:
            found[-1][2] = i + 1
        elif tag != OUTSIDE:
            found.append([kind, i, i + 1])
        previous = tag
    return [tuple(entity) for entity in found]


def as_iob2(tags: Sequence[str]) -> list[str]:
    """Plain tags as IOB2, each run of one tag an entity: what entity scoring (seqeval) reads."""
    out = [OUTSIDE] * len(tags)
    for kind, start, end in entities(tags):
        out[start:end] = [f"B-{kind}"] + [f"I-{kind}"] * (end - start - 1)
    return out


def inside_ids(names: Sequence[str]) -> list[int]:
    """Per tag id, the id a word's later sub-tokens get where every sub-token carries the tag
    (data.subtokens all): B-x's is I-x's (where the tags have I-x), any other tag's its own."""
    by_name = {name: i for i, name in enumerate(names)}
    return [by_name.get(f"I-{name[2:]}", i) if name.startswith("B-") else i for i, name in enumerate(names)]


def token_labels(word_ids: Sequence[int | None], starts: Sequence[int], tags: Sequence[int], inside, ignored: int):
    """A window's label per token: its word's tag on the word's first sub-token (starts: tasks/core/text.py
    first_subtokens), `ignored` on the others, or, given inside_ids, their I- tag."""
    if inside is None:
        return [tags[word] if word >= 0 else ignored for word in starts]
    return [
        tags[start] if start >= 0 else ignored if word is None else inside[tags[word]]
        for start, word in zip(starts, word_ids, strict=True)
    ]


def words_of(text: str, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The (start, end) character offsets of the words of a text, each also cut where a cut falls in
    it (a span that starts or ends inside a word)."""
    found = []
    for match in WORD.finditer(text):
        start, end = match.span()
        inner = sorted({cut for cut in cuts if start < cut < end})
        found += pairwise([start, *inner, end])
    return found


def where(frame: pd.DataFrame, row: int) -> str:
    """A row named in a message: a CoNLL sentence by its number and first line."""
    return f"sentence {row} (line {frame.at[row, LINE]})" if LINE in frame.columns else f"row {row}"


def checked_spans(text: str, spans, at: str) -> list[dict]:
    """A text's spans, each a {start, end, label} within the text, sorted, none crossing another."""
    if not isinstance(spans, (list, tuple, np.ndarray)):
        raise DataError(f"{at}: spans must be a list of {{start, end, label}}, got {type(spans).__name__}")
    spans = [dict(span) if isinstance(span, dict) else span for span in spans]
    for i, span in enumerate(spans):
        if not isinstance(span, dict) or {"start", "end", "label"} - span.keys():
            raise DataError(f"{at}: span {i} is not {{start, end, label}}: {span!r}")
        start, end = span["start"], span["end"]
        numbers = all(isinstance(edge, (int, np.integer)) and not isinstance(edge, bool) for edge in (start, end))
        if not (numbers and 0 <= start < end <= len(text)):
            raise DataError(f"{at}: span {i} [{start}, {end}) is outside its text of {len(text)} characters")
    spans.sort(key=lambda span: span["start"])
    for before, span in pairwise(spans):
        if span["start"] < before["end"]:
            raise DataError(f"{at}: span [{span['start']}, {span['end']}) crosses [{before['start']}, {before['end']})")
    return spans


def spans_tags(text: str, spans, at: str) -> tuple[list[str], list[str]]:
    """A text's words and their IOB2 tags from its labelled character spans."""
    spans = checked_spans(text, spans, at)
    offsets = words_of(text, [cut for span in spans for cut in (span["start"], span["end"])])
    tags = [OUTSIDE] * len(offsets)
    for span in spans:
        inside = [i for i, (start, end) in enumerate(offsets) if span["start"] <= start and end <= span["end"]]
        if not inside:
            raise DataError(f"{at}: span [{span['start']}, {span['end']}) covers no word of its text")
        tags[inside[0] : inside[-1] + 1] = [f"B-{span['label']}"] + [f"I-{span['label']}"] * (len(inside) - 1)
    return [text[start:end] for start, end in offsets], tags


def as_list(value) -> list | None:
    """A JSON or Parquet list cell as a list; None where the cell holds something else."""
    return list(value) if isinstance(value, (list, tuple, np.ndarray)) else None


def row_tags(words, tags, at: str) -> tuple[list[str], list]:
    """One row's words and tags (names or ids), as given: a list of words and one of tags, or a text
    and its spans."""
    if isinstance(words, str):
        return spans_tags(words, tags, at)
    words, tags = as_list(words), as_list(tags)
    if words is None or tags is None:
        raise DataError(f"{at}: words and tags must be lists (or a text and its spans)")
    if len(words) != len(tags):
        raise DataError(f"{at}: {len(words)} words but {len(tags)} tags")
    bad = next((i for i, word in enumerate(words) if not isinstance(word, str) or not word.strip()), None)
    if bad is not None:
        raise DataError(f"{at}: word {bad} is {words[bad]!r}, not a word")
    return words, tags


def given_rows(uri: str, frame: pd.DataFrame, words_column: str, tags_column: str) -> pd.DataFrame:
    """A chunk's rows as (words, tags as given), each row checked: a row with no words is refused."""
    rows = []
    for row, words, tags in zip(frame.index, frame[words_column], frame[tags_column], strict=True):
        at = f"{uri}: {where(frame, row)}"
        words, tags = row_tags(words, tags, at)
        if not words:
            raise DataError(f"{at}: an empty sentence (no words)")
        rows.append((words, tags))
    return pd.DataFrame(rows, columns=["words", "tags"], index=frame.index)


def tag_ids(tags: list, names: Sequence[str], scheme: Scheme, at: str) -> list[int]:
    """A row's tags (names or ids) as ids, checked against the names and, for IOB2, strictly: an I-x
    continues a B-x or an I-x."""
    by_name = {name: i for i, name in enumerate(names)}
    ids = [label_id(tag, by_name) for tag in tags]
    if None in ids:
        word = ids.index(None)
        raise DataError(f"{at}: word {word} has tag {tags[word]!r}, not one of {list(names)}")
    if scheme == "iob2":
        previous = OUTSIDE
        for word, i in enumerate(ids):
            tag = names[i]
            if tag.startswith("I-") and (previous == OUTSIDE or type_of(previous) != type_of(tag)):
                raise DataError(
                    f"{at}: word {word} is {tag} after {previous} (strict IOB2: an entity starts at B-{type_of(tag)})"
                )
            previous = tag
    return ids


def tagged(uri: str, frame: pd.DataFrame, words_column: str, tags_column: str, names: Sequence[str]) -> pd.DataFrame:
    """A chunk's rows as (text: the words, label: their tag ids), each checked."""
    given, scheme = given_rows(uri, frame, words_column, tags_column), scheme_of(names)
    labels = [tag_ids(tags, names, scheme, f"{uri}: {where(frame, row)}") for row, tags in given["tags"].items()]
    return pd.DataFrame({"text": given["words"], "label": labels}, index=frame.index)


def tag_names(found: set, at: str) -> tuple[str, ...]:
    """The tags a training split holds as the model's outputs: sorted, O first; IOB2 tags with both B-
    and I- of each type (a type whose entities are one word in training may have longer ones elsewhere)."""
    ids = sorted(tag for tag in found if not isinstance(tag, str))
    if ids:
        raise DataError(f"{at}: tags given as ids ({ids[:5]}) need their names: set data.label_names")
    if scheme_of(sorted(found)) == "iob2":
        found = {OUTSIDE} | {f"{edge}-{kind}" for kind in entity_types(sorted(found)) for edge in "BI"}
    return (OUTSIDE, *sorted(found - {OUTSIDE}))


# A row's prediction of each word its windows start: word -> (distance from the window's nearer edge, tag
# id, probability), from the window where the word sits farthest from an edge (where it sees the most context).
Chosen = dict[int, tuple[int, int, float]]


def keep_farthest(chosen: Chosen, starts: Sequence[int], tags: Sequence[int], scores: Sequence[float]) -> None:
    """One window into its row's predictions: per token, the word it starts (-1: none; tasks/core/text.py
    first_subtokens), its most probable tag and that tag's probability. A word is taken from this window
    where it sits farther from an edge than in any window before (of equals, the first)."""
    last = len(starts) - 1
    for position, word in enumerate(starts):
        distance = min(position, last - position)
        if word >= 0 and (word not in chosen or distance > chosen[word][0]):
            chosen[word] = (distance, tags[position], scores[position])


class Tagged(NamedTuple):
    """A row as a token classifier labels it (batch inference): its text, its entities, each a dict of
    text, label, start and end (character offsets into the text) and score (its words' mean
    probability), and for a row given as words, each word's tag."""

    text: str
    entities: list[dict]
    tags: list[str] | None


def words_and_offsets(row) -> tuple[list[str], list[tuple[int, int]], str, bool]:
    """A row to tag as (its words, their character offsets, its text, whether it came as words): a
    text split into words (words_of), or a list of words, whose text is the words joined by spaces."""
    if isinstance(row, str):
        offsets = words_of(row)
        return [row[start:end] for start, end in offsets], offsets, row, False
    words = [str(word) for word in row]
    starts = [0]
    for word in words[:-1]:
        starts.append(starts[-1] + len(word) + 1)
    return words, [(start, start + len(word)) for start, word in zip(starts, words, strict=True)], " ".join(words), True


def tagged_row(
    words: list[str],
    offsets: list[tuple[int, int]],
    text: str,
    as_words: bool,
    best: Chosen,
    names: Sequence[str],
    outside: int,
) -> Tagged:
    """A row's prediction per word (word -> (distance, tag id, probability); a word missing from it,
    whose characters the tokenizer drops, is O) as its entities and, for a row given as words, tags."""
    predicted = [best.get(word, (0, outside, 0.0)) for word in range(len(words))]
    tags = [names[tag] for _, tag, _ in predicted]
    found = [
        {
            "text": text[offsets[first][0] : offsets[last - 1][1]],
            "label": kind,
            "start": offsets[first][0],
            "end": offsets[last - 1][1],
            "score": sum(score for _, _, score in predicted[first:last]) / (last - first),
        }
        for kind, first, last in entities(tags)
    ]
    return Tagged(text, found, tags if as_words else None)
