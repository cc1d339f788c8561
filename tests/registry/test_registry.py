"""register / promote / rollback / history against real MLflow: a SQLite store per test, and one tracking server.

The engines are fake but real: a few bytes in `model.onnx`, a manifest made by `pipeline.manifest`, and a
validation.json that points at that manifest, laid out where the stages put them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from pipeline import cli, paths, registry
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import artifact_digest, build_manifest, identity_digest, input_ref, manifest_path, write_manifest
from pipeline.registry import aliases as aliases_mod
from pipeline.registry.client import tracking_uri
from pipeline.stages import register as register_stage


def register(cfg, name, root, **kw):
    return register_stage.run(cfg, name, root, **kw)


def receipt_doc(name, root) -> dict:
    return json.loads((paths.receipt(name, root) / "receipt.json").read_text())

FP32, INT8 = "embedder-ort-cpu-fp32", "embedder-ort-cpu-int8"   # engines of the repository's params.yaml
REPO = Path(__file__).resolve().parents[2]


def make_engine(root: Path, cfg, name: str, payload: bytes, verdict: str = "pass", bench: dict | None = None,
                onnxruntime: str = "1.32.0") -> dict:
    """Write artifacts/engines/<name>/ (file + manifest) and its verdict (validation.json + manifest), laid out
    where the stages put them; optionally bench.json."""
    spec = cfg.engine(name)
    d = paths.engine(name, root)
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    (d / "model.onnx").write_bytes(payload)
    (d / "io.json").write_text('{"input": [1, 3, 150, 150]}')
    m = build_manifest(kind="engine", name=name, directory=d, files=[d / "model.onnx", d / "io.json"], inputs=[],
                       toolchain={"target.ort-cpu": {"onnxruntime": onnxruntime, "isa": ["avx2"]}},
                       build={"options": {"opt_level": 99}}, code={"pipeline/stages/compile.py": "c0de"},
                       params={f"engines.{name}": {"model": spec.model}}, model=spec.model, target=spec.target,
                       precision=spec.precision)
    write_manifest(d, m)
    write_verdict(root, name, m, verdict)
    if bench is not None:
        b = paths.bench(spec.model, root)
        b.mkdir(parents=True, exist_ok=True)
        (b / "bench.json").write_text(json.dumps({"engines": {name: bench}}))
    return m


def write_verdict(root: Path, name: str, engine_manifest: dict, verdict: str) -> dict:
    v = paths.validation(name, root)
    if v.exists():
        shutil.rmtree(v)
    v.mkdir(parents=True)
    (v / "validation.json").write_text(json.dumps({
        "engine": name, "verdict": verdict, "metrics": {"cosine_min": 0.998, "top1_agreement": 1.0, "l2@max": 0.05},
        "failures": [] if verdict == "pass" else ["cosine_min 0.2 < 0.99"],
        "engine_manifest_xxh3_128": identity_digest(engine_manifest)}))
    vm = build_manifest(kind="validation", name=name, directory=v, files=[v / "validation.json"],
                        inputs=[input_ref("engine", manifest_path(paths.engine(name, root), name), root)],
                        toolchain={}, build={}, code={}, params={}, results={"verdict": verdict})
    write_manifest(v, vm)
    return vm


@pytest.fixture
def root(tmp_path, template_db, monkeypatch) -> Path:
    """A project root with its own tracking database (MLFLOW_TRACKING_URI → tmp SQLite) and a fixed actor."""
    root = tmp_path / "proj"
    root.mkdir()
    db = tmp_path / "mlflow" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(template_db, db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.setenv("KILN_ACTOR", "alice")
    return root


def client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"], registry_uri=os.environ["MLFLOW_TRACKING_URI"])


def aliases(name: str) -> dict[str, int]:
    """RegisteredModel.aliases values are int from a SQL store and str over REST (3.17.2); compare as int."""
    return {k: int(v) for k, v in client().get_registered_model(name).aliases.items()}


def production(name: str) -> int:
    return int(client().get_model_version_by_alias(name, "production").version)


def stored_dir(name: str, version: int) -> Path:
    """Where the file artifact store keeps a version's files on disk."""
    c = client()
    mv = c.get_model_version(name, str(version))
    # ModelVersion.model_id stays None with a SQL registry store (it has no column for it); the source has the id
    model_id = mv.source.removeprefix("models:/")
    return Path(urlparse(c.get_logged_model(model_id).artifact_location).path)


