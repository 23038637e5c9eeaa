"""The promotion gate and the registry: a first model becomes champion, one that loses leaves the
champion untouched and says so, and batch inference takes `models/<name>@champion`."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from flows.batch_infer import batch_infer
from flows.finetune import finetune
from tasks import storage
from tasks.config import PromotionConfig
from tasks.registry import champion_pointer, resolve
from tasks.storage import MARKER
from test_flow import params


def test_a_model_that_loses_leaves_the_champion_untouched(ray_cluster, tiny_model, small_data, tmp_path):
    root = str(tmp_path / "store")
    first = finetune(params(tiny_model, small_data, root).model_copy(update={"promotion": PromotionConfig(model_name="rt")}))
    pointer = champion_pointer(root, "rt")
    assert first["promoted"] and storage.read_json(pointer)["model_uri"] == f"{first['run_dir']}/model"
    before = storage.filesystem(pointer)[0].cat_file(pointer)

    # The same training again cannot beat the champion by a margin of 0.5: it must lose.
    losing = params(tiny_model, small_data, root).model_copy(
        update={"promotion": PromotionConfig(model_name="rt", margin=0.5)})
    second = finetune(losing)
    assert not second["promoted"]
    assert storage.filesystem(pointer)[0].cat_file(pointer) == before, "the champion pointer changed"
    decision = storage.read_json(storage.join(second["run_dir"], "manifest.json"))["metrics"]["promotion"]
    assert decision["champion"] == pytest.approx(first["test_accuracy"]), "the champion is scored on the same test split"
    assert "< the champion's" in decision["reason"] and decision["previous_champion_uri"] == f"{first['run_dir']}/model"
    report = (tmp_path / "store" / "runs" / second["run_id"] / "report" / "report.md").read_text()
    assert f"Promotion: **not promoted**: `rt`'s champion stays ({decision['reason']})" in report

    out = batch_infer("models/rt@champion", str(small_data["test"]), str(tmp_path / "labelled"), storage_root=root)
    assert out["rows"] == 128 and len(pq.read_table(tmp_path / "labelled")) == 128
    assert storage.read_json(str(tmp_path / "labelled" / MARKER))["model"]["uri"] == f"{first['run_dir']}/model"


def test_an_unknown_champion_is_refused_with_where_it_was_looked_for(tmp_path):
    with pytest.raises(ValueError, match=f"models/nobody@champion: no champion at {tmp_path}/models/nobody/champion"):
        resolve("models/nobody@champion", str(tmp_path))
    assert resolve(str(tmp_path / "a-model"), str(tmp_path)) == str(tmp_path / "a-model")
