"""The checks of a run's and of a batch-inference job's inputs that need no cluster: the data, the
model, the files to label, storage. The flows run them first, for runs started from the UI or a
deployment; `ftflow run` and `ftflow infer` run the same functions before starting anything, so a
refusal comes in about a second with the flow's own words (inside the flow it came after a
temporary Prefect server had started: 13-19 s here).

Imports no Prefect, Ray or transformers (importing transformers alone takes 4 s here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tasks.contracts.labels import Reading
from tasks.contracts.promotion import check_champion_task, resolve
from tasks.core import layout, storage
from tasks.core.config import BatchInferParams, DataConfig, FinetuneParams, InferenceConfig, default_storage_root
from tasks.core.data import SPLITS, Split, load_splits
from tasks.core.files import CONLL_COLUMNS, check_columns, expand_inputs, file_format
from tasks.core.layout import OutputFolder, RunStore, refuse_overlap
from tasks.core.models import check_length, check_lora_targets, check_parallelism, saved_model, training_model
from tasks.core.storage import check_writable


def splits_of(cfg: DataConfig) -> dict[str, Split]:
    """load_splits, once per process while the files are unchanged (fsspec's ukey: size and mtime, or
    the ETag): `ftflow run` checks the data before Prefect starts, and its flow, in the same process,
    does not then read and hash a large corpus a second time."""
    files = tuple(
        tuple((uri, storage.fingerprint(uri)) for uri in expand_inputs(getattr(cfg, f"{name}_uri"))) for name in SPLITS
    )
    return dict(_checked_splits(cfg.model_dump_json(), files))


@functools.lru_cache(maxsize=2)
def _checked_splits(cfg_json: str, files: tuple) -> dict[str, Split]:  # files: the cache key
    return load_splits(DataConfig.model_validate_json(cfg_json))


@dataclass(frozen=True)
class RunInputs:
    """What a finetune run reads, checked."""

    splits: dict[str, Split]
    inference: InferenceConfig  # with the files to label (default: the test split) and their text column
    to_label: list[str]  # those files, found and each holding the text (and id) column

    def read(self, params: FinetuneParams) -> list[str]:
        """Every location the run reads: what it writes must stay apart."""
        return [*params.inputs(), *(uri for split in self.splits.values() for uri in split.uris), *self.to_label]

    @property
    def labels_test_split(self) -> bool:
        """Batch inference labels the test split's texts, which the trained engine labels for evaluation. Not
        a token classifier's: the entities' offsets index the texts as batch inference reads them."""
        test = self.splits["test"]
        reads = (self.inference.text_column, self.inference.text_pair_column)
        same = reads == (test.schema.text_column, test.schema.text_pair_column)
        return self.to_label == list(test.uris) and same and not test.schema.tagged

    def by_field(self) -> dict[str, list[str]]:
        """The files read, by the field that named them."""
        return {
            **{f"data.{name}": list(split.uris) for name, split in self.splits.items()},
            "inference.input_uri": self.to_label,
        }


def run_inputs(params: FinetuneParams, store: RunStore | None) -> RunInputs:
    """Every check of a finetune run that needs no cluster: the splits (every row), the model and the
    split of it train asks for, the files to label, the storage root, and, once the run's id is known,
    its folder."""
    splits = splits_of(params.data)
    training_model(params.model)
    check_length(params.model)
    check_parallelism(params.train, params.model, params.data.task)  # in the flow, after Prefect's server: 5-11 s
    check_lora_targets(params.train.lora, params.model.name_or_path, params.data.task)
    inference = params.inference.model_copy(update=inference_defaults(params, splits["test"]))
    inputs = RunInputs(splits, inference, files_to_label(inference))
    check_writable(params.storage_root, "storage_root")
    check_champion_task(params.storage_root, params.promotion.model_name, params.data.task)
    if store is not None:
        store.check()  # and outputs that would overwrite what ftflow did not write
    outputs = [
        layout.StorageRoot(params.storage_root).champion(params.promotion.model_name),
        *([store.base] if store else []),
    ]
    refuse_overlap(outputs, inputs.read(params))
    return inputs


def inference_defaults(params: FinetuneParams, test: Split) -> dict:
    """What the run's labelling reads where its config does not say: the test split, read as it is
    (its format, its text column: a CoNLL file's is 'words'), and the data's text columns."""
    given = params.inference
    conll = all(file_format(uri, params.data.format) == "conll" for uri in test.uris)
    return {
        "input_uri": given.input_uri or list(test.uris),
        "format": given.format if given.input_uri or given.format != "auto" else params.data.format,
        "text_column": given.text_column
        or (CONLL_COLUMNS[0] if conll and not given.input_uri else params.data.text_column),
        "text_pair_column": given.text_pair_column or params.data.text_pair_column,
    }


def batch_infer_inputs(params: BatchInferParams) -> str:
    """Every check of a batch-inference job that needs no cluster, and the model it runs (a folder, or
    `models/<name>@champion` resolved under the storage root). Refused: a model that is not a saved
    model's folder, no files, one that cannot be read or lacks the text or id column, an output among
    the inputs or the model, an output folder holding files ftflow did not write."""
    model_uri = saved_model(resolve(params.model_uri, params.storage_root or default_storage_root()), "model_uri")
    check_pairs(model_uri, params.text_pair_column)
    inputs = [params.input_uri] if isinstance(params.input_uri, str) else params.input_uri
    refuse_overlap([params.output_uri], [model_uri, *inputs, *files_to_label(params)])
    check_writable(params.output_uri, "output_uri")
    OutputFolder(params.output_uri).check()  # each time: an output's state is not ftflow's to cache
    return model_uri


def check_pairs(model_uri: str, text_pair_column: str | None) -> None:
    """A model trained on pairs of texts labels pairs, one trained on single texts single texts."""
    pairs = storage.read_json(storage.join(model_uri, "config.json")).get("text_pair_truncation")
    if bool(pairs) != bool(text_pair_column):
        reads = "pairs of texts: name the column of each row's second text" if pairs else "one text a row"
        raise ValueError(f"text_pair_column: {model_uri} reads {reads}")


def files_to_label(cfg: InferenceConfig) -> list[str]:
    """cfg's files, each holding the text (and id) column; read once per process while they are
    unchanged, as splits_of reads the splits: `ftflow run` and `ftflow infer` check them before
    Prefect starts, and their flow finds them checked."""
    found = tuple((uri, storage.fingerprint(uri)) for uri in expand_inputs(cfg.input_uri))
    return list(_columns_checked(found, tuple(Reading.of(cfg).columns), cfg.format))


@functools.lru_cache(maxsize=2)
def _columns_checked(found: tuple, columns: tuple[str, ...], fmt: str) -> tuple[str, ...]:  # found: the key
    files = [uri for uri, _ in found]
    check_columns(files, columns, fmt)
    return tuple(files)
