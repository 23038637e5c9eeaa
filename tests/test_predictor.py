"""The one code that turns texts into labels (tasks/core/predictor.py), on a model kept in S3."""

from __future__ import annotations

import tempfile

from conftest import BUCKET

from tasks.core import storage
from tasks.core.predictor import Predictor


def test_a_model_in_s3_labels_texts_and_its_download_is_removed(s3_endpoint, tiny_model, tmp_path, monkeypatch):
    uri = f"s3://{BUCKET}/predictor-test/model"
    storage.upload_dir(tiny_model, uri)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the download goes
    labels, scores = Predictor(uri, batch_size=8).predict(["a fine film", "a dull film", "great"])
    assert len(labels) == 3 and ((0 <= labels) & (labels <= 1)).all() and ((0.5 <= scores) & (scores <= 1)).all()
    assert list(tmp_path.iterdir()) == [], "the model's download was left behind"
