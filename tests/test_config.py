"""params.yaml validation: every bad value is one clear error naming the file and the key."""

from __future__ import annotations

import pytest

from pipeline import cli, config
from pipeline.errors import KilnError
from conftest import REPO, write_params as _write


def test_repository_params_load():
    cfg = config.load(REPO / "params.yaml")
    assert cfg.model("embedder").input_shape == (3, 150, 150)
    assert cfg.data.sets["golden"].per_photo >= 1 and len(cfg.data.template) == 5


@pytest.mark.parametrize("mutate, key", [
    (lambda r: r["export"].pop("opset"), "export.opset: missing"),
    (lambda r: r["export"].update(exporter="tflite"), "export.exporter: unknown exporter"),
    (lambda r: r["export"]["parity"].update(max_abs="small"), "export.parity.max_abs: must be float"),
    (lambda r: r["data"].update(template=[[1, 2]]), "data.template: must be a list of 5"),
    (lambda r: r["data"]["augment"].update(brightness=[1.2, 0.8]), "data.augment.brightness"),
    (lambda r: r["data"]["sets"]["golden"].update(per_photo=0), "data.sets.golden.per_photo: 0 must be ≥ 1"),
    (lambda r: r["models"]["embedder"].update(factory="nocolon"), "models.embedder.factory"),
])
def test_bad_values_name_file_and_key(tmp_path, mutate, key):
    p = _write(tmp_path, mutate)
    with pytest.raises(KilnError) as e:
        config.load(p)
    assert str(p) in e.value.message and key in e.value.message and e.value.hint


def test_cli_prints_error_and_hint_without_traceback(tmp_path, capsys):
    p = _write(tmp_path, lambda r: r["export"].update(exporter="tflite"))
    assert cli.main(["--params", str(p), "export", "embedder"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and "\nhint: " in err and "Traceback" not in err


def test_unknown_model_is_named(tmp_path):
    with pytest.raises(KilnError, match="no model named 'detector2'"):
        config.load(REPO / "params.yaml").model("detector2")
