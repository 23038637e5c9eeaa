"""The one code that turns texts into labels (tasks/core/predictor.py), on a model kept in S3."""

from __future__ import annotations

import tempfile

import numpy as np
from conftest import BUCKET

from tasks.core import storage
from tasks.core.predictor import Predictor


def test_a_model_in_s3_labels_texts_and_its_download_is_removed(s3_endpoint, tiny_model, tmp_path, monkeypatch):
    uri = f"s3://{BUCKET}/predictor-test/model"
    fs, path = storage.filesystem(uri)
    fs.put(f"{tiny_model}/", path, recursive=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the download goes
    probabilities = Predictor(uri, batch_size=8).outputs(["a fine film", "a dull film", "great"])
    assert probabilities.shape == (3, 2) and np.allclose(probabilities.sum(1), 1) and (probabilities > 0).all()
    assert list(tmp_path.iterdir()) == [], "the model's download was left behind"