# ---------------------------------------------------------------------------------------------- register
def test_register_is_idempotent_and_new_bytes_make_a_new_candidate(cfg, root):
    make_engine(root, cfg, FP32, b"engine-bytes-v1", bench={"latency_ms@b1": 1.5, "throughput": 900.0})
    t0 = time.perf_counter()
    r1 = register(cfg, FP32, root)
    t1 = time.perf_counter()
    receipt_bytes = (paths.receipt(FP32, root) / "receipt.json").read_bytes()
    again = register(cfg, FP32, root)
    t2 = time.perf_counter()
    print(f"\nregister: first {t1 - t0:.2f} s, idempotent rerun {t2 - t1:.2f} s")

    assert r1.new and r1.name == "kiln-embedder-ort-cpu-fp32" and r1.version == 1
    assert not again.new and (again.version, again.sha256) == (1, r1.sha256)
    assert (paths.receipt(FP32, root) / "receipt.json").read_bytes() == receipt_bytes    # deterministic receipt
    doc = receipt_doc(FP32, root)
    assert doc["sha256"] == r1.sha256 and doc["verdict"] == "pass" and "version" not in doc  # content, not registry
    assert "tracking_uri" not in doc and r1.tracking_uri == os.environ["MLFLOW_TRACKING_URI"]
    c = client()
    assert len(c.search_model_versions(f"name = '{r1.name}'")) == 1
    mv = c.get_model_version(r1.name, "1")
    assert mv.tags["sha256"] == r1.sha256 == artifact_digest(json.loads(
        manifest_path(paths.engine(FP32, root), FP32).read_text()))
    assert {k: mv.tags[k] for k in ("target", "precision", "toolchain.target.ort-cpu.onnxruntime", "validation",
                                    "kind")} == {"target": "ort-cpu", "precision": "fp32",
                                                 "toolchain.target.ort-cpu.onnxruntime": "1.32.0",
                                                 "validation": "pass", "kind": "engine"}
    params = c.get_run(mv.run_id).data.params                              # the immutable digests
    assert params["kiln.sha256"] == r1.sha256 and params["kiln.verdict"] == "pass"
    assert params["kiln.validation_manifest_xxh3_128"] == doc["validation_manifest_xxh3_128"]
    assert mv.source.startswith("models:/m-")
    # the LoggedModel carries files, manifest, the verdict with its manifest, and bench metrics
    stored = stored_dir(r1.name, 1)
    assert sorted(p.relative_to(stored).as_posix() for p in stored.rglob("*") if p.is_file()) == [
        f"{FP32}.manifest.json", "io.json", "kiln/bench.json", f"kiln/{FP32}.manifest.json", "kiln/validation.json",
        "model.onnx"]
    lm = c.get_logged_model(mv.source.removeprefix("models:/"))
    metrics = {m.key: m.value for m in lm.metrics}
    assert metrics["validation.cosine_min"] == 0.998 and metrics["validation.l2_max"] == 0.05
    assert metrics["bench.latency_ms_b1"] == 1.5
    assert c.get_run(mv.run_id).info.run_name == FP32
    assert aliases(r1.name) == {"candidate": 1}

    make_engine(root, cfg, FP32, b"engine-bytes-v2")                        # new bytes → new version
    r2 = register(cfg, FP32, root)
    assert r2.new and r2.version == 2 and r2.sha256 != r1.sha256
    assert aliases(r1.name) == {"candidate": 2}
    assert "production" not in aliases(r1.name)
    assert receipt_doc(FP32, root)["sha256"] == r2.sha256
    make_engine(root, cfg, FP32, b"engine-bytes-v1", bench={"latency_ms@b1": 1.5, "throughput": 900.0})
    assert register(cfg, FP32, root).version == 1                           # old bytes → the old version again
    assert len(c.search_model_versions(f"name = '{r1.name}'")) == 2
    candidate_moves = registry.history(cfg, FP32, root, alias="candidate")
    assert [(m.from_version, m.to_version, m.action) for m in candidate_moves] == [(None, 1, "register"),
                                                                                 (1, 2, "register")]


