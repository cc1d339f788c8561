"""params.yaml validation: every bad value is one clear error naming the file and the key; unknown keys, wrong
types, out-of-range and non-finite numbers are refused; a target's own options are validated by the target."""

from __future__ import annotations

import pytest

from pipeline import cli, config, targets
from pipeline.errors import KilnError
from conftest import REPO, write_params as _write


def test_repository_params_load():
    cfg = config.load(REPO / "params.yaml")
    assert cfg.model("embedder").input_shape == (3, 150, 150)
    assert cfg.data.sets["golden"].per_photo >= 1 and len(cfg.data.template) == 5
    assert cfg.engine("embedder-ort-cpu-int8").name == "embedder-ort-cpu-int8"     # names come from the keys
    targets.check(cfg)                                                           # every target's options valid


@pytest.mark.parametrize("mutate, key", [
    (lambda r: r["export"].pop("opset"), "export.opset: missing"),
    (lambda r: r["export"].update(exporter="tflite"), "export.exporter: Input should be 'torchscript' or 'dynamo'"),
    (lambda r: r["export"]["parity"].update(max_abs="small"), "export.parity.max_abs: "),
    (lambda r: r["data"].update(template=[[1, 2]]), "data.template"),
    (lambda r: r["data"]["augment"].update(brightness=[1.2, 0.8]), "data.augment"),
    (lambda r: r["data"]["sets"]["golden"].update(per_photo=0), "data.sets.golden.per_photo: "),
    (lambda r: r["models"]["embedder"].update(factory="nocolon"), "models.embedder.factory"),
    (lambda r: r["validate"].update(cosine_min=float("nan")), "validate.cosine_min: Input should be a finite number"),
    (lambda r: r["validate"].update(l2_maxx=r["validate"].pop("l2_max")), "validate.l2_maxx: unknown key"),
    (lambda r: r["validate"]["detector"].update(box_iou_min="0.9"), "validate.detector.box_iou_min"),
    (lambda r: r["bench"].update(batches=[1, 0]), "bench.batches"),
    (lambda r: r["register"].update(timeout_s=-1), "register.timeout_s"),
    (lambda r: r["targets"]["ort-cpu"].update(enabled="yes"), "targets.ort-cpu.enabled"),
    (lambda r: r["engines"].update({"../../victim": r["engines"].pop("embedder-ort-cpu-fp32")}),
     "engines.../../victim"),
    (lambda r: r["models"].update({"a b": r["models"]["aligner"]}), "models.a b"),
    (lambda r: r["quantize"]["recipes"].update({"x/y": r["quantize"]["recipes"]["ort"]}), "quantize.recipes.x/y"),
    (lambda r: r.update(extra_section={}), "extra_section: unknown key"),
    (lambda r: r["calibrate"].update(candidates=["minmax", "kl"]), "calibrate.candidates.1"),
    (lambda r: r["calibrate"].update(candidates=["percentile-85"]), "calibrate: Value error, percentile-85"),
    (lambda r: r["calibrate"].update(candidates=["entropy", "entropy"]), "candidates must be distinct"),
    (lambda r: r["calibrate"].update(candidates=[]), "calibrate.candidates"),
    (lambda r: r["calibrate"].update(select_recipe="fp4"), "calibrate.select_recipe: no recipe named 'fp4'"),
    (lambda r: r["calibrate"].update(select_recipe="ort-float-fc"), "calibrate.select_recipe: recipe 'ort-float-fc'"),
    (lambda r: r["engines"]["embedder-ort-cpu-fp32"].update(name="other"), "embedder-ort-cpu-fp32.name"),
])
def test_bad_values_name_file_and_key(tmp_path, mutate, key):
    p = _write(tmp_path, mutate)
    with pytest.raises(KilnError) as e:
        config.load(p)
    assert str(p) in e.value.message and key in e.value.message and e.value.hint, e.value.message


def test_typo_gets_a_suggestion(tmp_path):
    p = _write(tmp_path, lambda r: r["validate"].update(l2_maxx=r["validate"].pop("l2_max")))
    with pytest.raises(KilnError) as e:
        config.load(p)
    assert e.value.hint == "did you mean `l2_max`?"


@pytest.mark.parametrize("option, value, message", [
    ("graph_optimisation", "all", "targets.ort-cpu.graph_optimisation: unknown option"),
    ("threads", "two", "targets.ort-cpu.threads: Input should be a valid integer"),
    ("threads", -3, "targets.ort-cpu.threads: Input should be greater than or equal to 0"),
    ("graph_optimization", "max", "targets.ort-cpu.graph_optimization: Input should be 'basic', 'extended' or 'all'"),
])
def test_target_options_are_validated_by_the_target(tmp_path, option, value, message):
    cfg = config.load(_write(tmp_path, lambda r: r["targets"]["ort-cpu"].update({option: value})))
    with pytest.raises(KilnError) as e:
        targets.options(cfg, "ort-cpu")
    assert e.value.message.startswith(str(tmp_path / "params.yaml")) and message in e.value.message


def test_unknown_target_is_refused_by_the_registry_check(tmp_path):
    cfg = config.load(_write(tmp_path, lambda r: r["targets"].update(gpu9={"enabled": True})))
    with pytest.raises(KilnError, match=r"targets.gpu9: unknown target") as e:
        targets.check(cfg)
    assert "ort-cpu" in e.value.hint


def test_dag_render_refuses_bad_target_options(tmp_path, capsys):
    """`kiln dag` (scripts/run.sh runs it before dvc repro) validates every target's options: no stage runs first."""
    p = _write(tmp_path, lambda r: r["targets"]["ort-cpu"].update(threads="two"))
    assert cli.main(["--params", str(p), "dag", "--check"]) == 2
    assert "targets.ort-cpu.threads" in capsys.readouterr().err


def test_cli_prints_error_and_hint_without_traceback(tmp_path, capsys):
    p = _write(tmp_path, lambda r: r["export"].update(exporter="tflite"))
    assert cli.main(["--params", str(p), "export", "embedder"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and "\nhint: " in err and "Traceback" not in err


def test_unknown_model_is_named(tmp_path):
    with pytest.raises(KilnError, match="no model named 'detector2'"):
        config.load(REPO / "params.yaml").model("detector2")
