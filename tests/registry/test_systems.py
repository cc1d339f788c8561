"""System versions (issue 35 items 1 and 2): a face system registered, promoted, rolled back and recorded as one, on
real built engines and real MLflow (a SQLite registry per test), and the gallery-compatibility gate an embedder
change must pass.

The module builds, in its own scratch root (from the session's `built` sets and exported embedder), the default
system's five graphs as ORT FP32 engines and the embedder's ORT INT8 engine, each validated, then gates the system
twice with system@ — once with the FP32 embedder, once with the INT8 one — keeping both outputs: two versions of
`kiln-system-dlib-mtcnn`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pytest

from conftest import write_params
from pipeline import cli, config, paths
from pipeline.errors import GateFailed, KilnError
from pipeline.gates import gallery_compat
from pipeline.registry import aliases, systems
from pipeline.stages import calibrate, compile as compile_stage, export, golden, quantize, validate
from pipeline.stages import register as register_stage
from pipeline.stages import system as system_stage
from pipeline.stages import toolchain as toolchain_stage

SYSTEM = "dlib-mtcnn"
NAME = f"kiln-system-{SYSTEM}"
NETS = ("pnet", "rnet", "onet", "aligner")
FP32, INT8 = "embedder-ort-cpu-fp32", "embedder-ort-cpu-int8"
ENGINES = (*(f"{m}-ort-cpu-fp32" for m in NETS), FP32, INT8)
slow = pytest.mark.slow        # the tests on `sysroot`: it builds six engines and gates the system twice


def _variant(embedder: str, **extra):
    def mutate(raw):
        raw["systems"][SYSTEM].update(target="ort-cpu", precision="fp32", engines={"embedder": embedder})
        for k, v in extra.items():
            raw[k].update(v)
    return mutate


@pytest.fixture(scope="module")
def sysroot(built, cfg, tmp_path_factory):
    """A scratch root with the engines built and validated, and system@'s output for each embedder kept aside:
    {"root", "fp32": (cfg, saved output), "int8": (cfg, saved output)}."""
    root = tmp_path_factory.mktemp("sysreg")
    (root / "artifacts").mkdir()
    assets = built / "artifacts" / "assets"
    os.symlink(os.readlink(assets) if assets.is_symlink() else assets, root / "artifacts" / "assets")
    for rel in ("artifacts/data", "artifacts/golden/embedder", "artifacts/export/embedder"):
        shutil.copytree(built / rel, root / rel)
    toolchain_stage.run(cfg, root)
    for m in NETS:
        golden.run(cfg, m, root)
        export.run(cfg, m, root)
    calibrate.run(cfg, "embedder", root, progress=lambda _: None)
    quantize.run(cfg, "embedder", cfg.engine(INT8).recipe, root)
    for e in ENGINES:
        compile_stage.run(cfg, e, root, check=False)
        assert validate.run(cfg, e, root).passed, e
    out = {"root": root}
    for key, engine in (("fp32", FP32), ("int8", INT8)):
        vcfg = config.load(write_params(tmp_path_factory.mktemp(f"params-{key}"), _variant(engine)))
        assert system_stage.run(vcfg, SYSTEM, root)["verdict"] == "pass"
        saved = tmp_path_factory.mktemp(f"system-{key}") / SYSTEM
        shutil.copytree(paths.system(SYSTEM, root), saved)
        out[key] = (vcfg, saved)
    return out


def use(sysroot, key: str):
    """Put the kept system@ output of variant `key` in place; its params."""
    vcfg, saved = sysroot[key]
    d = paths.system(SYSTEM, sysroot["root"])
    shutil.rmtree(d)
    shutil.copytree(saved, d)
    return vcfg


def register_parts(cfg, root: Path, engines=ENGINES) -> dict[str, int]:
    return {e: register_stage.run(cfg, e, root).version for e in engines}


def client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"], registry_uri=os.environ["MLFLOW_TRACKING_URI"])


def production(name: str) -> int | None:
    v = client().get_registered_model(name).aliases.get("production")
    return None if v is None else int(v)


def stored_dir(name: str, version: int) -> Path:
    c = client()
    mv = c.get_model_version(name, str(version))
    return Path(urlparse(c.get_logged_model(mv.source.removeprefix("models:/")).artifact_location).path)


def overwrite(path: Path, data: bytes) -> None:
    """Replace a stored file by a new one (never write through a link into the checkout)."""
    path.unlink()
    path.write_bytes(data)


def two_versions(sysroot) -> tuple[config.Config, config.Config]:
    """Parts registered; system v1 (FP32 embedder) and v2 (INT8 embedder) registered: their params."""
    root = sysroot["root"]
    c32 = use(sysroot, "fp32")
    register_parts(c32, root)
    r1 = systems.register_system(c32, SYSTEM, root)
    c8 = use(sysroot, "int8")
    r2 = systems.register_system(c8, SYSTEM, root)
    assert (r1.version, r1.new, r2.version, r2.new) == (1, True, 2, True)
    return c32, c8


# ---------------------------------------------------------------------------------------------- register
@slow
def test_an_engine_rebuilt_by_other_code_pins_the_version_its_bytes_registered(sysroot, registry_env, tmp_path):
    """Engines are registered once per content: compiled again by changed code (same bytes, a new manifest: what
    every rebuild after a code edit makes), an engine is "already registered" as its first build's version. The
    system gated on the rebuild pins that version — its registered manifest beside the one system@ gated — and
    promotes."""
    from pipeline.manifest import manifest_path, write_manifest

    src = sysroot["root"]
    c32 = use(sysroot, "fp32")
    versions = register_parts(c32, src)
    root = tmp_path / "rebuilt"
    shutil.copytree(src, root, symlinks=True)
    e = "aligner-ort-cpu-fp32"
    mpath = manifest_path(paths.engine(e, root), e)
    m = json.loads(mpath.read_text())
    m["code"] = {**m["code"], "pipeline/edited.py": "0" * 32}             # the same files, built by other code
    mpath.unlink()
    write_manifest(paths.engine(e, root), m)
    assert validate.run(c32, e, root).passed
    assert system_stage.run(c32, SYSTEM, root)["verdict"] == "pass"
    again = register_stage.run(c32, e, root)
    assert (again.version, again.new) == (versions[e], False)

    r = systems.register_system(c32, SYSTEM, root)
    gated = json.loads((paths.system(SYSTEM, root) / paths.SYSTEM_FILE).read_text())["engines"]["aligner"]
    part = next(p for p in r.parts if p.model == "aligner")
    assert part.version == versions[e] and part.gated_xxh3_128 == gated["xxh3_128"] != part.xxh3_128
    assert systems.promote(c32, SYSTEM, r.version, root).system.to_version == r.version


@slow
def test_register_system_pins_parts_and_is_idempotent(sysroot, registry_env):
    root = sysroot["root"]
    c32 = use(sysroot, "fp32")
    with pytest.raises(KilnError, match="no registered model") as e:
        systems.promote(c32, SYSTEM, 1, root)
    assert e.value.hint == f"register it first: kiln register-system {SYSTEM}"
    with pytest.raises(KilnError, match="is not registered") as e:         # parts first
        systems.register_system(c32, SYSTEM, root)
    assert "kiln register " in e.value.hint and "register@" in e.value.hint
    versions = register_parts(c32, root)
    r = systems.register_system(c32, SYSTEM, root)
    assert r.new and (r.name, r.version, r.verdict) == (NAME, 1, "pass")
    described = json.loads((paths.system(SYSTEM, root) / paths.SYSTEM_FILE).read_text())
    assert {p.model: (p.engine, p.version, p.xxh3_128) for p in r.parts} == {
        m: (e["engine"], versions[e["engine"]], e["xxh3_128"]) for m, e in described["engines"].items()}
    again = systems.register_system(c32, SYSTEM, root)
    assert (again.version, again.new, again.sha256) == (1, False, r.sha256)
    c = client()
    mv = c.get_model_version(NAME, "1")
    params = c.get_run(mv.run_id).data.params
    assert params["kiln.part.embedder.registered_model"] == f"kiln-{FP32}" and \
        params["kiln.part.embedder.xxh3_128"] == described["engines"]["embedder"]["xxh3_128"]
    assert params["thresholds.verify_threshold"] == "0.6" and params["kiln.verdict"] == "pass"
    assert sorted(p.relative_to(stored_dir(NAME, 1)).as_posix() for p in stored_dir(NAME, 1).rglob("*")
                  if p.is_file()) == [f"{SYSTEM}.manifest.json", "kiln/parts.json", "system.json", "verdict.json"]
    assert {k: int(v) for k, v in c.get_registered_model(NAME).aliases.items()} == {"candidate": 1}
    c8 = use(sysroot, "int8")                                                  # another embedder: a new version
    assert systems.register_system(c8, SYSTEM, root).version == 2
    with pytest.raises(KilnError, match="stale"):                              # params pick other engines now
        systems.register_system(c32, SYSTEM, root)


# ---------------------------------------------------------------------------------------------- promote / rollback
@slow
def test_promote_int8_system_then_roll_back_every_part(sysroot, registry_env, tmp_path, capsys, monkeypatch):
    """v1 (FP32 embedder) then v2 (INT8): every part in production at its pin, the FP32 → INT8 change measured
    compatible. A part then promoted on its own (pnet v2) returns with the rest on rollback; history shows it all."""
    from test_registry import make_engine

    root = sysroot["root"]
    c32, c8 = two_versions(sysroot)
    m1 = systems.promote(c32, SYSTEM, 1, root, reason="first system")
    assert m1.compat is None and m1.system.to_version == 1 and m1.system.from_version is None
    v1 = {m.name: m.to_version for m in m1.parts}
    assert all(production(n) == v for n, v in v1.items()) and len(v1) == 5

    m2 = systems.promote(c8, SYSTEM, "2", root)
    assert m2.compat is not None and m2.compat.verdict == gallery_compat.COMPATIBLE, m2.compat.summary()
    assert (m2.compat.candidate, m2.compat.production) == (INT8, FP32)
    assert m2.compat.metrics["decision_flips"] == 0 and 0 < m2.compat.metrics["distance_delta_max"] < 0.03
    assert production(NAME) == 2 and production(f"kiln-{INT8}") == 1
    assert [m.changed for m in m2.parts if m.name != f"kiln-{INT8}"] == [False] * 4     # the detector unchanged
    assert f"gallery check: {INT8} vs gallery of {FP32}: compatible (" in m2.system.reason
    assert [m.name for m in m2.retired] == [f"kiln-{FP32}"] and production(f"kiln-{FP32}") is None  # one truth

    fake = tmp_path / "fake"                                   # a second pnet build, promoted on its own
    make_engine(fake, c32, "pnet-ort-cpu-fp32", b"another pnet build")
    assert register_stage.run(c32, "pnet-ort-cpu-fp32", fake).version == 2
    with pytest.raises(KilnError, match=f"production system {SYSTEM} v2 runs v1 as its pnet") as e:
        aliases.promote(c32, "pnet-ort-cpu-fp32", 2, root)         # it would change what production runs
    assert f"kiln promote --system {SYSTEM}" in e.value.hint and production("kiln-pnet-ort-cpu-fp32") == 1
    with pytest.raises(KilnError, match="--force needs --reason"):
        aliases.promote(c32, "pnet-ort-cpu-fp32", 2, root, force=True)
    forced = aliases.promote(c32, "pnet-ort-cpu-fp32", 2, root, force=True, reason="hotfix")
    assert forced.reason.startswith(f"FORCED past production system {SYSTEM} v2 (which pins v1): hotfix")
    assert production("kiln-pnet-ort-cpu-fp32") == 2

    back = systems.rollback(c32, SYSTEM, root, reason="int8 misbehaves")
    assert (back.system.from_version, back.system.to_version, back.system.action) == (2, 1, "rollback")
    assert production(NAME) == 1 and all(production(n) == v for n, v in v1.items())   # every part, together
    assert {m.name for m in back.parts if m.changed} == {"kiln-pnet-ort-cpu-fp32", f"kiln-{FP32}"}
    assert [m.name for m in back.retired] == [f"kiln-{INT8}"] and production(f"kiln-{INT8}") is None
    with pytest.raises(KilnError, match="first production version"):
        systems.rollback(c32, SYSTEM, root)

    hist = aliases.history(c32, NAME, root, alias="production")
    assert [(m.action, m.from_version, m.to_version) for m in hist] == [
        ("promote", None, 1), ("promote", 1, 2), ("rollback", 2, 1)]
    assert hist[0].reason.startswith("first system") and hist[2].reason.startswith("int8 misbehaves")
    pnet = aliases.history(c32, "kiln-pnet-ort-cpu-fp32", root, alias="production")
    assert [(m.action, m.to_version) for m in pnet] == [("promote", 1), ("promote", 2), ("rollback", 1)]
    assert f"system {SYSTEM} v1" in pnet[0].reason and f"system {SYSTEM} v1" in pnet[2].reason
    assert not [m.name for m in client().search_registered_models() if m.name.endswith(".lock")]

    shutil.copy(c32.source, root / "params.yaml")               # the CLI: history of the system, and its versions
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert cli.main(["history", "--system", SYSTEM]) == 0
    out = capsys.readouterr().out
    assert out.count("| production ") == 3 and f"embedder=kiln-{FP32}:v1" in out
    assert cli.main(["promote", "--system", SYSTEM, "1"]) == 0                          # already: nothing moves
    assert f"{NAME}@production is already v1" in capsys.readouterr().out


@slow
def test_a_system_promotion_records_the_upgrade_report_of_a_rebuilt_part(sysroot, registry_env, tmp_path):
    """P-Net rebuilt (ONNX Runtime's offline optimization at `extended`: other bytes, the same net) and registered as
    v2; `kiln upgrade-report --all` sets it beside production v1 on this host; the system version that pins it then
    carries that report's verdict into its promotion record, and a rollback returns the part to v1."""
    from pipeline.release import upgrade

    pnet = "pnet-ort-cpu-fp32"
    c32, _ = two_versions(sysroot)
    systems.promote(c32, SYSTEM, 1, sysroot["root"])
    root = tmp_path / "rebuilt"                                  # the rebuild in a copy: the module's root stays
    shutil.copytree(sysroot["root"], root, symlinks=True)
    ext = config.load(write_params(tmp_path, _variant(FP32, targets={"ort-cpu": {**c32.section(
        "targets", "ort-cpu"), "graph_optimization": "extended"}})))
    compile_stage.run(ext, pnet, root, check=False)
    assert validate.run(ext, pnet, root).passed
    assert register_stage.run(ext, pnet, root).version == 2                          # other bytes: a new version
    assert system_stage.run(ext, SYSTEM, root)["verdict"] == "pass"
    assert systems.register_system(ext, SYSTEM, root).version == 3
    report = upgrade.run(ext, root, [pnet], every=True, progress=lambda _: None)
    (row,) = report.rows
    assert (row.production, row.candidate, row.changed, row.identical) == (1, "v2", [], False), row
    assert row.verdict != upgrade.DIFFERS and row.cosine_min > 0.9999, row
    assert row.systems == [f"{NAME} v1"] and set(report.runs) == {pnet}
    move = systems.promote(ext, SYSTEM, 3, root)
    assert move.upgrades == (f"upgrade report: {row.line()}",)
    assert f"upgrade report: {pnet}: {row.verdict} against production v1" in move.system.reason
    got = aliases.recorded(aliases.Registry(ext, root), NAME, 3, "upgrade")
    assert got == {f"kiln-{pnet}": f"{row.line()} (run {report.runs[pnet]})"}
    assert production(f"kiln-{pnet}") == 2
    systems.rollback(ext, SYSTEM, root)
    assert production(NAME) == 1 and production(f"kiln-{pnet}") == 1


@slow
def test_an_incompatible_embedder_needs_re_enroll(sysroot, registry_env, tmp_path, capsys, monkeypatch):
    """Limits no engine change can meet (distance_delta_max 0): INT8 is `re-enroll required` against the FP32
    gallery; promote refuses it, moving nothing, and with --re-enroll moves it, recorded in the history."""
    root = sysroot["root"]
    c32, _ = two_versions(sysroot)
    strict = config.load(write_params(tmp_path, _variant(INT8, gallery_compat={"distance_delta_max": 0.0})))
    systems.promote(strict, SYSTEM, 1, root)
    shutil.copy(strict.source, root / "params.yaml")
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert cli.main(["promote", "--system", SYSTEM, "2"]) == 1
    err = capsys.readouterr().err
    assert "kiln: gate failed:" in err and "re-enroll required" in err and "distance_delta_max" in err
    assert "--re-enroll" in err and "Traceback" not in err
    assert production(NAME) == 1 and production(f"kiln-{INT8}") is None
    assert client().get_model_version(NAME, "2").tags["gallery_compat"] == gallery_compat.RE_ENROLL

    assert cli.main(["promote", f"kiln-system-{SYSTEM}", "2", "--re-enroll", "--reason", "gallery re-enrolled"]) == 1
    err = capsys.readouterr().err                        # --re-enroll alone is a claim: the step must be recorded
    assert "no re-enrolment of its gallery" in err and f"kiln re-enroll --system {SYSTEM} 2" in err
    assert production(NAME) == 1
    assert cli.main(["re-enroll", "--system", SYSTEM, "2"]) == 0
    out = capsys.readouterr().out
    enrolled = systems.enrolments(aliases.Registry(strict, root), NAME, 2)[-1]
    assert f"gallery enrolled by {INT8}" in out and enrolled["run"] in out and int(enrolled["dim"]) == 128

    assert cli.main(["promote", f"kiln-system-{SYSTEM}", "2", "--re-enroll", "--reason", "gallery re-enrolled"]) == 0
    out = capsys.readouterr().out
    assert f"{NAME}@production v1 → v2" in out and "re-enroll" in out
    assert production(NAME) == 2 and production(f"kiln-{INT8}") == 1
    last = aliases.history(strict, NAME, root, alias="production")[-1]
    assert last.to_version == 2 and last.reason.startswith("gallery re-enrolled; re-enroll: the gallery was "
                                                           f"re-enrolled with {INT8} (run {enrolled['run']}")
    run = client().get_run(client().get_model_version(NAME, "2").tags["production_release_run"])
    assert run.data.tags["re_enroll"] == "true" and run.data.tags["gallery_compat"] == gallery_compat.RE_ENROLL
    recorded = aliases.recorded(aliases.Registry(strict, root), NAME, 2, systems.COMPAT)   # the decision's record
    assert recorded["verdict"] == gallery_compat.RE_ENROLL and recorded["re_enroll"] == "true"
    assert json.loads(recorded["limits"])["distance_delta_max"] == 0.0 and "distance_delta_max" in recorded["failures"]
    assert json.loads(recorded["enrolment"])["sha256"] == enrolled["sha256"]

    from pipeline.release import signing
    from pipeline.release import system as system_release          # the release is checked against the re-enrolment
    key, pub = signing.keygen(tmp_path / "keys" / "signing.pem")
    r = system_release.build(strict, SYSTEM, "production", root, key, tmp_path / "out")
    assert cli.main(["verify-release", str(r.archive), "--key", str(pub)]) == 0
    assert f"re-enrolment at promotion (run {enrolled['run']}): this gallery, byte for byte" in capsys.readouterr().out


@slow
def test_every_command_names_the_production_systems_record(sysroot, registry_env, tmp_path, capsys, monkeypatch):
    """Issue 44 items 1 and 2 (done when): after system moves, engine-level moves and tag edits made through the
    public MLflow client, `kiln identify --release`, `kiln release --system`, `kiln history --system` and `kiln
    report` all name the production system version's parts and verdicts as its run recorded them — never a tag,
    never an engine's own alias."""
    import tarfile

    from pipeline.release import signing
    from pipeline.release import system as system_release
    from pipeline.data import list_photos
    from test_registry import make_engine

    root = sysroot["root"]
    c32, c8 = two_versions(sysroot)
    systems.promote(c32, SYSTEM, 1, root, reason="fp32 first")
    systems.promote(c8, SYSTEM, 2, root, reason="int8 next")               # gallery check: compatible
    c = client()
    for version in ("1", "2"):                                              # forged tags, every kind
        for tag, value in (("gallery_compat", "compatible (signed off by security, see https://evil.example)"),
                           ("parts", "embedder=kiln-evil:v9"), ("embedder", "evil"), ("validation", "fail")):
            c.set_model_version_tag(NAME, version, tag, value)
    aliases.promote(c8, FP32, 1, root, reason="a third embedder alias")     # not pinned by production: allowed
    fake = tmp_path / "fake"                                                # pinned at another version: refused
    make_engine(fake, c32, "pnet-ort-cpu-fp32", b"another pnet build")
    assert register_stage.run(c32, "pnet-ort-cpu-fp32", fake).version == 2
    with pytest.raises(KilnError, match="runs v1 as its pnet"):
        aliases.promote(c8, "pnet-ort-cpu-fp32", 2, root)
    assert production(NAME) == 2 and production(f"kiln-{INT8}") == 1 and production("kiln-pnet-ort-cpu-fp32") == 1

    shutil.copy(c8.source, root / "params.yaml")
    monkeypatch.chdir(root)
    capsys.readouterr()
    photo = list_photos(root / c8.data.photos)[3].path
    assert cli.main(["identify", str(photo), "--release"]) == 0
    out = capsys.readouterr().out
    assert f"production: {NAME} v2" in out and f"embedder=kiln-{INT8}:v1" in out and FP32 not in out

    key, _ = signing.keygen(tmp_path / "keys" / "signing.pem")
    r = system_release.build(c8, SYSTEM, "production", root, key, tmp_path / "out")
    with tarfile.open(r.archive) as tar:
        doc = json.loads(tar.extractfile(f"{NAME}-v2/release.json").read())
    assert doc["version"] == 2 and doc["verdict"] == "pass"
    assert {p["model"]: p["registered_model"] for p in doc["parts"]}["embedder"] == f"kiln-{INT8}"
    assert doc["gallery_compat"]["verdict"] == gallery_compat.COMPATIBLE            # the move's record
    assert "evil" not in json.dumps(doc) and doc["gallery_compat"]["vs"] == f"{FP32} (v1)"

    assert cli.main(["history", "--system", SYSTEM]) == 0
    out, err = capsys.readouterr()
    v2 = next(l for l in out.splitlines() if l.startswith("| v2 *"))
    assert f"embedder=kiln-{INT8}:v1" in v2 and "| pass " in v2 and "| compatible " in v2 and "evil" not in out
    assert err.count("kiln: WARNING:") == 8 and "evil" in err                          # 4 forged tags × 2 versions

    from pipeline.report import page as report
    (prod,) = report.production_systems(c8, root)                                     # `kiln report`
    assert (prod["system"], prod["version"], prod["verdict"]) == (NAME, 2, "pass")
    assert f"embedder=kiln-{INT8}:v1" in prod["parts"] and "evil" not in json.dumps(prod)


@slow
@pytest.mark.parametrize("store", ["sqlite", "http"])
def test_concurrent_system_and_part_moves_stay_consistent(sysroot, registry_env, store, request, monkeypatch):
    """Eight `kiln` processes at once — system promotes and rollbacks, a re-registration, an engine promote of one
    part — over SQLite and over a tracking server: nothing deadlocks, each refusal is one clean error, every history
    chains and ends at its alias, and every part of the production system version is in production at its pin."""
    from reliability import clean_error, kiln

    def consistent(name: str) -> None:         # each move starts where the one before ended (a retired alias: at
        hist = aliases.history(c8, name, root, alias="production")                  # none); the alias is the top
        assert all(m.from_version == (None if p.action == aliases.RETIRE else p.to_version)
                   for p, m in zip(hist, hist[1:])), hist
        stack = aliases.production_stack(hist)
        assert (stack[-1] if stack else None) == production(name), hist

    if store == "http":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", request.getfixturevalue("mlflow_server"))
    uri, root = os.environ["MLFLOW_TRACKING_URI"], sysroot["root"]
    c32, c8 = two_versions(sysroot)                 # the INT8 variant's output and params stay in place
    systems.promote(c32, SYSTEM, 1, root)
    shutil.copy(c8.source, root / "params.yaml")
    jobs = [["promote", "--system", SYSTEM, "2"], ["rollback", "--system", SYSTEM], ["promote", NAME, "1"],
            ["register-system", SYSTEM], ["promote", "--system", SYSTEM, "2"], ["rollback", NAME],
            ["promote", "--system", SYSTEM, "1"], ["promote", "pnet-ort-cpu-fp32", "1"]]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda a: kiln(root, *a, env={"MLFLOW_TRACKING_URI": uri}, timeout=500), jobs))
    for job, r in zip(jobs, results):
        if r.returncode != 0:
            assert job[0] == "rollback", (job, r.stderr[-2000:])
            clean_error(r, 2, "first production version")
    assert "already registered as kiln-system-dlib-mtcnn v2" in results[3].stdout
    consistent(NAME)
    prod = production(NAME)
    pins = json.loads((stored_dir(NAME, prod) / "kiln" / "parts.json").read_text()) if store == "sqlite" else \
        [{"registered_model": m.split(":v")[0], "version": int(m.split(":v")[1])} for m in (
            p.split("=")[1] for p in client().get_model_version(NAME, str(prod)).tags["parts"].split(","))]
    for pin in pins:
        assert production(pin["registered_model"]) == pin["version"], pin
        consistent(pin["registered_model"])
    assert sorted(int(v.version) for v in client().search_model_versions(f"name = '{NAME}'")) == [1, 2]
    assert not [m.name for m in client().search_registered_models() if m.name.endswith(".lock")]