def test_register_refuses_unverified_unvalidated_or_failed_engines(cfg, root, capsys):
    make_engine(root, cfg, FP32, b"abc")
    (paths.engine(FP32, root) / "model.onnx").write_bytes(b"abd")               # file no longer matches manifest
    with pytest.raises(GateFailed, match="do not match their manifest"):
        register(cfg, FP32, root)

    make_engine(root, cfg, FP32, b"abc")
    shutil.rmtree(paths.validation(FP32, root))
    with pytest.raises(KilnError, match="no verdict to register") as e:
        register(cfg, FP32, root)
    assert "validate@" in e.value.hint

    old = make_engine(root, cfg, FP32, b"abc")
    make_engine(root, cfg, FP32, b"abcd")                                        # rebuilt after validation
    write_verdict(root, FP32, old, "pass")
    with pytest.raises(KilnError, match="validated a different build"):
        register(cfg, FP32, root)

    make_engine(root, cfg, FP32, b"abc", verdict="fail")                         # a failed verdict: not a candidate
    with pytest.raises(GateFailed, match="validation failed") as e:
        register(cfg, FP32, root)
    assert "--allow-failed" in e.value.hint
    r = register(cfg, FP32, root, allow_failed=True)                            # deliberately: no alias, warned
    assert r.new and aliases(r.name) == {} and "WARNING" in capsys.readouterr().err

    with pytest.raises(KilnError, match="no engine named"):
        register(cfg, "nope", root)


def test_register_reads_the_bench_gate_of_exactly_this_build(cfg, root, capsys):
    """register@ depends on the engine's own bench verdict (no timings): a failed one refuses registration, an
    edited one or one about other builds is refused, and the same builds and verdicts give the same bytes."""
    from pipeline.gates import benchgate

    make_engine(root, cfg, FP32, b"fp32")
    make_engine(root, cfg, INT8, b"int8")
    gate = benchgate.path("embedder", INT8, root)
    bench_identity = {"toolchain": {}, "code": {"pipeline/stages/bench.py": "c0de"}, "params": {}}

    def write(verdict: str) -> bytes:
        benchgate.write(cfg, "embedder", {FP32: "pass", INT8: verdict}, [], bench_identity, root)
        return gate.read_bytes()

    write("fail")
    doc = json.loads(gate.read_text())
    assert doc["gate"]["int8_vs"] == FP32 and [r["role"] for r in doc["inputs"]] == \
        [f"engine:{INT8}", f"engine:{FP32}", "validation"]
    with pytest.raises(GateFailed, match="bench gate failed") as e:
        register(cfg, INT8, root)
    assert "--allow-failed" in e.value.hint
    r = register(cfg, INT8, root, allow_failed=True)                 # deliberately: no alias, warned
    assert r.new and aliases(r.name) == {} and "FAILED bench gate" in capsys.readouterr().err

    assert write("pass") == write("pass")                            # same builds and verdict, same bytes
    gate.write_text(gate.read_text().replace('"pass"', '"fail"'))   # edited: its manifest says otherwise
    with pytest.raises(KilnError, match="does not verify"):
        register(cfg, INT8, root)
    write("pass")
    make_engine(root, cfg, FP32, b"fp32 rebuilt")                   # the sibling it was timed against changed
    with pytest.raises(KilnError, match="about other builds") as e:
        register(cfg, INT8, root)
    assert "dvc repro dag/bench/dvc.yaml:bench@embedder" in e.value.hint
    write("pass")
    assert register(cfg, INT8, root).verdict == "pass"
    assert client().get_model_version(f"kiln-{INT8}", "1").tags["bench_gate"] == "fail"


# ---------------------------------------------------------------------------------------------- promote
def test_promote_refuses_a_failed_validation_even_with_an_edited_tag(cfg, root):
    make_engine(root, cfg, INT8, b"int8-but-wrong", verdict="fail")
    r = register(cfg, INT8, root, allow_failed=True)                        # registered, verdict tagged
    assert client().get_model_version(r.name, str(r.version)).tags["validation"] == "fail"
    client().set_model_version_tag(r.name, str(r.version), "validation", "pass")  # talked around? no
    with pytest.raises(GateFailed, match="stored validation verdict is 'fail'"):
        registry.promote(cfg, r.name, r.version, root)
    assert "production" not in aliases(r.name)
    assert registry.history(cfg, r.name, root, alias="production") == []


