"""System releases (issue 35 item 3): `kiln release --system`, `kiln verify-release` on a system archive, and
`kiln identify --release ARCHIVE` — on real built engines and a real MLflow registry (SQLite).

The engines and both system@ outputs come from tests/registry/test_systems.py's `sysroot` (imported: one scratch root
with the default system's five graphs on ORT, the embedder in FP32 and INT8). Here the INT8-embedder system is
registered, promoted and released once per module.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kiln_runtime import release as runtime_release
from kiln_runtime import system as runtime_system
from pipeline import cli, config, paths
from pipeline.release import signing
from pipeline.release import system as system_release
from pipeline.release import engine as release
from pipeline.release.archive import safe_extract, write_archive
from pipeline.data import list_photos, load_rgb
from pipeline.errors import GateFailed, KilnError
from pipeline.registry import aliases, systems
from test_systems import FP32, INT8, NAME, SYSTEM, client, register_parts, sysroot, use  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
REL = f"{NAME}-v1"
slow = pytest.mark.slow        # on `sysroot`: six engines built, the system gated twice


@pytest.fixture(scope="module")
def released(sysroot, template_db, tmp_path_factory):
    """The INT8-embedder system v1 registered, promoted and released, in a registry of this module's own."""
    tmp = tmp_path_factory.mktemp("sysrel")
    shutil.copy(template_db, tmp / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")
        mp.setenv("KILN_ACTOR", "ci")
        root = sysroot["root"]
        c8 = use(sysroot, "int8")
        register_parts(c8, root)
        assert systems.register_system(c8, SYSTEM, root).version == 1
        systems.promote(c8, SYSTEM, 1, root)
        key, pub = signing.keygen(tmp / "keys" / "signing.pem")
        r = system_release.build(c8, SYSTEM, "production", root, key, tmp / "out")
        yield {"root": root, "cfg": c8, "release": r, "key": key, "pub": pub}


def _tree(archive: Path, dest: Path) -> Path:
    dest.mkdir()
    safe_extract(archive, dest)
    return dest / REL


def _repack(top: Path, dest: Path) -> Path:
    """As `kiln release` packs it, at gzip level 1 (the verifier reads any level; level 9 takes ~8 s here)."""
    write_archive(dest, top, [REL, f"{REL}{release.SIG_SUFFIX}"], level=1)
    return dest


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.unlink()                     # a new file: never write through into a shared inode
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------- build + verify
@slow
def test_system_release_is_byte_identical_and_verifies(released, tmp_path, capsys, monkeypatch):
    r, root, c8, pub = released["release"], released["root"], released["cfg"], released["pub"]
    assert (r.name, r.version, r.new, r.archive.name) == (NAME, 1, True, f"{REL}.tar.gz")
    again = system_release.build(c8, SYSTEM, "1", root, released["key"], tmp_path / "again")
    assert again.archive.read_bytes() == r.archive.read_bytes() and again.sha256 == r.sha256 and not again.new

    done = system_release.verify(r.archive, pub)
    pins = json.loads((paths.system(SYSTEM, root) / paths.SYSTEM_FILE).read_text())["engines"]
    assert len(done) == 6 + len(pins) and done[0].startswith("signature: ")
    runtime = [d for d in done if d.startswith("runtime: ")]           # this host runs what each engine was gated on
    assert sorted(d.split(" — ")[0] for d in runtime) == sorted(f"runtime: {e['engine']}" for e in pins.values())
    engines_line = next(d for d in done if d.startswith("engines: 5,"))
    assert all(f"{e['engine']} {e['xxh3_128'][:8]}" in engines_line for e in pins.values())
    assert any(d.startswith(f"gallery: 6 enrolment embeddings × 128 of 4 identities, made by {INT8}") for d in done)

    with system_release.verified(r.archive, pub) as (tree, _):
        doc = json.loads((tree / "release.json").read_bytes())
        gallery = json.loads((tree / "gallery" / f"{SYSTEM}.manifest.json").read_bytes())
        values = json.loads((tree / "config" / "params.json").read_bytes())
        members = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    assert (doc["gallery"]["embedder"], doc["gallery"]["embedder_xxh3_128"]) == (INT8, pins["embedder"]["xxh3_128"])
    assert {i["role"]: i["xxh3_128"] for i in gallery["inputs"]}["embedder"] == pins["embedder"]["xxh3_128"]
    gated = json.loads((paths.system(SYSTEM, root) / f"{SYSTEM}.manifest.json").read_text())["params"]["values"]
    assert values == gated and values["systems.dlib-mtcnn"]["engines"] == {"embedder": INT8}
    assert {f"engines/{e['engine']}/model.onnx" for e in pins.values()} <= set(members)
    assert {"system/system.json", "system/verdict.json", "system/kiln/parts.json", "gallery/embeddings.npy",
            "gallery/labels.json", "config/params.json", "slsa-provenance.json"} <= set(members)

    assert int(client().get_registered_model(NAME).aliases["release"]) == 1      # recorded like an engine release
    assert aliases.history(c8, NAME, root, alias="release")[-1].reason.startswith(f"released {REL}.tar.gz")

    shutil.copy(c8.source, root / "params.yaml")              # the CLI: the same bytes, verified
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert cli.main(["release", "--system", SYSTEM, "--key", str(released["key"]), "--out", str(tmp_path)]) == 0
    assert f"{NAME} v1 → {tmp_path / r.archive.name}  sha256 {r.sha256}" in capsys.readouterr().out
    assert cli.main(["verify-release", str(tmp_path / r.archive.name), "--key", str(pub)]) == 0
    assert [ln[:4] for ln in capsys.readouterr().out.splitlines()] == ["ok  "] * (6 + len(pins)) + ["veri"]
    assert cli.main(["release", "--system", SYSTEM, "canary", "--key", str(released["key"])]) == 2
    err = capsys.readouterr().err
    assert "no version has the alias 'canary'" in err and f"kiln history --system {SYSTEM}" in err


# ---------------------------------------------------------------------------------------------- tampering
MEMBERS = {"engine": f"engines/{INT8}/model.onnx", "system.json": "system/system.json",
           "gallery": "gallery/embeddings.npy", "config": "config/params.json"}


@slow
@pytest.mark.parametrize("member", [*MEMBERS, "archive"])
def test_a_flipped_byte_anywhere_fails_verify_release(released, tmp_path, member, capsys):
    """One bit of one member (engine file, system.json, gallery, config) changed and the archive repacked as
    `kiln release` packs it: the signed statement names the member. One bit of the archive itself: refused."""
    if member == "archive":
        bad = tmp_path / "bad.tar.gz"
        shutil.copyfile(released["release"].archive, bad)
        _flip(bad)
        expected = f"{bad}: "
    else:
        tree = _tree(released["release"].archive, tmp_path / "x")
        _flip(tree / MEMBERS[member])
        bad = _repack(tmp_path / "x", tmp_path / "bad.tar.gz")
        expected = f"signed content: {MEMBERS[member]}: sha256 differs"
    with pytest.raises(GateFailed) as e:
        system_release.verify(bad, released["pub"])
    assert expected in e.value.message, e.value.message
    if member == "gallery":                   # identify verifies first: nothing runs, exit 1
        photo = list_photos(released["root"] / released["cfg"].data.photos)[0].path
        capsys.readouterr()
        assert cli.main(["identify", "--release", str(bad), "--key", str(released["pub"]), str(photo)]) == 1
        out, err = capsys.readouterr()
        assert "face" not in out and "kiln: gate failed: signed content: gallery/embeddings.npy" in err


def _swap_engine(tree: Path, root: Path) -> None:
    """The INT8 embedder's files replaced by the FP32 engine's (its manifest under the INT8 name)."""
    d, src = tree / "engines" / INT8, paths.engine(FP32, root)
    for f in ("model.onnx", "session.json"):
        (d / f).unlink()
        shutil.copyfile(src / f, d / f)
    (d / f"{INT8}.manifest.json").unlink()
    shutil.copyfile(src / f"{FP32}.manifest.json", d / f"{INT8}.manifest.json")


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.unlink()
    path.write_text(json.dumps(doc, indent=1, sort_keys=True))


def _other_embedder(doc: dict) -> None:
    next(i for i in doc["inputs"] if i["role"] == "embedder")["xxh3_128"] = "0" * 32


def _pin(doc: list) -> None:
    next(p for p in doc if p["model"] == "embedder")["version"] = 2


def _loosen(doc: dict) -> None:
    next(p for p in doc["parts"] if p["model"] == "embedder")["runtime"]["allowed"] = "==1.*"


RESIGNED = {
    "engine": (lambda t, root: _swap_engine(t, root), f"but the system version pins {INT8} at"),
    "gallery": (lambda t, root: _edit_json(t / "gallery" / f"{SYSTEM}.manifest.json", _other_embedder),
                f"not by the pinned embedder {INT8}"),
    "config": (lambda t, root: _edit_json(t / "config" / "params.json",
                                          lambda d: d["models.embedder"].update(verify_threshold=0.9)),
               "not the params slice the system was gated with"),
    "pins": (lambda t, root: _edit_json(t / "system" / "kiln" / "parts.json", _pin), "not the registered content"),
    "runtime": (lambda t, root: _edit_json(t / "release.json", _loosen), "its runtime requirement is not what its "
                "engine manifest records"),
}


@slow
@pytest.mark.parametrize("case", RESIGNED)
def test_a_re_signed_inconsistent_system_release_fails(released, tmp_path, case):
    """Signed again with the publisher's own key after the edit, so only Kiln's own checks can catch it: another
    engine where the pin names the INT8 one, a gallery made by another embedder, a config slice that is not the
    gated one, pins that are not the registered ones."""
    edit, expected = RESIGNED[case]
    tree = _tree(released["release"].archive, tmp_path / "x")
    edit(tree, released["root"])
    sig = tmp_path / "x" / f"{REL}{release.SIG_SUFFIX}"
    sig.unlink()
    signing.sign_tree(tree, sig, released["key"])
    with pytest.raises(GateFailed) as e:
        system_release.verify(_repack(tmp_path / "x", tmp_path / "bad.tar.gz"), released["pub"])
    assert expected in e.value.message, e.value.message


def _regallery(tree: Path, npy: bytes | None = None, labels: list | None = None, rows: int | None = None) -> None:
    """gallery/ edited (and its row count, where `rows`), its manifest's file digests and release.json's digest of
    that manifest made again, as a signer with the publisher's key would."""
    from pipeline.manifest import file_digests, identity_digest

    g = tree / "gallery"
    for name, data in (("embeddings.npy", npy), ("labels.json", None if labels is None else json.dumps(labels))):
        if data is not None:
            (g / name).unlink()
            (g / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    m = json.loads((g / f"{SYSTEM}.manifest.json").read_bytes())
    for e in m["files"]:
        e.update({k: v for k, v in file_digests(g / e["path"]).items() if k in e})
    m["build"]["rows"] = rows or m["build"]["rows"]
    _edit_json(g / f"{SYSTEM}.manifest.json", lambda d: d.update(files=m["files"], build=m["build"]))
    _edit_json(tree / "release.json", lambda d: d["gallery"].update(manifest_xxh3_128=identity_digest(m),
                                                                     rows=m["build"]["rows"]))


def _npy(a) -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _gallery_of(tree: Path):
    import numpy as np

    return np.load(tree / "gallery" / "embeddings.npy"), json.loads((tree / "gallery" / "labels.json").read_bytes())


FORGED = "emmanuel_macron\n  face 2: box [0, 0, 9, 9] score 1.000 → president"
HOSTILE = {   # edit, the one line verify-release and identify --release both print (after `kiln: gate failed: `)
    "64-d": (lambda t: _regallery(t, _npy(_gallery_of(t)[0][:, :64].copy())),
             "gallery/embeddings.npy: C-order <f4 (6, 64); the gallery is C-order <f4 (6, 128): 6 rows × the "
             "embedder's 128-d output"),
    "header": (lambda t: _regallery(t, _npy(_gallery_of(t)[0].reshape(12, 64)), _gallery_of(t)[1] * 2, 12),
               "gallery/embeddings.npy: C-order <f4 (12, 64); the gallery is C-order <f4 (12, 128): 12 rows × the "
               "embedder's 128-d output"),     # the same bytes read as (12, 64), 12 rows and labels declared
    "label": (lambda t: _regallery(t, labels=[FORGED, *_gallery_of(t)[1][1:]]),
              f"gallery/labels.json: row 0: {' '.join(repr(FORGED).split())} is not an identity name (1-64 letters, "
              "digits, '-' or '_')"),       # repr: the newline shown as \\n; one line: runs of spaces as one
    "extra": (lambda t: (t / "gallery" / "notes.txt").write_text("hello"),
              "gallery/notes.txt: not a file this system release declares (its manifests, pins and documents)"),
}


@slow
@pytest.mark.parametrize("case", HOSTILE)
def test_signed_but_hostile_gallery_is_one_line_for_verify_and_identify(released, tmp_path, case, capsys):
    """Issue 44 item 3: a gallery signed with the publisher's own key that identify could not use — 64-d for the
    128-d embedder, the same bytes under a (12, 64) header with 12 rows declared, a label with a newline that would
    forge a second `face` line, a file no manifest declares — is one `kiln: gate failed:` line from verify-release,
    and the same line from identify --release before any face is searched; no traceback."""
    edit, expected = HOSTILE[case]
    tree = _tree(released["release"].archive, tmp_path / "x")
    edit(tree)
    _edit_json(tree / "slsa-provenance.json", lambda st: st.update(subject=[     # every file, as `build` lists them
        {"name": rel, "digest": {"sha256": sha}} for rel, sha in sorted(system_release._payload(tree).items())]))
    sig = tmp_path / "x" / f"{REL}{release.SIG_SUFFIX}"
    sig.unlink()
    signing.sign_tree(tree, sig, released["key"])
    bad = _repack(tmp_path / "x", tmp_path / "bad.tar.gz")
    photo = list_photos(released["root"] / released["cfg"].data.photos)[0].path
    capsys.readouterr()
    assert cli.main(["verify-release", str(bad), "--key", str(released["pub"])]) == 1
    out, err = capsys.readouterr()
    assert err == f"kiln: gate failed: {expected}\nhint: do not use this release\n", err
    assert cli.main(["identify", "--release", str(bad), "--key", str(released["pub"]), str(photo)]) == 1
    out, err2 = capsys.readouterr()
    assert err2 == err and "face" not in out and "president" not in out


# ---------------------------------------------------------------------------------------------- deploy
def _faces(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if not ln.startswith(("engines: ", "release: "))]


@slow
def test_identify_from_the_release_outside_any_checkout(released, tmp_path, capsys, monkeypatch):
    """`kiln identify --release ARCHIVE` in an empty folder (no params.yaml, no artifacts, an unreachable registry)
    names the same people, boxes and distances as `kiln identify --system` from the checkout; in-process, the
    verified, extracted archive's System agrees with the checkout's leave-one-out too (the `unknown`s)."""
    from pipeline.e2e import System, resolve

    root, c8 = released["root"], released["cfg"]
    photos = list_photos(root / c8.data.photos)
    shutil.copytree(root / c8.data.photos, tmp_path / "photos", symlinks=False)
    mine = [str(tmp_path / "photos" / p.identity / p.path.name) for p in photos]
    (tmp_path / "host").mkdir()
    (tmp_path / "scratch").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KILN_"))}
    env.update(MLFLOW_TRACKING_URI="http://127.0.0.1:9", TMPDIR=str(tmp_path / "scratch"))
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "identify", "--release", str(released["release"].archive),
                        "--key", str(released["pub"]), *mine], cwd=tmp_path / "host", env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    parts = len(json.loads((paths.system(SYSTEM, root) / paths.SYSTEM_FILE).read_text())["engines"])
    # 6 content checks, then this host's runtime: one line per engine
    assert r.stdout.startswith(f"release: {released['release'].archive} verified offline ({NAME} v1: "
                               f"{6 + parts} checks")
    assert f"embedder={INT8} ({NAME} v1)" in r.stdout
    assert list((tmp_path / "host").iterdir()) == []           # nothing written where it ran; the private
    assert [p for p in (tmp_path / "scratch").iterdir() if p.name.startswith("kiln-")] == []   # copies removed

    shutil.copy(c8.source, root / "params.yaml")
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert cli.main(["identify", "--system", SYSTEM, *mine]) == 0
    checkout = capsys.readouterr().out
    assert f"embedder={INT8}" in checkout
    assert _faces(r.stdout) == _faces(checkout) and len(_faces(checkout)) == 2 * len(photos)
    for p in photos:
        assert f"→ {p.identity} (nearest {p.identity}," in r.stdout

    here = System.from_picks(c8, SYSTEM, resolve(c8, SYSTEM), root, system=SYSTEM)
    here.enroll(root)
    with system_release.verified(released["release"].archive, released["pub"]) as (tree, checked):
        deployed = system_release.deployed(tree, checked).system
        unknown = 0
        for i, p in enumerate(photos):
            rgb = load_rgb(p.path)
            for exclude in (None, i):
                ours, theirs = deployed.identify(rgb, exclude), here.identify(rgb, exclude)
                assert [(m.box, m.identity, m.nearest, m.distance) for m in ours] == \
                       [(m.box, m.identity, m.nearest, m.distance) for m in theirs], (p.path.name, exclude)
                unknown += sum(m.identity == "unknown" for m in ours)
    assert unknown >= 1                       # one-photo people, left out of the gallery

    monkeypatch.chdir(tmp_path / "host")      # flags that do not apply to a release, and a missing key
    for extra, needle in ((["--gallery", "1000"], "--gallery does not apply"), ([], "needs the publisher's")):
        key = [] if not extra else ["--key", str(released["pub"])]
        assert cli.main(["identify", "--release", str(released["release"].archive), *key, *extra, mine[0]]) == 2
        assert needle in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the config slice
def test_the_config_slice_is_what_system_reads(cfg, tmp_path):
    """The params slice system@ records, as a Config: the same typed entries as params.yaml's; nothing else on it;
    a key a system does not read, or a bad value, refused as release content."""
    from pipeline.stages import system as system_stage

    values = system_stage.STAGE.param_values(cfg, SYSTEM)
    d = system_release.deploy_config(values, tmp_path / "params.json")
    assert d.system(SYSTEM) == cfg.system(SYSTEM) and d.data.template == cfg.data.template
    assert all(d.model(m) == cfg.model(m) for m in ("pnet", "rnet", "onet", "aligner", "embedder"))
    assert all(d.engine(e) == cfg.engine(e) for e in (k.removeprefix("engines.") for k in values
                                                          if k.startswith("engines.")))
    with pytest.raises(AttributeError):
        d.matching
    with pytest.raises(GateFailed, match="is not a key a face system reads"):
        system_release.deploy_config({**values, "matching.gallery_sizes": [1]}, tmp_path / "params.json")
    bad = {**values, "models.embedder": {**values["models.embedder"], "verify_threshold": -1}}
    with pytest.raises(GateFailed, match="models.embedder.verify_threshold"):
        system_release.deploy_config(bad, tmp_path / "params.json")
    with pytest.raises(KilnError, match="no system named"):
        d.system("other")
    assert isinstance(d, config.Config)


def test_identify_key_needs_a_release_archive(assets_dir, capsys):
    """--key only verifies a system release: without --release ARCHIVE it is an error, not silently ignored."""
    photo = next((assets_dir / "photos").rglob("*.jpg"))
    assert cli.main(["identify", str(photo), "--release", "--key", "k.pub"]) == 2
    assert "--key verifies a system release archive" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the gallery, as read
def _bad_gallery(case: str):
    """(embeddings.npy bytes, labels) of a 3-row × 4-d gallery, made bad one way."""
    import numpy as np

    good, names = np.arange(12, dtype="<f4").reshape(3, 4) / 10, ["ann", "bob-2", "Cy_3"]
    data = {"good": good, "big-endian": good.astype(">f4"), "float64": good.astype("<f8"),
            "fortran": np.asfortranarray(good), "4x3": good.reshape(4, 3), "1-d": good.ravel(),
            "nan": np.where(np.eye(3, 4) > 0, np.nan, good).astype("<f4"), "huge": good * 1e7}.get(case, good)
    raw = _npy(data)
    raw = {"trailing": raw + b"\0" * 4, "truncated": raw[:-4], "not-npy": b"PK\x03\x04 a zip"}.get(case, raw)
    labels = {"newline": ["ann", "bob\n  face 2: → president", "Cy_3"], "unknown": ["ann", "unknown", "Cy_3"],
              "esc": ["ann", "\x1b]8;;http://x\x1b\\bob\x1b]8;;\x1b\\", "Cy_3"], "number": ["ann", 7, "Cy_3"],
              "rtl": ["ann", "bob\u202e", "Cy_3"], "two": names[:2],
              "dotted": ["ann", "../bob", "Cy_3"]}.get(case, names)
    return raw, labels


GALLERY_CASES = {"big-endian": "C-order >f4 (3, 4)", "float64": "C-order <f8 (3, 4)", "fortran": "Fortran-order <f4",
                 "4x3": "C-order <f4 (4, 3)", "1-d": "C-order <f4 (12,)", "trailing": "bytes; its header declares",
                 "truncated": "bytes; its header declares", "not-npy": "not a .npy array header",
                 "nan": "row 0 holds a NaN or infinity", "huge": "row 2 holds a value beyond ±1e+06",
                 "newline": r"row 1: 'bob\n  face 2: → president' is not an identity name",
                 "unknown": "row 1: 'unknown' is not an identity name", "esc": r"row 1: '\x1b]8;;http://x",
                 "number": "row 1: 7 is not", "rtl": r"row 1: 'bob\u202e' is not", "two": "not a list of 3 identity",
                 "dotted": "row 1: '../bob' is not"}


@pytest.mark.parametrize("case", GALLERY_CASES)
def test_the_gallery_is_checked_as_identify_reads_it(tmp_path, case):
    """Issue 44 item 3, as a pure check: what identify relies on in gallery/ — rows × the embedder's dim, C-order
    little-endian float32 and exactly that many bytes, finite and bounded values, identity-slug labels, one per row —
    each refused in one line naming the file; the message holds no raw control character."""
    raw, labels = _bad_gallery(case)
    (tmp_path / "embeddings.npy").write_bytes(raw)
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    with pytest.raises(GateFailed) as e:
        system_release.check_gallery(tmp_path, 3, 4)
    assert GALLERY_CASES[case] in e.value.message and e.value.hint == "do not use this release", e.value.message
    assert e.value.message.startswith(("gallery/embeddings.npy: ", "gallery/labels.json: "))
    assert e.value.message.isprintable(), e.value.message


def test_a_good_gallery_passes_and_the_bounds_are_checked_first(tmp_path):
    import numpy as np

    raw, labels = _bad_gallery("good")
    (tmp_path / "embeddings.npy").write_bytes(raw)
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    assert system_release.check_gallery(tmp_path, 3, 4) == labels
    gm = {"build": {"rows": 3, "dim": 4}}
    assert runtime_release._gallery_shape(gm, {"rows": 3, "dim": 4}, "g") == (3, 4)
    for build, doc, needle in (({"rows": 200_000, "dim": 4}, {}, "a gallery is 1-100000 rows"),
                               ({"rows": 3, "dim": True}, {}, "dim 'True'"),
                               ({"rows": 3, "dim": 4}, {"rows": 3, "dim": 64}, "its gallery is 3 × 64")):
        with pytest.raises(GateFailed, match=needle):
            runtime_release._gallery_shape({"build": build}, doc, "g")
    embed = runtime_system._same_width(lambda x: np.zeros((len(x), 64), np.float32), 128, "kiln-system-x v1")
    with pytest.raises(GateFailed, match=r"kiln-system-x v1: its embedder outputs \(2, 64\), its gallery holds 128-d"):
        embed(np.zeros((2, 3)))          # a signer who rewrote the recorded dim too: one line at identify, no traceback


# ---------------------------------------------------------------------------------------------- the deployment side
def _run(venv: Path, *args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KILN_", "PYTHON"))}
    return subprocess.run([str(venv / "bin" / "kiln-run"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          encoding="utf-8", timeout=timeout)


def _get(url: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@slow
def test_the_runtime_alone_runs_the_release_as_the_build_does(released, runtime_venv, tmp_path):
    """In a venv made from runtime/lockfile.txt alone (no torch, DVC, MLflow, onnx: the fixture asserts it),
    `kiln-run identify` on the build's system release prints every box, identity and distance that `kiln identify
    --release` prints in the build environment, and its JSON answers are the build's in-process deployed system's."""
    root, c8 = released["root"], released["cfg"]
    archive, pub = str(released["release"].archive), str(released["pub"])
    photos = [str(p.path) for p in list_photos(root / c8.data.photos)]
    (tmp_path / "host").mkdir()
    ours = _run(runtime_venv, "identify", archive, "--key", pub, *photos, cwd=tmp_path / "host")
    assert ours.returncode == 0, ours.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KILN_"))}
    theirs = subprocess.run([sys.executable, "-m", "pipeline.cli", "identify", "--release", archive, "--key", pub,
                             *photos], cwd=tmp_path / "host", env=env, capture_output=True, text=True, timeout=600)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert ours.stdout == theirs.stdout and len(_faces(ours.stdout)) == 2 * len(photos), (ours.stdout, theirs.stdout)

    answers = _run(runtime_venv, "identify", archive, "--key", pub, "--json", *photos, cwd=tmp_path / "host")
    assert answers.returncode == 0, answers.stderr[-3000:]
    from kiln_runtime.serve import answer

    with system_release.verified(released["release"].archive, released["pub"]) as (tree, checked):
        d = system_release.deployed(tree, checked)
        want = [{"photo": p, **answer(d.system.identify(load_rgb(Path(p))), d.name, d.version,
                                      load_rgb(Path(p)).shape[:2])} for p in photos]
    assert [json.loads(ln) for ln in answers.stdout.splitlines()] == json.loads(json.dumps(want))
    assert list((tmp_path / "host").iterdir()) == []

    # a tampered archive, a wrong key: one line each, no traceback, nothing written
    bad = tmp_path / "bad.tar.gz"
    data = bytearray(Path(archive).read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    for args, code, needle in ((["verify", str(bad), "--key", pub], (1, 2), "kiln-run: error:"),
                               (["verify", archive, "--key", str(tmp_path / "none.pub")], (2,), "no such public key"),
                               (["identify", archive, "--key", pub, str(tmp_path / "missing.jpg")], (2,), "not found"),
                               (["bench", archive, "--key", pub, photos[0], "--json", str(tmp_path / "no" / "r.json")],
                                (2,), "does not exist or is not writable")):
        r = _run(runtime_venv, *args, cwd=tmp_path / "host")
        assert r.returncode in code and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    assert list((tmp_path / "host").iterdir()) == []


@slow
def test_a_host_with_another_runtime_is_refused_unless_the_golden_check_passes_there(released, runtime_venv, tmp_path):
    """Each engine's runtime requirement is in the signed release.json (the build's own versions), with golden
    samples. A host whose ONNX Runtime is another release (1.31.1, installed from PyPI by its hash, ahead of the
    runtime venv's 1.32.0) is refused by verify / identify / serve in one line naming both versions; with
    --allow-runtime-drift each drifted engine first passes its golden check on that runtime, then identify answers
    as on the gated runtime; a golden output that this runtime does not reproduce stops it (exit 1)."""
    import onnxruntime

    archive, pub = str(released["release"].archive), str(released["pub"])
    tree = _tree(released["release"].archive, tmp_path / "x")
    doc = json.loads((tree / "release.json").read_bytes())
    assert {p["runtime"]["package"] for p in doc["parts"]} == {"onnxruntime"}, doc["parts"]
    assert all(p["runtime"]["version"] == onnxruntime.__version__ and p["runtime"]["allowed"] ==
               f"=={onnxruntime.__version__}" and p["runtime"]["host_class"] for p in doc["parts"])
    assert sorted(doc["golden"]["engines"]) == sorted(p["engine"] for p in doc["parts"])
    assert all(1 <= e["samples"] <= 8 for e in doc["golden"]["engines"].values())
    other = tmp_path / "ort-1.31.1"
    subprocess.run([str(runtime_venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--require-hashes", "--target", str(other), "-r",
                    str(Path(__file__).with_name("drift-runtime.txt"))], check=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(other)}
    photos = [str(p.path) for p in list_photos(released["root"] / released["cfg"].data.photos)][:2]
    host = tmp_path / "host"
    host.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(runtime_venv / "bin" / "kiln-run"), *args], cwd=host, capture_output=True,
                              text=True, encoding="utf-8", timeout=600,
                              env={k: v for k, v in env.items() if not k.startswith(("MLFLOW_", "KILN_"))})

    for args in (["verify", archive, "--key", pub], ["identify", archive, "--key", pub, *photos],
                 ["serve", archive, "--key", pub, "--port", "9"]):
        r = run(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
        first = r.stderr.splitlines()[0]
        assert f"gated with onnxruntime {onnxruntime.__version__}" in first and "this host has onnxruntime 1.31.1" \
            in first and "--allow-runtime-drift" in r.stderr, r.stderr
    ok = run("verify", archive, "--key", pub, "--allow-runtime-drift")
    assert ok.returncode == 0, ok.stderr[-3000:]
    drift = [ln for ln in ok.stdout.splitlines() if "runtime drift allowed" in ln]
    assert len(drift) == len(doc["parts"]) and all("golden check" in ln and "cosine min" in ln for ln in drift), \
        ok.stdout
    same = run("identify", archive, "--key", pub, "--allow-runtime-drift", "--json", *photos)
    gated = _run(runtime_venv, "identify", archive, "--key", pub, "--json", *photos, cwd=host)
    assert same.returncode == 0 and gated.returncode == 0, same.stderr[-2000:] + gated.stderr[-2000:]
    who = [[f["identity"] for f in json.loads(ln)["faces"]] for ln in same.stdout.splitlines()]
    assert who == [[f["identity"] for f in json.loads(ln)["faces"]] for ln in gated.stdout.splitlines()]

    # a golden output the drifted runtime does not reproduce (re-signed with the publisher's key): exit 1
    emb = next(p["engine"] for p in doc["parts"] if p["model"] == "embedder")
    out = tree / "golden" / emb / "0.out.0.npy"
    y = np.load(out, allow_pickle=False)
    out.unlink()
    np.save(out, -y, allow_pickle=False)
    rel, sha = out.relative_to(tree).as_posix(), hashlib.sha256(out.read_bytes()).hexdigest()
    _edit_json(tree / "slsa-provenance.json", lambda st: next(x for x in st["subject"] if x["name"] == rel)
               ["digest"].update(sha256=sha))
    sig = tmp_path / "x" / f"{REL}{release.SIG_SUFFIX}"
    sig.unlink()
    signing.sign_tree(tree, sig, released["key"])
    bad = _repack(tmp_path / "x", tmp_path / "bad.tar.gz")
    r = run("verify", str(bad), "--key", pub, "--allow-runtime-drift")
    assert r.returncode == 1 and f"{emb}: golden check" in r.stderr and "FAILED" in r.stderr, r.stderr[-2000:]
    assert _run(runtime_venv, "verify", str(bad), "--key", pub, cwd=host).returncode == 0   # its own runtime: fine
    assert list(host.iterdir()) == []


@slow
def test_a_photo_name_that_holds_terminal_controls_is_shown_escaped(released, runtime_venv, tmp_path):
    """Round 4's leftover (round 5 item 8): a photo whose file name holds ESC / OSC 8 (a hyperlink that hides its
    target) was printed raw by `kiln-run identify` and `kiln identify --release`; now shown escaped, as every other
    untrusted text."""
    photo = list_photos(released["root"] / released["cfg"].data.photos)[0].path
    evil = tmp_path / "\x1b]8;;evil.example\x07boss\x1b]8;;\x07.jpg"
    shutil.copyfile(photo, evil)
    archive, pub = str(released["release"].archive), str(released["pub"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KILN_"))}
    for r in (_run(runtime_venv, "identify", archive, "--key", pub, str(evil), cwd=tmp_path),
              subprocess.run([sys.executable, "-m", "pipeline.cli", "identify", "--release", archive, "--key", pub,
                              str(evil)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)):
        assert r.returncode == 0 and "\x1b" not in r.stdout + r.stderr, r.stdout
        assert "\\x1b]8;;evil.example\\x07boss\\x1b]8;;\\x07.jpg: 1 face" in r.stdout, r.stdout
    missing = _run(runtime_venv, "identify", archive, "--key", pub, str(tmp_path / "\x1b[2Jgone.jpg"), cwd=tmp_path)
    assert missing.returncode == 2 and "\\x1b[2Jgone.jpg: not found" in missing.stderr and "\x1b" not in missing.stderr


@slow
def test_serve_answers_over_http_and_drains_on_sigterm(released, runtime_venv, tmp_path):
    """`kiln-run serve` from the runtime venv: not ready until verified and warmed; POST /v1/identify answers what
    `kiln-run identify --json` answers; a bad image is a 400 and an oversized body a 413 (JSON, the service keeps
    serving); a full queue is a 503; /metrics counts it all; SIGTERM with a request in flight finishes it, exits 0."""
    import signal
    import threading

    from kiln_runtime.serve import free_port

    root, c8 = released["root"], released["cfg"]
    archive, pub = str(released["release"].archive), str(released["pub"])
    photos = [p.path for p in list_photos(root / c8.data.photos)]
    want = _run(runtime_venv, "identify", archive, "--key", pub, "--json", *map(str, photos), cwd=tmp_path)
    assert want.returncode == 0, want.stderr[-2000:]
    want = {Path(d["photo"]).name: {k: v for k, v in d.items() if k != "photo"}
            for d in map(json.loads, want.stdout.splitlines())}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KILN_", "PYTHON"))}
    t0 = time.monotonic()
    proc = subprocess.Popen([str(runtime_venv / "bin" / "kiln-run"), "serve", archive, "--key", pub, "--port",
                             str(port), "--workers", "1", "--queue", "2", "--max-bytes", str(3 << 20),
                             "--drain-delay", "0"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                status, _ = _get(url + "/readyz", timeout=1)
                if status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() - t0 < 60, "not ready within 60 s"
            time.sleep(0.02)
        print(f"serve: start → ready {time.monotonic() - t0:.2f} s")
        assert _get(url + "/healthz")[0] == 200
        for p in photos:
            status, body = _get(url + "/v1/identify", p.read_bytes())
            assert status == 200, body[:500]
            got = json.loads(body)
            assert set(got.pop("timings_ms")) >= {"pnet", "rnet", "onet", "align", "embed", "match"}
            assert got == want[p.name], p.name
        status, body = _get(url + "/v1/identify", b"not an image")
        assert status == 400 and "not a readable image" in json.loads(body)["error"], body
        import http.client     # a body declared over the bound: refused from its header, before a byte is read

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.putrequest("POST", "/v1/identify")
        conn.putheader("Content-Length", str((3 << 20) + 1))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and "hint" in json.loads(resp.read()), resp.status
        conn.close()
        # a burst past the queue's bound: some answered 503 at once, the rest 200; none fails otherwise
        big = max(photos, key=lambda p: p.stat().st_size).read_bytes()
        codes: list[int] = []
        burst = [threading.Thread(target=lambda: codes.append(_get(url + "/v1/identify", big)[0])) for _ in range(12)]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
        status, text = _get(url + "/metrics")
        metrics = dict(ln.rsplit(" ", 1) for ln in text.decode().splitlines() if ln and not ln.startswith("#"))
        assert status == 200 and metrics["kiln_ready"] == "1"
        assert int(metrics['kiln_requests_total{status="200"}']) == len(photos) + codes.count(200)
        assert int(metrics['kiln_errors_total{reason="bad_image"}']) == 1
        assert int(metrics['kiln_errors_total{reason="too_large"}']) == 1
        assert int(metrics['kiln_errors_total{reason="overloaded"}']) == codes.count(503)
        assert float(metrics["kiln_frames_total"]) == len(photos) + codes.count(200)
        assert int(metrics['kiln_request_duration_seconds_bucket{le="+Inf"}']) == len(photos) + codes.count(200)
        assert 'kiln_stage_duration_seconds_count{stage="embed"}' in metrics
        # SIGTERM with a request in flight: it is answered, then the process exits 0
        late: list[int] = []
        inflight = threading.Thread(target=lambda: late.append(_get(url + "/v1/identify", big)[0]))
        inflight.start()
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        inflight.join(timeout=60)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and late == [200], (proc.returncode, late, err[-2000:])
        assert "drained" in out and "Traceback" not in err, (out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@slow
def test_serve_refuses_to_start_on_a_bad_release_or_a_taken_port(released, runtime_venv, tmp_path):
    """Verification happens before the port opens: a tampered archive never serves (exit 1, one line); nor does a
    release on a port another process holds (exit 2, one line, not uvicorn's log after the workers started)."""
    from kiln_runtime.serve import free_port

    bad = tmp_path / "bad.tar.gz"
    data = bytearray(released["release"].archive.read_bytes())
    data[len(data) // 3] ^= 0x01
    bad.write_bytes(bytes(data))
    port = free_port()
    r = _run(runtime_venv, "serve", str(bad), "--key", str(released["pub"]), "--port", str(port), cwd=tmp_path,
             timeout=120)
    assert r.returncode in (1, 2) and "kiln-run: error:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "serving on" not in r.stdout
    import socket                             # a port already taken: one line, before any worker starts

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = _run(runtime_venv, "serve", str(released["release"].archive), "--key", str(released["pub"]), "--port",
                 str(taken.getsockname()[1]), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "serving on" not in r.stdout


@slow
def test_bench_sweeps_the_release_in_process_and_over_http(released, runtime_venv, tmp_path):
    """`kiln-run bench --http` on the runtime venv: one short point in process, then `serve` started, swept over
    loopback HTTP and stopped; the report names the host class and holds both sweeps (no timing is asserted)."""
    root, c8 = released["root"], released["cfg"]
    photo = str(list_photos(root / c8.data.photos)[0].path)
    report = tmp_path / "bench.json"
    r = _run(runtime_venv, "bench", str(released["release"].archive), "--key", str(released["pub"]), photo,
             "--streams", "1", "--seconds", "0.5", "--fps", "4", "--http", "--json", str(report), cwd=tmp_path,
             timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    doc = json.loads(report.read_text(encoding="utf-8"))
    assert doc["host_class"] and doc["system"] == NAME and doc["serve_start_s"] > 0
    for sweep in (doc["in_process"], doc["http"]):
        point = sweep["points"][0]
        assert point["streams"] == 1 and point["frames"] > 0 and point["decided"] + point["dropped"] == point["frames"]
    assert "over HTTP (kiln-run serve, loopback)" in r.stdout and "host class" in r.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


# ---------------------------------------------------------------------------------------------- through an OCI registry
def _push(reg, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "push", *args], env=reg.env(), capture_output=True,
                          text=True, encoding="utf-8", timeout=300, cwd=REPO)


def _run_with(venv: Path, env: dict, *args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if not k.startswith(("MLFLOW_", "PYTHON"))}
    return subprocess.run([str(venv / "bin" / "kiln-run"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          encoding="utf-8", timeout=timeout)


@slow
def test_push_pull_verify_serve_through_an_oci_registry(released, runtime_venv, oci_registry, tmp_path):
    """`kiln push` (the build) → the registry (TLS, basic auth) → `kiln-run pull` by tag and by digest (the runtime
    venv alone) → the same bytes placed → `kiln-run serve REF` answers. The same release pushed twice has one
    manifest digest; the manifest carries the system, version, verdict and every part's digest; the password is
    never printed."""
    archive, pub = released["release"].archive, str(released["pub"])
    ref = f"{oci_registry.host}/kiln/{SYSTEM}:1"
    first, again = _push(oci_registry, str(archive), ref, "--key", pub), _push(oci_registry, str(archive), ref,
                                                                               "--key", pub)
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    digest = first.stdout.split("manifest ")[1].split()[0]
    assert again.stdout.split("manifest ")[1].split()[0] == digest and "the registry had it already" in again.stdout
    from kiln_runtime import oci

    with pytest.MonkeyPatch.context() as mp:
        for k, v in oci_registry.env().items():
            mp.setenv(k, v)
        raw, got = oci.Registry(oci.parse_ref(ref)).manifest()
    notes = json.loads(raw)["annotations"]
    rel = json.loads((_tree(archive, tmp_path / "t") / "release.json").read_text(encoding="utf-8"))
    assert got == digest and notes["dev.kiln.system"] == SYSTEM and notes["dev.kiln.version"] == "1"
    assert notes["dev.kiln.verdict"] == "pass" and notes["dev.kiln.system.sha256"] == rel["system_sha256"]
    assert {k.removeprefix("dev.kiln.part.") for k in notes if k.startswith("dev.kiln.part.")} == \
        {p["model"] for p in rel["parts"]}

    host = tmp_path / "host"
    host.mkdir()
    env = oci_registry.env()
    by_tag = _run_with(runtime_venv, env, "pull", ref, "--key", pub, "--out", "releases", cwd=host)
    assert by_tag.returncode == 0, by_tag.stderr[-3000:]
    placed = host / "releases" / archive.name
    assert [p.name for p in (host / "releases").iterdir()] == [archive.name]
    assert placed.read_bytes() == archive.read_bytes() and f"manifest {digest}" in by_tag.stdout
    pinned = f"{oci_registry.host}/kiln/{SYSTEM}@{digest}"
    by_digest = _run_with(runtime_venv, env, "pull", pinned, "--key", pub, "--out", "releases", cwd=host)
    assert by_digest.returncode == 0 and "already there, the same bytes" in by_digest.stdout, by_digest.stderr
    for r in (first, again, by_tag, by_digest):
        assert oci_registry.password not in r.stdout + r.stderr

    from kiln_runtime.serve import free_port

    port = free_port()
    proc = subprocess.Popen([str(runtime_venv / "bin" / "kiln-run"), "serve", pinned, "--key", pub, "--port",
                             str(port), "--workers", "1", "--drain-delay", "0"], cwd=host, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8")
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                if _get(f"http://127.0.0.1:{port}/readyz", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() - t0 < 90, "not ready within 90 s"
            time.sleep(0.05)
        photo = list_photos(released["root"] / released["cfg"].data.photos)[0].path
        status, body = _get(f"http://127.0.0.1:{port}/v1/identify", photo.read_bytes())
        assert status == 200 and json.loads(body)["faces"] and json.loads(body)["system"] == NAME, body[:300]
    finally:
        import signal

        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err and "pulled" in err, err[-2000:]
    assert sorted(p.name for p in host.rglob("*")) == [archive.name, "releases"]


@slow
def test_a_re_signed_or_re_pointed_release_is_refused_on_pull(released, oci_registry, tmp_path, monkeypatch,
                                                              capsys):
    """What a registry cannot vouch for: an archive re-signed under an attacker's key (its digests all hold) fails
    the signature; the publisher's own signed release under another system's tag, or under another version's tag,
    fails the reference's binding. One line each; nothing placed."""
    from kiln_runtime import cli as runtime_cli
    from kiln_runtime import oci

    for k, v in oci_registry.env().items():
        monkeypatch.setenv(k, v)
    archive, pub = released["release"].archive, str(released["pub"])
    evil_key, _ = signing.keygen(tmp_path / "attacker" / "key.pem")
    tree = _tree(archive, tmp_path / "x")
    sig = tmp_path / "x" / f"{REL}{release.SIG_SUFFIX}"
    sig.unlink()
    signing.sign_tree(tree, sig, evil_key)
    resigned = _repack(tmp_path / "x", tmp_path / "attacker" / archive.name)
    doc = json.loads((tree / "release.json").read_text(encoding="utf-8"))
    oci.push(resigned, oci.parse_ref(f"{oci_registry.host}/evil/{SYSTEM}:1"), doc)

    good = oci.push(archive, oci.parse_ref(f"{oci_registry.host}/kiln/{SYSTEM}:1"), doc)
    raw = oci.Registry(oci.parse_ref(f"{oci_registry.host}/kiln/{SYSTEM}:1")).manifest()[0]
    other = oci.Registry(oci.parse_ref(f"{oci_registry.host}/kiln/other-system:1"))    # the attacker's re-point
    other.push_blob(archive, good.layer)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "c").write_bytes(oci.EMPTY)
        other.push_blob(Path(tmp) / "c", oci.EMPTY_DESCRIPTOR)
    other.put_manifest(raw)
    oci.Registry(oci.parse_ref(f"{oci_registry.host}/kiln/{SYSTEM}:2")).put_manifest(raw)

    out = tmp_path / "out"
    for ref, needle in ((f"{oci_registry.host}/evil/{SYSTEM}:1", "verification failed"),
                        (f"{oci_registry.host}/kiln/other-system:1", f"signed release is system '{SYSTEM}'"),
                        (f"{oci_registry.host}/kiln/{SYSTEM}:2", "the tag says version 2")):
        code = runtime_cli.main(["pull", ref, "--key", pub, "--out", str(out)])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 1 and lines[0].startswith("kiln-run: error:") and needle in lines[0], err
        assert len(lines) <= 2 and "Traceback" not in err and ".kiln-pull-" not in err, err
        assert not out.exists() and not list(tmp_path.glob(".kiln-pull-*")), ref


# ---------------------------------------------------------------------------------------------- the service, hostile
# Reliability round 5 (issue 56): a dead worker, slow clients, decode bombs and formats, shutdown as an orchestrator
# expects, the Open Inference Protocol's health and metadata, hygiene. Small configured bounds keep each case short.
@contextmanager
def _serving(venv: Path, archive: str, pub: str, *args: str, cwd: Path, env: dict | None = None):
    """`kiln-run serve` from the runtime venv, ready (/readyz 200); (the process, its URL, its log files)."""
    from kiln_runtime.serve import free_port

    port = free_port()
    env = env or {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KILN_", "PYTHON"))}
    logs = (cwd / f"serve-{port}.out", cwd / f"serve-{port}.err")
    with open(logs[0], "w", encoding="utf-8") as out, open(logs[1], "w", encoding="utf-8") as err:
        proc = subprocess.Popen([str(venv / "bin" / "kiln-run"), "serve", archive, "--key", pub, "--port", str(port),
                                 *args], cwd=cwd, env=env, stdout=out, stderr=err, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, logs[1].read_text(encoding="utf-8")[-2000:]
            try:
                if _get(url + "/readyz", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() - t0 < 90, "not ready within 90 s"
            time.sleep(0.05)
        yield proc, url, logs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _workers(pid: int) -> list[int]:
    """The worker processes of a serve process (its multiprocessing children, not the resource tracker)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text(encoding="ascii").split()]
    return sorted(k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes())


def _metrics(url: str) -> dict[str, str]:
    status, text = _get(url + "/metrics")
    assert status == 200
    return dict(ln.rsplit(" ", 1) for ln in text.decode().splitlines() if ln and not ln.startswith("#"))


def _recovered(url: str, replaced: int, bound_s: float = 60) -> float:
    """Seconds until /readyz says every worker is ready again after `replaced` replacements."""
    t0 = time.monotonic()
    while True:
        status, body = _get(url + "/readyz", timeout=5)
        w = json.loads(body)["workers"]
        if status == 200 and w["replaced"] == replaced and w["ready"] == w["of"]:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < bound_s, (status, body)
        time.sleep(0.05)


def _big_frame(photo: Path, size: tuple[int, int] = (4096, 3072)) -> bytes:
    """A JPEG of a real photo scaled up: a frame that keeps a worker busy for a while (under the pixel cap)."""
    import io

    from PIL import Image

    with Image.open(photo) as im:
        buf = io.BytesIO()
        im.convert("RGB").resize(size).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@slow
def test_a_dead_worker_is_replaced_and_sigterm_drains_as_an_orchestrator_expects(released, runtime_venv, tmp_path):
    """Item 1: a worker SIGKILLed while idle, then the workers SIGKILLed while one runs a frame: only that frame's
    request fails (503, Retry-After), the service answers 200 meanwhile and again after, /readyz and /metrics show
    the reduced capacity and the replacements. Item 7: on SIGTERM /readyz turns 503 at once while identify is still
    answered (Connection: close) for the drain delay; then the port closes and the process exits 0 within a bound.
    Before round 5: one dead worker made every later request a 500, forever, and SIGTERM then hung."""
    import http.client
    import signal
    import threading

    photos = [p.path for p in list_photos(released["root"] / released["cfg"].data.photos)]
    photo = photos[0].read_bytes()
    archive, pub = str(released["release"].archive), str(released["pub"])
    with _serving(runtime_venv, archive, pub, "--workers", "2", "--max-batch", "1", "--drain-delay", "2",
                  cwd=tmp_path) as (proc, url, logs):
        assert json.loads(_get(url + "/readyz")[1])["workers"] == {"ready": 2, "of": 2, "replaced": 0}
        first = _workers(proc.pid)
        assert len(first) == 2, first
        os.kill(first[0], signal.SIGKILL)                                           # idle
        t_kill = time.monotonic()
        assert _get(url + "/v1/identify", photo)[0] == 200                          # the other one answers
        _recovered(url, 1)
        idle_s = time.monotonic() - t_kill
        assert _get(url + "/v1/identify", photo)[0] == 200
        print(f"serve: an idle worker SIGKILLed → every worker ready again in {idle_s:.2f} s")

        busy: list[tuple[int, bytes]] = []
        t = threading.Thread(target=lambda: busy.append(_get(url + "/v1/identify", _big_frame(photos[0]))))
        t.start()
        t0 = time.monotonic()
        while _metrics(url)["kiln_queue_depth"] != "1":                           # the frame is in the service
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
        time.sleep(0.2)
        for w in _workers(proc.pid):                                                # the one running it among them
            os.kill(w, signal.SIGKILL)
        t.join(timeout=60)
        (status, body), = busy
        assert status == 503 and "worker process running this frame died" in json.loads(body)["error"], body
        busy_s = _recovered(url, 3)
        print(f"serve: both workers SIGKILLed, one busy → every worker ready again in {busy_s:.2f} s")
        codes = [_get(url + "/v1/identify", p.read_bytes())[0] for p in photos]
        assert codes == [200] * len(photos)
        m = _metrics(url)
        assert (m["kiln_worker_restarts_total"], m["kiln_workers_ready"], m["kiln_workers"]) == ("3", "2", "2")
        assert m['kiln_errors_total{reason="worker_died"}'] == "1" and 'kiln_requests_total{status="500"}' not in m

        keep = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=30)
        keep.request("GET", "/healthz")
        assert keep.getresponse().read() and True
        proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        t0 = time.monotonic()
        while _get(url + "/readyz", timeout=5)[0] != 503:                           # at once
            assert time.monotonic() - t0 < 1
            time.sleep(0.01)
        assert _get(url + "/v2/health/ready")[0] == 503 and _get(url + "/healthz")[0] == 200
        keep.request("POST", "/v1/identify", body=photo)                            # still answered, then moved on
        r = keep.getresponse()
        assert r.status == 200 and r.getheader("Connection") == "close" and json.loads(r.read())["faces"]
        keep.close()
        while True:                                                                 # the port closes after the delay
            try:
                _get(url + "/healthz", timeout=2)
            except OSError:
                break
            assert time.monotonic() - t_term < 2 + 5
            time.sleep(0.05)
        closed_s = time.monotonic() - t_term
        assert proc.wait(timeout=30 + 10) == 0
        print(f"serve: SIGTERM → port closed after {closed_s:.2f} s (drain delay 2), exit 0 after "
              f"{time.monotonic() - t_term:.2f} s")
        assert closed_s >= 1.8
        out, err = (f.read_text(encoding="utf-8") for f in logs)
        assert "drained" in out and "Traceback" not in err and "killed by SIGKILL" in err, err[-3000:]
        assert err.count("starting a replacement") == 3 and "the 1 request(s) it held failed" in err, err[-3000:]


@slow
def test_slow_clients_bombs_and_other_formats_are_bounded_and_oip_answers(released, runtime_venv, tmp_path):
    """Items 3, 4, 6 and 7's endpoints: heads and bodies that never finish are cut at the configured bounds (408)
    while /healthz answers, past the connection limit too; a 9000×9000 PNG of 79 kB is refused from its header
    (413), GIF and TIFF with the allowed formats named (400); a frame past the request bound is a 504 and its
    worker replaced; a client that hangs up mid-body is one log line, not a
    traceback; the Open Inference Protocol's health and model metadata (release version, the archive's sha256, the
    embedder's digest) answer as gateways expect."""
    import hashlib
    import io
    import socket

    import numpy as np
    from PIL import Image

    archive, pub = str(released["release"].archive), str(released["pub"])
    rel = json.loads((_tree(released["release"].archive, tmp_path / "t") / "release.json").read_text("utf-8"))
    with _serving(runtime_venv, archive, pub, "--workers", "1", "--header-timeout", "1", "--body-timeout", "1",
                  "--max-connections", "16", "--request-timeout", "0.25", "--drain-delay", "0",
                  cwd=tmp_path) as (proc, url, logs):
        port = int(url.rsplit(":", 1)[1])
        slow = []
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/identify HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"POST /v1/identify HTTP/1.1\r\n"
                      b"Host: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100)
            slow.append(s)
        assert _get(url + "/healthz", timeout=5)[0] == 200                          # at the limit: answered
        answers = []
        for s in slow:
            s.settimeout(5)
            try:
                answers.append(s.recv(65536))
            except OSError:
                answers.append(b"")
            s.close()
        assert all(a.startswith((b"HTTP/1.1 408 ", b"HTTP/1.1 503 ")) for a in answers), answers[:3]
        m = _metrics(url)
        events = {k: int(v) for k, v in m.items() if k.startswith("kiln_connection_events_total")}
        assert sum(events.values()) == 40 and events.get('kiln_connection_events_total{event="evicted"}', 0) >= 40 - 17
        assert any("timeout" in k for k in events) and m["kiln_connections"] in ("1", "2"), events

        cut = socket.create_connection(("127.0.0.1", port))                         # hangs up mid-body
        cut.sendall(b"POST /v1/identify HTTP/1.1\r\nHost: x\r\nContent-Length: 500000\r\n\r\n" + b"x" * 1000)
        time.sleep(0.2)
        cut.close()

        bomb = io.BytesIO()
        Image.new("L", (9000, 9000)).save(bomb, "PNG")
        assert len(bomb.getvalue()) < 100_000
        status, body = _get(url + "/v1/identify", bomb.getvalue())
        assert status == 413 and "9000×9000 pixels is too large (limit 16.8 MP)" in json.loads(body)["error"], body
        photo = list_photos(released["root"] / released["cfg"].data.photos)[0].path
        status, body = _get(url + "/v1/identify", _big_frame(photo, (4096, 4096)))    # ≈ 1-2 s of work here
        assert status == 504 and "within the service's bound of 0.25 s" in json.loads(body)["error"], body
        assert _recovered(url, 1) >= 0                                # its worker was stopped and replaced
        for fmt in ("GIF", "TIFF"):
            buf = io.BytesIO()
            Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(buf, fmt)
            status, body = _get(url + "/v1/identify", buf.getvalue())
            err = json.loads(body)
            assert status == 400 and f"{fmt} image; this service reads JPEG, PNG, BMP, WebP only" in err["error"]
            assert "JPEG, PNG, BMP, WebP" in err["hint"]

        assert _get(url + "/v2/health/live")[0] == 200 and _get(url + "/v2/health/ready")[0] == 200
        status, body = _get(url + f"/v2/models/{SYSTEM}")
        meta = json.loads(body)
        embedder = next(p for p in rel["parts"] if p["model"] == "embedder")
        assert status == 200 and meta["name"] == SYSTEM and meta["versions"] == ["1"]
        assert meta["parameters"]["archive_digest"] == "sha256:" + hashlib.sha256(
            released["release"].archive.read_bytes()).hexdigest()
        assert meta["parameters"]["system_sha256"] == rel["system_sha256"]
        assert meta["parameters"]["embedder"]["xxh3_128"] == embedder["xxh3_128"]
        assert _get(url + f"/v2/models/{SYSTEM}/versions/1/ready")[0] == 200
        assert _get(url + f"/v2/models/{SYSTEM}/versions/7")[0] == 404 and _get(url + "/v2/models/other")[0] == 404
        assert json.loads(_get(url + "/v2")[1])["name"] == "kiln-run"
        m = _metrics(url)
        assert m['kiln_errors_total{reason="too_large"}'] == "1" and m['kiln_errors_total{reason="bad_image"}'] == "2"
        assert m['kiln_errors_total{reason="client_disconnected"}'] == "1"
        assert m['kiln_errors_total{reason="timeout"}'] == "1" and m["kiln_worker_restarts_total"] == "1"
        assert m["kiln_queue_depth"] == "0" and m["kiln_inflight_requests"] == "0"     # nothing held after all that
        import signal

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    out, err = (f.read_text(encoding="utf-8") for f in logs)
    assert "Traceback" not in err and err.count("a client hung up after") == 1, err[-3000:]


@slow
def test_serve_bounds_its_setup_and_leaves_no_tree_behind(released, runtime_venv, tmp_path):
    """Item 6: `--host ''` (every interface, silently) and more workers than cores are refused in one line, before
    anything is verified; connections the host's file limit cannot hold are refused at start. A serve SIGTERMed while
    its workers load exits at once and leaves no extracted tree; one SIGKILLed leaves one, its workers exit, and the
    next kiln-run command removes it."""
    import resource
    import signal

    from kiln_runtime.serve import free_port

    archive, pub = str(released["release"].archive), str(released["pub"])
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()

    def ours() -> list[str]:                  # what kiln-run leaves in TMPDIR (ONNX Runtime keeps a .ses file there)
        return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("kiln-"))

    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KILN_", "PYTHON"))},
           "TMPDIR": str(tmpdir)}
    serve = [str(runtime_venv / "bin" / "kiln-run"), "serve", archive, "--key", pub, "--port", str(free_port())]
    for extra, needle in ((["--host", ""], "--host '' would listen on every interface"),
                          (["--workers", str(os.cpu_count() + 1)], "more workers than cores")):
        r = subprocess.run(serve + extra, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 2
    r = subprocess.run(serve + ["--max-connections", "5000"], env=env, capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
    assert r.returncode == 2 and "--max-connections 5000 needs about" in r.stderr and "ulimit -n" in r.stderr, r.stderr

    for moment in ("extracted", "loading"):     # SIGTERM once the tree is extracted, and once its worker runs
        started = subprocess.Popen(serve + ["--workers", "1"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while not list(tmpdir.glob(f"kiln-verify-release-pid{started.pid}-*/*/release.json")) or \
                moment == "loading" and not _workers(started.pid):
            assert time.monotonic() - t0 < 60 and started.poll() is None
            time.sleep(0.005)
        started.send_signal(signal.SIGTERM)
        out, err = started.communicate(timeout=30)
        # 143 while it starts; 0 if it was ready (a drain) by the time the signal came
        assert started.returncode in (143, 0) and "Traceback" not in err and ours() == [], err
        print(f"serve: SIGTERM when {moment}: exit {started.returncode}, nothing left in TMPDIR")

    with _serving(runtime_venv, archive, pub, "--workers", "1", cwd=tmp_path, env=env) as (proc, url, _):
        workers = _workers(proc.pid)
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while any(Path(f"/proc/{w}").exists() and b"spawn_main" in Path(f"/proc/{w}/cmdline").read_bytes()
                  for w in workers):                                                # they notice and exit
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        left = ours()
        assert len(left) == 1 and left[0].startswith(f"kiln-verify-release-pid{proc.pid}-"), left
    r = subprocess.run([str(runtime_venv / "bin" / "kiln-run"), "verify", archive, "--key", pub], env=env,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and ours() == [], (r.stderr, ours())


# ---------------------------------------------------------------------------------------------- channels
@pytest.fixture(scope="module")
def released_v2(released, sysroot):
    """v2 of the system (its FP32-embedder variant) registered and released beside v1, with the same key: a newer
    version for a channel to move to and back from."""
    root = released["root"]
    c32 = use(sysroot, "fp32")
    try:
        register_parts(c32, root)
        assert systems.register_system(c32, SYSTEM, root).version == 2
        r = system_release.build(c32, SYSTEM, "2", root, released["key"], root / "v2-release")
    finally:
        use(sysroot, "int8")
    return r


@slow
def test_a_channel_follows_only_newer_signed_statements(released, released_v2, runtime_venv, oci_registry,
                                                        tmp_path):
    """Item 2, through the real registry (TLS, basic auth): `kiln push ARCHIVE …:prod` signs a channel statement;
    a host pulls v1, then v2 by the channel. Re-pointing :prod back at v1's older channel manifest (an old, validly
    signed statement) or at a plain release manifest is refused by pull and serve in one line, as is a statement past
    its expiry; a NEW statement pointing at v1 — `kiln push` says it moves to a lower version — is a signed rollback:
    the host follows it and records it. Before round 5 the re-pointed tag was pulled and served with exit 0."""
    from kiln_runtime import oci

    v1, v2, pub = released["release"].archive, released_v2.archive, str(released["pub"])
    env = oci_registry.env(KILN_SIGNING_KEY=str(released["key"]))
    prod = f"{oci_registry.host}/kiln/{SYSTEM}:prod"
    host = tmp_path / "host"
    host.mkdir()
    state = tmp_path / "state"
    runenv = {**oci_registry.env(), "KILN_RUN_STATE": str(state)}

    def pull(ref: str = prod) -> subprocess.CompletedProcess:
        return _run_with(runtime_venv, runenv, "pull", ref, "--key", pub, "--out", "releases", cwd=host)

    def manifest(ref: str) -> bytes:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in oci_registry.env().items():
                mp.setenv(k, v)
            return oci.Registry(oci.parse_ref(ref)).manifest()[0]

    def repoint(raw: bytes) -> None:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in oci_registry.env().items():
                mp.setenv(k, v)
            oci.Registry(oci.parse_ref(prod)).put_manifest(raw)

    first = _push(oci_registry, str(v1), prod, "--key", pub)
    assert first.returncode != 0 and "no signing key" in first.stderr               # a channel needs the signer
    env_push = lambda *a: subprocess.run([sys.executable, "-m", "pipeline.cli", "push", *a], env=env,  # noqa: E731
                                         capture_output=True, text=True, encoding="utf-8", timeout=300, cwd=REPO)
    r = env_push(str(v1), prod, "--key", pub)
    assert r.returncode == 0 and "channel prod → dlib-mtcnn v1 (new channel)" in r.stdout, r.stdout + r.stderr
    old_channel = manifest(prod)
    got = pull()
    assert got.returncode == 0 and "ok  channel prod → dlib-mtcnn v1: statement signed" in got.stdout, got.stderr
    r = env_push(str(v2), prod, "--key", pub)
    assert r.returncode == 0 and "(was v1, issued" in r.stdout and "LOWER" not in r.stdout, r.stdout + r.stderr
    got = pull()
    assert got.returncode == 0 and "dlib-mtcnn v2" in got.stdout, got.stderr
    assert sorted(p.name for p in (host / "releases").iterdir()) == [v1.name, v2.name]

    r = env_push(str(v1), prod, "--key", pub, "--expires", "0.00002")              # ≈ 1.7 s
    assert r.returncode == 0 and "moves to a LOWER version: dlib-mtcnn v2 → v1 — a signed rollback" in r.stdout, \
        r.stdout + r.stderr
    time.sleep(2)
    r = pull()                                                    # the freeze: a statement past its expiry
    assert r.returncode == 1 and "expired at" in r.stderr and "Traceback" not in r.stderr, r.stderr

    repoint(old_channel)                                          # the rollback attack: an old signed statement
    for r in (pull(), _run_with(runtime_venv, runenv, "serve", prod, "--key", pub, "--port", "1", cwd=host)):
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and "older than the one this host already accepted (v2" in lines[-2], r.stderr
        assert lines[-2].startswith("kiln-run: error:") and "Traceback" not in r.stderr
    doc1 = json.loads((_tree(v1, tmp_path / "t1") / "release.json").read_text(encoding="utf-8"))
    repoint(oci.release_manifest(v1, doc1)[0])                     # a plain (signed) release under the channel tag
    r = pull()
    assert r.returncode == 1 and "'prod' is a channel tag, and it points at a release with no signed channel " \
        "statement" in r.stderr, r.stderr

    r = env_push(str(v1), prod, "--key", pub)                     # the real rollback: signed, newer
    assert r.returncode == 0 and "could not be read (it points at a release with no channel statement)" in r.stderr
    got = pull()
    assert got.returncode == 0 and "a signed rollback of kiln/dlib-mtcnn:prod: v2 → v1" in got.stdout, got.stderr
    log = [json.loads(ln) for ln in (state / "channels.log").read_text(encoding="utf-8").splitlines()]
    assert [(e["version"], e["rollback"]) for e in log] == [(1, False), (2, False), (1, True)]
    assert oci_registry.password not in got.stdout + got.stderr


# ---------------------------------------------------------------------------------------------- the live gallery
def _call(url: str, method: str = "GET", body: bytes | None = None, token: str | None = None,
          reason: str | None = None, timeout: float = 60) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **({"X-Kiln-Reason": reason} if reason
                                                                             else {})}
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _who(url: str, photo: bytes) -> list[str]:
    status, doc = _call(url + "/v1/identify", "POST", photo)
    assert status == 200, doc
    return [f["identity"] for f in doc["faces"]]


def _side_by_side(*photos: Path) -> bytes:
    import io

    from PIL import Image

    ims = [Image.open(p).convert("RGB") for p in photos]
    h = max(im.height for im in ims)
    out = Image.new("RGB", (sum(im.width for im in ims), h), (127, 127, 127))
    x = 0
    for im in ims:
        out.paste(im, (x, 0))
        x += im.width
    buf = io.BytesIO()
    out.save(buf, "JPEG", quality=90)
    return buf.getvalue()


@slow
def test_a_live_gallery_enrols_identifies_erases_and_survives_a_restart(released, released_v2, runtime_venv,
                                                                        site_photos, tmp_path):
    """Issue 57, done-when, from the runtime venv against a real server: a SQLite gallery made from the release's
    own; the build's photo of Barack Obama erased (receipt), then Obama enrolled from a photo no build saw and
    identified from two others by every worker, verified 1:1, erased again (`unknown`); a restart finds the state as
    left; `audit` verifies the chain; a release with another embedder refuses the store. And the hostile cases: no
    or a wrong token, a bad subject id, a photo with no face or two, a broken or huge body."""
    import signal
    import hashlib

    archive, pub = str(released["release"].archive), str(released["pub"])
    store = tmp_path / "site.sqlite"
    token = "site-token-" + "x" * 32
    (tmp_path / "token").write_text(token + "\n", encoding="utf-8")
    obama, obama2, obama3, biden = (site_photos / n for n in ("obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg"))
    args = ("--workers", "2", "--gallery", str(store), "--token-file", str(tmp_path / "token"), "--drain-delay", "0")
    with _serving(runtime_venv, archive, pub, *args, cwd=tmp_path) as (proc, url, logs):
        status, info = _call(url + "/v1/gallery")
        rel = json.loads((_tree(released["release"].archive, tmp_path / "t") / "release.json").read_text("utf-8"))
        emb_part = next(p for p in rel["parts"] if p["model"] == "embedder")
        assert status == 200 and (info["subjects"], info["faces"]) == (4, 6)
        assert info["binding"]["embedder_xxh3_128"] == emb_part["xxh3_128"] and info["binding"]["dim"] == 128
        assert _who(url, obama2.read_bytes()) == ["barack_obama"]                  # the build's photo of him

        for tok, code in ((None, 401), ("wrong-" + "y" * 30, 401)):              # writes need the token
            assert _call(url + "/v1/subjects/barack_obama", "DELETE", token=tok)[0] == code
        status, receipt = _call(url + "/v1/subjects/barack_obama", "DELETE", token=token, reason="GDPR request 7")
        assert status == 200 and receipt["versions_that_held"] == [[2, 7]] and receipt["version_without"] == 8
        assert receipt["reason"] == "GDPR request 7" and receipt["faces_erased"]
        assert _who(url, obama2.read_bytes()) == ["unknown"]

        status, face = _call(url + "/v1/subjects/barack_obama/faces", "POST", obama.read_bytes(), token)
        assert status == 201 and face["new"] and face["version"] == 9, face
        for _ in range(6):                                       # every worker answers with the new face in it
            assert _who(url, obama2.read_bytes()) == ["barack_obama"]
        assert _who(url, obama3.read_bytes()) == ["barack_obama"] and _who(url, biden.read_bytes()) == ["unknown"]
        status, same = _call(url + "/v1/subjects/barack_obama/verify", "POST", obama3.read_bytes())
        assert status == 200 and same["same"] and same["face"] == face["face"]
        assert _call(url + "/v1/subjects/barack_obama/verify", "POST", biden.read_bytes())[1]["same"] is False
        again = _call(url + "/v1/subjects/barack_obama/faces", "POST", obama.read_bytes(), token)
        assert again[0] == 200 and not again[1]["new"] and again[1]["face"] == face["face"]   # nothing written

        import io

        from PIL import Image

        blank = io.BytesIO()
        Image.new("RGB", (640, 480), (90, 120, 90)).save(blank, "PNG")
        for path, body, code, needle in (
                ("a%20b/faces", obama.read_bytes(), 400, "not a valid subject id"),
                ("unknown/faces", obama.read_bytes(), 400, "not a valid subject id"),
                ("joe/faces", blank.getvalue(), 422, "no face found"),
                ("joe/faces", _side_by_side(obama2, biden), 422, "2 faces found; enrolment needs exactly one"),
                ("joe/faces", b"\xff\xd8\xff\xe0 broken jpeg" * 10, 400, "not a readable image"),
                ("nobody", None, 404, "no subject nobody")):
            status, doc = _call(url + f"/v1/subjects/{path}", "POST" if body else "DELETE", body, token)
            assert status == code and needle in doc["error"] and doc["hint"], (path, status, doc)
        import http.client                    # a huge body: refused from its header, before a byte of it is read

        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=30)
        conn.putrequest("POST", "/v1/subjects/joe/faces")
        conn.putheader("Authorization", f"Bearer {token}")
        conn.putheader("Content-Length", str(21 << 20))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and "the limit is" in json.loads(resp.read())["error"]
        conn.close()

        status, receipt = _call(url + "/v1/subjects/barack_obama", "DELETE", token=token, reason="GDPR request 8")
        assert status == 200 and receipt["versions_that_held"] == [[2, 7], [9, 9]]
        assert _who(url, obama2.read_bytes()) == _who(url, obama3.read_bytes()) == ["unknown"]
        version = _call(url + "/v1/gallery")[1]["version"]
        m = _metrics(url)
        assert m['kiln_gallery_writes_total{op="enrol"}'] == "1" and m["kiln_gallery_version"] == str(version)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "gallery" in logs[0].read_text(encoding="utf-8")                  # it said it made the store

    with _serving(runtime_venv, archive, pub, *args, cwd=tmp_path) as (proc, url, _):   # a restart: as left
        status, info = _call(url + "/v1/gallery")
        assert (info["version"], info["subjects"], info["faces"]) == (version, 3, 5)
        assert "barack_obama" not in [s["subject"] for s in _call(url + "/v1/subjects")[1]["subjects"]]
        assert _who(url, obama2.read_bytes()) == ["unknown"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0

    r = _run(runtime_venv, "gallery", "audit", str(store), cwd=tmp_path)
    assert r.returncode == 0 and f"audit: {version} event(s), chain verified" in r.stdout, r.stdout + r.stderr
    r = _run(runtime_venv, "serve", str(released_v2.archive), "--key", pub, "--port", "1", "--gallery", str(store),
             cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "refusing to mix vectors" in lines[0] and lines[1].startswith("hint:"), r.stderr
    assert "embedder-ort-cpu-fp32" in lines[0] and "enrol the people again" in lines[1] and "Traceback" not in r.stderr
    assert token not in "".join(f.read_text(encoding="utf-8") for f in tmp_path.glob("serve-*"))
    with sqlite3_rows(store, "SELECT count(*) FROM faces WHERE subject = 'barack_obama'") as rows:
        assert rows == [(0,)]                                                     # nothing of him is left
    assert hashlib.sha256(obama.read_bytes()).hexdigest() not in store.read_bytes().hex()


@contextmanager
def sqlite3_rows(path: Path, query: str):
    import sqlite3

    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        yield conn.execute(query).fetchall()
    finally:
        conn.close()


@slow
def test_concurrent_clients_keep_the_gallery_and_its_log_consistent(released, runtime_venv, site_photos, tmp_path):
    """Many HTTP clients at once — enrolling, erasing, identifying — against two workers: every acknowledged write
    is in the store and in the log, nothing else is, the chain verifies, and a client never sees an identity that
    was not enrolled."""
    import concurrent.futures
    import random

    archive, pub = str(released["release"].archive), str(released["pub"])
    store, token = tmp_path / "busy.sqlite", "busy-token-" + "z" * 32
    photos = [(site_photos / n).read_bytes() for n in ("obama.jpg", "obama2.jpg", "obama3.jpg", "biden.jpg")]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KILN_", "PYTHON"))},
           "KILN_GALLERY_TOKEN": token}
    labels = _tree(released["release"].archive, tmp_path / "t") / runtime_release.GALLERY_DIR / runtime_release.LABELS
    known = {"unknown", *json.loads(labels.read_text(encoding="utf-8")), *(f"s{k}" for k in range(6))}
    with _serving(runtime_venv, archive, pub, "--workers", "2", "--gallery", str(store), "--drain-delay", "0",
                  cwd=tmp_path, env=env) as (proc, url, _):
        def client(i: int) -> list[tuple[str, str, int]]:
            rng, done = random.Random(i), []
            for _ in range(6):
                subject, op = f"s{rng.randrange(6)}", rng.choice(("enrol", "enrol", "erase", "identify"))
                if op == "enrol":
                    status, doc = _call(url + f"/v1/subjects/{subject}/faces", "POST", rng.choice(photos), token)
                    assert status in (200, 201), doc
                elif op == "erase":
                    status, doc = _call(url + f"/v1/subjects/{subject}", "DELETE", token=token)
                    assert status in (200, 404), doc
                else:
                    status, doc = _call(url + "/v1/identify", "POST", rng.choice(photos))
                    assert status == 200 and all(f["identity"] in known for f in doc["faces"]), doc
                done.append((op, subject, status))
            return done

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            ops = [o for got in pool.map(client, range(8)) for o in got]
        writes = sum(1 for op, _, status in ops if (op, status) in (("enrol", 201), ("erase", 200)))
        info = _call(url + "/v1/gallery")[1]
        assert info["version"] == 7 + writes, (info, ops)                     # 1 create + 6 seeded + each write
        import signal

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    r = _run(runtime_venv, "gallery", "audit", str(store), cwd=tmp_path)
    assert r.returncode == 0 and "exactly as the log leaves them" in r.stdout, r.stdout + r.stderr
    print(f"gallery: {len(ops)} concurrent operations, {writes} writes acknowledged; audit verified")


@slow
def test_the_gallery_commands_from_a_shell(released, runtime_venv, site_photos, tmp_path):
    """`kiln-run gallery …` from the runtime venv: init from the release, enrol from photos (one refused: two faces),
    list, verify 1:1 (exit 1 when not the person), identify --gallery, a signed snapshot, erase with a receipt that
    names it, a restore refused for bringing the erased subject back, audit."""
    from pipeline.release import signing

    archive, pub = str(released["release"].archive), str(released["pub"])
    key, key_pub = signing.keygen(tmp_path / "site-keys" / "site.pem")
    store, rel = str(tmp_path / "s.sqlite"), ("--release", archive, "--key", pub)
    two = tmp_path / "two.jpg"
    two.write_bytes(_side_by_side(site_photos / "obama2.jpg", site_photos / "biden.jpg"))

    def run(*args: str, code: int = 0) -> str:
        r = _run(runtime_venv, "gallery", *args, cwd=tmp_path)
        assert r.returncode == code and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
        return r.stdout + r.stderr

    assert "6 face(s) of 4 subject(s) from the release" in run("init", store, *rel)
    assert "enrolled joe_biden face" in run("enrol", store, *rel, "joe_biden", str(site_photos / "biden.jpg"))
    assert "2 faces found; enrolment needs exactly one" in run("enrol", store, *rel, "x", str(two), code=2)
    assert "joe_biden  1 face(s)" in run("list", store)
    assert "NOT joe_biden" in run("verify", store, *rel, "joe_biden", str(site_photos / "obama.jpg"), code=1)
    r = _run(runtime_venv, "identify", archive, "--key", pub, "--gallery", store, str(site_photos / "biden.jpg"),
             cwd=tmp_path)
    assert r.returncode == 0 and "→ joe_biden (nearest joe_biden" in r.stdout, r.stdout + r.stderr
    out = run("snapshot", store, "--signing-key", str(key), "--out", str(tmp_path))
    snap = out.split("→ ")[1].split()[0]
    receipt = json.loads(run("erase", store, "joe_biden", "--reason", "request 9", "--receipt",
                             str(tmp_path / "receipt.json")))
    assert receipt["snapshots_that_hold"][0]["path"] == snap and (tmp_path / "receipt.json").is_file()
    assert "erased from this gallery since it was taken (joe_biden)" in run("restore", store, snap, "--key",
                                                                            str(key_pub), "--reason", "oops", code=1)
    assert "chain verified" in run("audit", store)


# ---------------------------------------------------------------------------------------------- shadow rollout
@slow
def test_a_shadow_candidate_runs_beside_production_and_its_report_is_recorded(released, released_v2, sysroot,
                                                                             runtime_venv, site_photos, tmp_path):
    """Issue 59 part 4: production (v1, INT8 embedder, a live gallery where Joe Biden was enrolled at the site) serves
    with v2 (the FP32 embedder, its own build gallery: another embedder cannot read the store) in shadow on every
    frame. Production's answers are the same as without the shadow; the shadow's counts are what the two systems
    answer alone on the same frames (`kiln-run identify --json`) — Biden's frame disagrees on identity and decision,
    the rest agree; /v1/shadow, /metrics and `kiln-run shadow-report` show them, the log holds no names; `kiln promote
    --system` records the report with the move, and refuses one of another version."""
    import signal

    from pipeline.registry import shadow as shadow_report

    archive, pub, cand = str(released["release"].archive), str(released["pub"]), str(released_v2.archive)
    root, c8 = released["root"], released["cfg"]
    store, rel = str(tmp_path / "site.sqlite"), ("--release", archive, "--key", pub)
    for args in (("init", store, *rel), ("enrol", store, *rel, "joe_biden", str(site_photos / "biden.jpg"))):
        r = _run(runtime_venv, "gallery", *args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    frames = [p.path for p in list_photos(root / c8.data.photos)] + \
        [site_photos / n for n in ("obama.jpg", "obama3.jpg", "biden.jpg")]

    def alone(release: str, *extra: str) -> list[list[str]]:
        r = _run(runtime_venv, "identify", release, "--key", pub, "--json", *extra, *map(str, frames), cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        return [[f["identity"] for f in json.loads(ln)["faces"]] for ln in r.stdout.splitlines()]

    prod, other = alone(archive, "--gallery", store), alone(cand)
    assert (prod[-1], other[-1]) == (["joe_biden"], ["unknown"])      # the site's enrolment: production's only
    n = len(frames)                         # one detector in both: the same faces, in the same order
    same_faces = sum(len(p) == len(o) for p, o in zip(prod, other))
    same_ids = sum(p == o for p, o in zip(prod, other))
    same_decisions = sum([i == "unknown" for i in p] == [i == "unknown" for i in o] for p, o in zip(prod, other))
    assert same_faces == n and same_ids <= same_decisions <= n - 1      # Biden's frame at least: here 8 of 9 agree

    def answers(url: str) -> list[dict]:
        out = []
        for p in frames:
            status, body = _get(url + "/v1/identify", p.read_bytes())
            assert status == 200, body[:500]
            doc = json.loads(body)
            assert doc.pop("timings_ms")                   # per-stage milliseconds: the one part that varies
            out.append(doc)
        return out

    args = ("--workers", "1", "--gallery", store, "--drain-delay", "0")
    with _serving(runtime_venv, archive, pub, *args, cwd=tmp_path) as (proc, url, _):
        plain = answers(url)
        assert _get(url + "/v1/shadow")[0] == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert [[f["identity"] for f in d["faces"]] for d in plain] == prod

    log = tmp_path / "shadow.jsonl"
    shadowed = ("--shadow", cand, "--shadow-log", str(log), "--shadow-share", "1", "--shadow-queue", "64")
    with _serving(runtime_venv, archive, pub, *args, *shadowed, cwd=tmp_path) as (proc, url, logs):
        assert answers(url) == plain                       # the shadow never changes what production answers
        t0 = time.monotonic()
        while (live := json.loads(_get(url + "/v1/shadow")[1]))["frames"]["compared"] < len(frames):
            assert live["frames"]["skipped"] == live["frames"]["failed"] == 0, live
            assert time.monotonic() - t0 < 120, live
            time.sleep(0.1)
        status, text = _get(url + "/metrics")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, logs[1].read_text("utf-8")[-2000:]
    started = logs[0].read_text("utf-8")
    assert f"shadow: {NAME} v2 on 100% of the frames" in started and f"{NAME} v2's build gallery" in started
    want = {"faces": {"agree": same_faces, "disagree": n - same_faces},
            "identities": {"agree": same_ids, "disagree": n - same_ids},
            "decisions": {"agree": same_decisions, "disagree": n - same_decisions}}
    assert live["agreement"] == want and live["candidate"]["version"] == 2 and live["production"]["version"] == 1
    metrics = dict(ln.rsplit(" ", 1) for ln in text.decode().splitlines() if ln and not ln.startswith("#"))
    assert metrics['kiln_shadow_frames_total{outcome="compared"}'] == str(len(frames))
    assert metrics['kiln_shadow_agreement_total{aspect="identities",result="disagree"}'] == str(n - same_ids)
    assert float(metrics['kiln_shadow_frame_ms_p99{system="candidate"}']) > 0

    r = _run(runtime_venv, "shadow-report", str(log), "--json", str(tmp_path / "shadow.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    assert f"frames sampled {len(frames)}: compared {len(frames)}, skipped 0" in r.stdout
    assert f"identities  {same_ids:>8}{n - same_ids:>10}" in r.stdout
    report = json.loads((tmp_path / "shadow.json").read_text("utf-8"))
    assert report["agreement"] == want and report["ms"]["production"]["n"] == len(frames)
    assert "joe_biden" not in log.read_text("utf-8") and "barack_obama" not in log.read_text("utf-8")

    c32 = sysroot["fp32"][0]
    seen = shadow_report.load(log)
    wrong = {**seen, "candidate": {**seen["candidate"], "system_sha256": "0" * 64}}
    with pytest.raises(KilnError, match="not of kiln-system-"):
        systems.promote(c32, SYSTEM, 2, root, shadow=wrong)
    assert int(client().get_registered_model(NAME).aliases["production"]) == 1      # refused: nothing moved
    try:
        moved = systems.promote(c32, SYSTEM, 2, root, reason="shadowed", shadow=seen)
        assert moved.system.to_version == 2 and moved.shadow.startswith(f"shadow of {NAME} v2 beside {NAME} v1: "
                                                                        f"{len(frames)} frame(s) compared")
        last = aliases.history(c32, NAME, root, alias="production")[-1]
        assert last.to_version == 2 and f"identities {same_ids}/{n}" in last.reason
    finally:
        systems.rollback(c8, SYSTEM, root, reason="back to v1 for the rest of this module")