# ---------------------------------------------------------------------------------------------- refusals
@slow
@pytest.mark.parametrize("tamper", ["verdict", "part-verdict", "pin"])
def test_promote_refuses_an_edited_system(sysroot, registry_env, tamper):
    """The stored verdict.json edited (its failures cleared, one metric changed), a part's stored validation edited,
    or the stored pins pointed at another version: refused, and nothing moves."""
    root = sysroot["root"]
    c32 = use(sysroot, "fp32")
    register_parts(c32, root)
    r = systems.register_system(c32, SYSTEM, root)
    stored = stored_dir(NAME, r.version)
    if tamper == "verdict":
        doc = json.loads((stored / "verdict.json").read_text())
        doc["metrics"]["decision_flips"] = 0 if doc["metrics"]["decision_flips"] else 1
        overwrite(stored / "verdict.json", json.dumps(doc).encode())
        expected = "verdict.json: "
    elif tamper == "part-verdict":
        part = next(p for p in r.parts if p.model == "onet")
        vfile = stored_dir(part.registered_model, part.version) / "kiln" / "validation.json"
        overwrite(vfile, vfile.read_bytes().replace(b'"verdict": "pass"', b'"verdict":  "pass"'))
        expected = f"{part.registered_model} v{part.version}: stored artifacts do not match"
    else:
        doc = json.loads((stored / "kiln" / "parts.json").read_text())
        doc[0]["version"] += 1
        overwrite(stored / "kiln" / "parts.json", json.dumps(doc).encode())
        expected = "parts.json digest"
    with pytest.raises(GateFailed, match="tampered") as e:
        systems.promote(c32, SYSTEM, r.version, root)
    assert expected in e.value.message, e.value.message
    assert production(NAME) is None
    assert all(production(p.registered_model) is None for p in r.parts)