@pytest.mark.parametrize("tamper", ["file", "file+manifest", "manifest-only", "verdict", "verdict+manifest"])
def test_promote_refuses_tampered_artifacts(cfg, root, tamper):
    m = make_engine(root, cfg, FP32, b"good-engine", verdict="fail" if tamper.startswith("verdict") else "pass")
    r = register(cfg, FP32, root, allow_failed=True)
    stored = stored_dir(r.name, r.version)
    engine_file, stored_manifest = stored / "model.onnx", stored / f"{FP32}.manifest.json"
    verdict_file, verdict_manifest = stored / "kiln" / "validation.json", stored / "kiln" / f"{FP32}.manifest.json"
    from pipeline.manifest import file_digests

    if tamper in ("file", "file+manifest"):
        engine_file.write_bytes(b"evil-engine")
    if tamper == "file+manifest":                        # a careful attacker also fixes the stored manifest
        m["files"] = [{**f, **file_digests(engine_file)} if f["path"] == "model.onnx" else f for f in m["files"]]
        stored_manifest.write_text(json.dumps(m))
    if tamper == "manifest-only":                        # files intact, provenance rewritten
        m["build"]["options"] = {"opt_level": 0}
        stored_manifest.write_text(json.dumps(m))
    if tamper.startswith("verdict"):                     # a failed verdict edited to pass
        doc = json.loads(verdict_file.read_text())
        verdict_file.write_text(json.dumps({**doc, "verdict": "pass", "failures": []}))
        if tamper == "verdict+manifest":
            vm = json.loads(verdict_manifest.read_text())
            vm["files"] = [{**f, **file_digests(verdict_file)} for f in vm["files"]]
            verdict_manifest.write_text(json.dumps(vm))
    expected = {"file": "model.onnx: ", "file+manifest": "content digest", "manifest-only": "identity digest",
                "verdict": "validation.json: ", "verdict+manifest": "validation manifest's digest"}[tamper]
    with pytest.raises(GateFailed, match="tampered") as e:
        registry.promote(cfg, r.name, r.version, root)
    assert expected in e.value.message, e.value.message
    assert "production" not in aliases(r.name)


def test_promote_promote_rollback_and_history(cfg, root, monkeypatch):
    versions = []
    for i in range(3):
        make_engine(root, cfg, FP32, f"engine-{i}".encode())
        versions.append(register(cfg, FP32, root).version)
    assert versions == [1, 2, 3]
    name = registry.registered_name(cfg, FP32)

    a = registry.promote(cfg, name, 1, root)
    monkeypatch.setenv("KILN_ACTOR", "bob")
    b = registry.promote(cfg, FP32, "2", root, reason="faster")             # engine name works too
    assert (a.from_version, a.to_version, b.from_version, b.to_version) == (None, 1, 1, 2)
    assert registry.promote(cfg, name, 2, root).changed is False            # already production: nothing recorded
    c = registry.promote(cfg, name, 3, root, actor="carol")
    assert production(name) == 3

    back = registry.rollback(cfg, name, root)
    assert (back.from_version, back.to_version, back.action) == (3, 2, "rollback")
    assert production(name) == 2
    assert registry.rollback(cfg, name, root).to_version == 1               # and once more, to the first
    with pytest.raises(KilnError, match="first production version") as e:
        registry.rollback(cfg, name, root)
    assert not isinstance(e.value, GateFailed)
    assert production(name) == 1
    assert aliases(name) == {"candidate": 3, "production": 1}

    prod = registry.history(cfg, name, root, alias="production")
    assert [(m.action, m.from_version, m.to_version, m.actor) for m in prod] == [
        ("promote", None, 1, "alice"), ("promote", 1, 2, "bob"), ("promote", 2, 3, "carol"),
        ("rollback", 3, 2, "bob"), ("rollback", 2, 1, "bob")]
    assert prod[1].reason.startswith("faster; outside every production system: no production system runs ") \
        and c.reason.startswith("promote v3: validation pass")
    # round 5: an engine no production system runs moves with a word — in the output and the record
    assert all("(no system is in production), so this moves no deployed system" in m.reason for m in prod), prod
    stamps = [m.at for m in prod]
    assert stamps == sorted(stamps) and all(s.endswith("+00:00") for s in stamps)
    assert len(registry.history(cfg, name, root)) == 3 + 5                   # 3 candidate moves + 5 production
    mv1 = client().get_model_version(name, "1")
    assert mv1.tags["production_by"] == "bob" and mv1.tags["production_at"] == prod[-1].at
    assert not [m.name for m in client().search_registered_models() if m.name.endswith(".lock")]  # locks released


def test_rollback_refuses_without_history_or_when_moved_outside_kiln(cfg, root):
    make_engine(root, cfg, FP32, b"one")
    r = register(cfg, FP32, root)
    with pytest.raises(KilnError, match="nothing is in production"):
        registry.rollback(cfg, r.name, root)
    make_engine(root, cfg, FP32, b"two")
    register(cfg, FP32, root)
    registry.promote(cfg, r.name, 1, root)
    client().set_registered_model_alias(r.name, "production", "2")           # someone used the MLflow UI
    with pytest.raises(KilnError, match="moved outside kiln"):
        registry.rollback(cfg, r.name, root)
    with pytest.raises(KilnError, match="no version 9"):
        registry.promote(cfg, r.name, 9, root)
    with pytest.raises(KilnError, match="no registered model"):
        registry.promote(cfg, "kiln-nothing", 1, root)