@slow
def test_gallery_compat_on_the_built_engines(sysroot, cfg):
    """The same engine reads its own gallery exactly; INT8 reads FP32's within the default limits; limits set past
    what INT8 measured make it `re-enroll required`."""
    root = sysroot["root"]
    same = gallery_compat.compare(cfg, FP32, FP32, root)
    assert same.verdict == gallery_compat.COMPATIBLE and same.metrics["distance_delta_max"] == 0.0
    assert same.metrics["same"] == same.metrics["cross"] == same.metrics["candidate"]
    c = gallery_compat.compare(cfg, INT8, FP32, root)
    m = c.metrics
    assert (m["probes"], m["gallery"], m["pairs"]) == (42, 6, 252) and m["same"]["top1_accuracy"] == 1.0
    assert c.verdict == gallery_compat.COMPATIBLE and m["decision_flips"] == 0 and m["top1_agreement"] == 1.0
    assert 0 < m["distance_delta_max"] < m["margin_min"]
    import dataclasses

    strict = cfg.replace(gallery_compat=dataclasses.replace(cfg.gallery_compat,
                                                            distance_delta_max=m["distance_delta_max"] / 2))
    bad = gallery_compat.compare(strict, INT8, FP32, root)
    assert bad.verdict == gallery_compat.RE_ENROLL and bad.failures[0].startswith("distance_delta_max")
    assert "FAIL distance_delta_max" in gallery_compat.table(bad)
    other = gallery_compat.Compat("sface-ort-cpu-fp32", FP32, "sface", {}, {}, ["another embedder model"])
    assert other.verdict == gallery_compat.RE_ENROLL and other.summary().endswith("re-enroll required: another "
                                                                                  "embedder model")


def test_gallery_compat_limits_are_checked_by_config(tmp_path):
    with pytest.raises(KilnError) as e:
        config.load(write_params(tmp_path, lambda raw: raw["gallery_compat"].update(top1_agreement_min=1.5)))
    assert ": gallery_compat.top1_agreement_min:" in e.value.message
    with pytest.raises(KilnError) as e:
        config.load(write_params(tmp_path, lambda raw: raw["gallery_compat"].update(flips_max=0)))
    assert "gallery_compat.flips_max" in e.value.message


def test_gallery_compat_compares_engines_of_one_embedder(cfg):
    """Two engines of different models, or of a model that embeds nothing: one clear error before anything loads."""
    with pytest.raises(KilnError, match="engine of embedder, aligner-ort-cpu-fp32 of aligner"):
        gallery_compat.compare(cfg, INT8, "aligner-ort-cpu-fp32")
    with pytest.raises(KilnError, match="pnet is not an embedder"):
        gallery_compat.compare(cfg, "pnet-ort-cpu-fp32", "pnet-openvino-cpu-fp32")