def test_cli(cfg, root, monkeypatch, capsys):
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    monkeypatch.chdir(root)
    make_engine(root, cfg, INT8, b"bad", verdict="fail")
    assert cli.main(["register", INT8]) == 1                                        # a failed verdict: a gate
    assert "not registered" in capsys.readouterr().err
    assert cli.main(["register", "--allow-failed", INT8]) == 0
    assert "registered new version kiln-embedder-ort-cpu-int8 v1" in capsys.readouterr().out
    assert cli.main(["register", INT8]) == 1                                        # still failed: refused again
    capsys.readouterr()
    assert cli.main(["promote", "kiln-embedder-ort-cpu-int8", "1"]) == 1            # a gate: exit 1
    assert "stored validation verdict is 'fail'" in capsys.readouterr().err
    make_engine(root, cfg, INT8, b"good")
    assert cli.main(["register", INT8]) == 0
    assert cli.main(["register", INT8]) == 0
    assert "already registered as version kiln-embedder-ort-cpu-int8 v2" in capsys.readouterr().out
    assert cli.main(["promote", INT8, "2"]) == 0
    assert "kiln-embedder-ort-cpu-int8@production none → v2 by alice" in capsys.readouterr().out
    assert cli.main(["rollback", INT8]) == 2                                        # user error: exit 2
    err = capsys.readouterr().err
    assert "kiln: error:" in err and "hint:" in err and "Traceback" not in err
    assert cli.main(["history", INT8]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")][:3] == ["at (UTC)", "alias", "action"]
    assert len(lines) == 2 + 2                                                      # header, rule, 2 moves
    assert [c.strip() for c in lines[-1].strip("|").split("|")][1:6] == ["production", "promote", "-", "v2", "alice"]
    record = json.loads((root / "artifacts/records/register@embedder-ort-cpu-int8.json").read_text())
    assert record["version"] == 2 and record["registered_model"] == "kiln-embedder-ort-cpu-int8"


def test_defaults_and_lazy_import(cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(cfg, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://u:secret@127.0.0.1:5000")
    assert tracking_uri(cfg, tmp_path) == "http://u:secret@127.0.0.1:5000"
    assert registry.redact("see http://u:secret@127.0.0.1:5000/x and https://a@b/c") == \
        "see http://127.0.0.1:5000/x and https://b/c"
    out = subprocess.run([sys.executable, "-c", "import sys, pipeline.registry, pipeline.cli; "
                          "print('mlflow' in sys.modules)"], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_over_http_tracking_server(cfg, root, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a dead server fails the test now, not in minutes
    make_engine(root, cfg, FP32, b"served-1")
    t0 = time.perf_counter()
    r1 = register(cfg, FP32, root)
    print(f"register over HTTP: {time.perf_counter() - t0:.2f} s")
    again = register(cfg, FP32, root)
    assert (again.version, again.new, again.sha256, again.tracking_uri) == (1, False, r1.sha256, mlflow_server)
    make_engine(root, cfg, FP32, b"served-2")
    assert register(cfg, FP32, root).version == 2
    assert registry.promote(cfg, r1.name, 1, root).to_version == 1
    assert registry.promote(cfg, r1.name, 2, root).from_version == 1
    assert registry.rollback(cfg, r1.name, root).to_version == 1
    assert production(r1.name) == 1
    assert [(m.alias, m.action, m.to_version) for m in registry.history(cfg, r1.name, root)] == [
        ("candidate", "register", 1), ("candidate", "register", 2), ("production", "promote", 1),
        ("production", "promote", 2), ("production", "rollback", 1)]
    assert not (root / "mlruns").exists() and not (root / "mlflow.db").exists()


# ---------------------------------------------------------------------------------------------- indexes
def make_index(root: Path, size: int, payload: bytes, verdict: str = "pass") -> dict:
    d = paths.index(size, root)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "index.faiss").write_bytes(payload)
    name = paths.gallery_name(size)
    m = build_manifest(kind="index", name=name, model="embedder", target="faiss-cpu", precision="fp32", directory=d,
                       files=[d / "index.faiss"], inputs=[], toolchain={}, build={"spec": "flat"}, code={}, params={})
    write_manifest(d, m)
    v = paths.matching(size, root)
    shutil.rmtree(v, ignore_errors=True)
    v.mkdir(parents=True)
    (v / "validation.json").write_text(json.dumps({"engine": name, "kind": "index", "verdict": verdict,
                                                   "failures": [] if verdict == "pass" else ["recall"],
                                                   "metrics": {"recall@1": 1.0, "p50_ms_b1": 0.3},
                                                   "engine_manifest_xxh3_128": identity_digest(m)}))
    write_manifest(v, build_manifest(kind="validation", name=name, directory=v, files=[v / "validation.json"],
                                     inputs=[input_ref("index", manifest_path(d, name), root)], toolchain={},
                                     build={}, code={}, params={}, results={"verdict": verdict}))
    return m


def test_an_index_registers_as_an_index_and_its_refusals(cfg, root):
    from pipeline.stages import register_index

    size = cfg.matching.gallery_sizes[0]
    make_index(root, size, b"faiss-bytes")
    shutil.rmtree(paths.matching(size, root))
    with pytest.raises(KilnError, match="no verdict to register"):
        register_index.run(cfg, size, root)
    make_index(root, size, b"faiss-bytes")
    (paths.index(size, root) / "index.faiss").write_bytes(b"faiss-bytez")
    with pytest.raises(GateFailed, match="do not match their manifest"):
        register_index.run(cfg, size, root)
    make_index(root, size, b"faiss-bytes", verdict="fail")
    with pytest.raises(GateFailed, match="validation failed"):
        register_index.run(cfg, size, root)
    with pytest.raises(KilnError, match="is not in matching.gallery_sizes"):
        register_index.run(cfg, 12345, root)

    make_index(root, size, b"faiss-bytes")
    r = register_index.run(cfg, size, root)
    assert r.new and r.name == f"kiln-gallery-{size}"
    c = client()
    mv = c.get_model_version(r.name, "1")
    assert mv.tags["kind"] == "index" and c.get_registered_model(r.name).tags["kind"] == "index"
    assert "precision" not in c.get_registered_model(r.name).tags or mv.tags["target"] == "faiss-cpu"
    assert registry.promote(cfg, r.name, 1, root).to_version == 1       # an index promotes like an engine


def test_a_live_holder_on_this_host_keeps_its_lock_even_past_its_lease():
    """A holder starved of CPU (or waiting on a busy SQLite) may renew late: on its own host it is judged by whether
    its process lives; on another host by its lease; a lease 10× past expires anywhere (a reused pid)."""
    import socket

    from pipeline.registry.client import LEASE_S, Registry

    now, here = time.time(), socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    assert not Registry._is_stale({"host": here, "pid": str(os.getpid()), "expires": str(now - LEASE_S)})
    assert Registry._is_stale({"host": here, "pid": dead, "expires": str(now + LEASE_S)})
    assert Registry._is_stale({"host": "elsewhere", "pid": "1", "expires": str(now - 1)})
    assert not Registry._is_stale({"host": "elsewhere", "pid": "1", "expires": str(now + LEASE_S)})
    assert Registry._is_stale({"host": here, "pid": str(os.getpid()), "expires": str(now - 10 * LEASE_S)})
    assert Registry._is_stale({"host": here, "pid": str(os.getpid()), "expires": "soon"})


# ---------------------------------------------------------------------------------------------- host classes
BENCH_IDENTITY = {"toolchain": {}, "code": {"pipeline/stages/bench.py": "c0de"}, "params": {}}


def test_bench_verdicts_round_trip_including_not_faster_here(cfg, tmp_path):
    """Every bench verdict, `not-faster-here` included, is written and read back as itself; another one is refused."""
    from pipeline.gates import benchgate

    make_engine(tmp_path, cfg, FP32, b"fp32")
    make_engine(tmp_path, cfg, INT8, b"int8")
    assert "not-faster-here" in benchgate.VERDICTS
    for verdict in benchgate.VERDICTS:
        benchgate.write(cfg, "embedder", {FP32: "pass", INT8: verdict}, [], BENCH_IDENTITY, tmp_path)
        assert benchgate.check(cfg, INT8, tmp_path) == verdict and benchgate.check(cfg, FP32, tmp_path) == "pass"
    with pytest.raises(AssertionError):
        benchgate.write(cfg, "embedder", {FP32: "pass", INT8: "slow"}, [], BENCH_IDENTITY, tmp_path)


def _bench_rows(root: Path, cfg, gate: str, **row) -> None:
    """This host's bench of the embedder (bench.json) and INT8's verdict file, as bench@embedder writes them."""
    from pipeline.gates import benchgate

    b = paths.bench("embedder", root)
    b.mkdir(parents=True, exist_ok=True)
    (b / "bench.json").write_text(json.dumps({"engines": {INT8: {**row, "bench_gate": gate}, FP32: {}}}))
    benchgate.write(cfg, "embedder", {FP32: "pass", INT8: gate}, [], BENCH_IDENTITY, root)


def test_a_second_host_class_adds_its_bench_rows_to_the_same_version(cfg, root, monkeypatch, capsys):
    """The same content benched on host class A, then on B: one version, A's rows unchanged, B's beside them; a
    rerun from A changes nothing; B's `not-faster-here` (an immutable run parameter) is said in promote's record."""
    from pipeline.report import leaderboard
    from pipeline.report import page as report

    A, B = "x86-64-avx512-vnni", "x86-64-avx2"
    make_engine(root, cfg, FP32, b"fp32")
    make_engine(root, cfg, INT8, b"int8")
    _bench_rows(root, cfg, "pass", b1_p50_ms=2.0, b1_speedup_vs_fp32=3.0)
    r1 = register(cfg, INT8, root, host_class=A)
    c = client()
    first = dict(c.get_model_version(r1.name, "1").tags)
    assert r1.new and first["kiln.host_class"] == A and first["kiln.host_classes"] == A
    assert first[f"bench.{A}.b1_p50_ms"] == "2" and first[f"bench.{A}.verdict"] == "pass"
    assert not any(k.startswith(f"bench.{B}.") for k in first)

    _bench_rows(root, cfg, "not-faster-here", b1_p50_ms=5.0, b1_speedup_vs_fp32=1.04)    # host class B
    r2 = register(cfg, INT8, root, host_class=B)
    assert not r2.new and r2.version == 1 and r2.sha256 == r1.sha256 and r2.host_class_added == B
    assert len(c.search_model_versions(f"name = '{r1.name}'")) == 1                     # rows added, no version
    second = dict(c.get_model_version(r1.name, "1").tags)
    assert {k: v for k, v in second.items() if k in first and k != "kiln.host_classes"} == \
        {k: v for k, v in first.items() if k != "kiln.host_classes"}                     # A's rows unchanged
    assert second[f"bench.{B}.b1_p50_ms"] == "5" and second[f"bench.{B}.b1_speedup_vs_fp32"] == "1.04"
    assert second[f"bench.{B}.verdict"] == "not-faster-here" and second["kiln.host_class"] == A
    assert second["kiln.host_classes"] == f"{B},{A}"
    run = c.get_run(c.get_model_version(r1.name, "1").run_id).data
    assert run.params[f"kiln.bench.{A}.verdict"] == "pass" and run.params[f"kiln.bench.{B}.verdict"] == \
        "not-faster-here"
    assert run.metrics[f"bench.{A}.b1_p50_ms"] == 2.0 and run.metrics[f"bench.{B}.b1_p50_ms"] == 5.0

    _bench_rows(root, cfg, "pass", b1_p50_ms=9.0, b1_speedup_vs_fp32=1.5)               # A again, other numbers
    r3 = register(cfg, INT8, root, host_class=A)
    assert not r3.new and r3.host_class_added is None
    assert dict(c.get_model_version(r1.name, "1").tags) == second                        # nothing replaced

    from pipeline.registry.registration import bench_rows        # what `kiln history` shows per host class
    rows, forged = bench_rows(cfg, INT8, root)
    assert [(r["version"], r["host_class"], r["verdict"], r["b1_p50_ms"], r["first"]) for r in rows] == [
        (1, B, "not-faster-here", 5.0, False), (1, A, "pass", 2.0, True)] and forged == []

    rows, _ = leaderboard.rows(cfg, root)                    # `kiln report`: the matrix engine × host class
    cells, _ = report.host_matrix(cfg, rows, root)
    mine = {c_["host_class"]: c_ for c_ in cells if c_["engine"] == INT8}
    assert set(mine) == {A, B} and mine[B]["bench_gate"] == "not-faster-here" and mine[A]["p50_ms"] == 2.0
    assert "not faster here" in report.matrix_html(cells)

    m = registry.promote(cfg, r1.name, 1, root)           # marked, not refused: where it runs decides
    assert m.changed and "not faster here on host class x86-64-avx2" in m.reason
    assert aliases(r1.name)["production"] == 1
    assert "not faster here on host class x86-64-avx2" in registry.history(cfg, r1.name, root)[-1].reason

    shutil.copy(REPO / "params.yaml", root / "params.yaml")    # `kiln history`: the moves, then a row per host class
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert cli.main(["history", r1.name]) == 0
    out = capsys.readouterr().out
    assert "bench per host class" in out and "not faster here on host class x86-64-avx2" in out
    assert {l.split("|")[2].strip() for l in out.splitlines() if l.startswith("| v1 ")} == {A, B}


def test_edited_bench_tags_are_never_shown_as_fact(cfg, root, monkeypatch, capsys):
    """Issue 44 item 1: a host class never benched added to the tags, a flipped verdict and an edited number — made
    through the public MLflow client — are not rows of `kiln history` nor cells of `kiln report`: both show what the
    version's run recorded (immutable parameters), and history says loudly which tag disagrees."""
    from pipeline.report import leaderboard
    from pipeline.report import page as report
    from pipeline.registry.registration import bench_rows

    A, FORGED = "x86-64-avx512-vnni", "arm64-sve2"
    make_engine(root, cfg, FP32, b"fp32")
    make_engine(root, cfg, INT8, b"int8")
    _bench_rows(root, cfg, "not-faster-here", b1_p50_ms=5.0, b1_speedup_vs_fp32=1.04)
    r = register(cfg, INT8, root, host_class=A)
    c = client()
    for k, v in ((f"bench.{A}.verdict", "pass"), (f"bench.{A}.b1_p50_ms", "0.5"),
                 ("kiln.host_classes", f"{A},{FORGED}"), (f"bench.{FORGED}.verdict", "pass"),
                 (f"bench.{FORGED}.b1_p50_ms", "0.1")):
        c.set_model_version_tag(r.name, "1", k, v)
    rows, forged = bench_rows(cfg, INT8, root)
    assert [(x["host_class"], x["verdict"], x["b1_p50_ms"]) for x in rows] == [(A, "not-faster-here", 5.0)]
    assert len(forged) == 3 and any(FORGED in f for f in forged), forged

    lrows, _ = leaderboard.rows(cfg, root)
    cells, _ = report.host_matrix(cfg, lrows, root)
    mine = {c_["host_class"]: c_ for c_ in cells if c_["engine"] == INT8}
    assert set(mine) == {A} and mine[A]["bench_gate"] == "not-faster-here" and mine[A]["p50_ms"] == 5.0

    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert cli.main(["history", r.name]) == 0
    out, err = capsys.readouterr()
    assert FORGED not in out and "not-faster-here" in out and "| pass" not in out
    assert err.count("kiln: WARNING:") == 3 and FORGED in err and "Traceback" not in err


def test_history_is_the_record_and_an_alias_moved_outside_kiln_is_said(cfg, root, capsys):
    """Issue 44 items 1 and 2: a move's reason, actor and versions come from its run's parameters — a `reason` tag
    edited through the MLflow client changes nothing shown — and a promote over an alias someone moved outside kiln
    says so (one warning line) and records it in the move's reason."""
    for payload in (b"one", b"two", b"three"):
        make_engine(root, cfg, FP32, payload)
        r = register(cfg, FP32, root)
    registry.promote(cfg, r.name, 1, root, reason="first")
    c = client()
    run_id = c.get_model_version(r.name, "1").tags["production_release_run"]
    c.set_tag(run_id, "reason", "\x1b]8;;https://evil.example\x07approved by security\x1b]8;;\x07")
    c.set_tag(run_id, "actor", "the-ceo")
    (m,) = registry.history(cfg, r.name, root, alias="production")
    assert (m.reason.split(";")[0], m.actor, m.to_version) == ("first", "alice", 1)

    capsys.readouterr()
    c.set_registered_model_alias(r.name, "production", "2")              # someone used the MLflow UI
    moved = registry.promote(cfg, r.name, 3, root)
    err = capsys.readouterr().err
    assert err.count("kiln: WARNING:") == 1 and "moved outside kiln" in err and "v2" in err
    assert moved.from_version == 2 and "moved outside kiln" in moved.reason
    assert "moved outside kiln" in registry.history(cfg, r.name, root, alias="production")[-1].reason
    # round 5: `kiln history` marks the gap — v1 → v2 was never recorded — and a move made since the last record
    c.set_registered_model_alias(r.name, "production", "1")
    marked = registry.history(cfg, r.name, root, alias="production", gaps=True)
    assert [(m.action, m.from_version, m.to_version, m.at) for m in marked] == [
        ("promote", None, 1, marked[0].at), (aliases_mod.OUTSIDE, 1, 2, ""), ("promote", 2, 3, marked[2].at),
        (aliases_mod.OUTSIDE, 3, 1, "now")]
    assert [m.action for m in registry.history(cfg, r.name, root, alias="production")] == ["promote", "promote"]
