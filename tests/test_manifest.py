"""Manifests: hashes, identity only (no commit, host or time), verification of files and inputs, atomic writes, the
git dirty flag of the run record."""

from __future__ import annotations

import hashlib
import json

import pytest
import xxhash

from pipeline import cli
from pipeline.records import dirty_files
from pipeline.errors import KilnError
from pipeline.manifest import (atomic_dir, atomic_path, build_manifest, file_digests, identity_digest, input_ref,
                               read_manifest, read_verified, verify_manifest, write_manifest)


def _artifact(d, name="thing", payload=b"engine bytes", inputs=(), toolchain=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.bin").write_bytes(payload)
    m = build_manifest(kind="engine", name=name, directory=d, files=[d / "model.bin"], inputs=list(inputs),
                       toolchain=toolchain or {"x": "1"}, build={}, code={"pipeline/x.py": "c0de"},
                       params={"a.b": 1})
    return write_manifest(d, m)


def test_digests_match_reference_implementations(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"kiln" * 1000)
    d = file_digests(f)
    assert d == {"bytes": 4000, "xxh3_128": xxhash.xxh3_128(b"kiln" * 1000).hexdigest(),
                 "sha256": hashlib.sha256(b"kiln" * 1000).hexdigest()}


def test_verify_passes_then_reports_tampering(tmp_path, capsys):
    path = _artifact(tmp_path / "a")
    assert verify_manifest(path) == []
    (tmp_path / "a" / "model.bin").write_bytes(b"engine bytez")  # same size, other content
    problems = verify_manifest(path)
    assert any("sha256" in p for p in problems) and any("xxh3_128" in p for p in problems)
    assert cli.main(["verify", str(tmp_path / "a")]) == 1
    assert "BAD" in capsys.readouterr().out
    (tmp_path / "a" / "model.bin").unlink()
    assert any("missing" in p for p in verify_manifest(path))


def test_verify_reports_changed_input(tmp_path):
    up = _artifact(tmp_path / "up", name="up")
    down = _artifact(tmp_path / "down", name="down", inputs=[input_ref("onnx", up, tmp_path)])
    assert verify_manifest(down, root=tmp_path) == []
    _artifact(tmp_path / "up", name="up", payload=b"rebuilt differently")
    assert any("input changed" in p for p in verify_manifest(down, root=tmp_path))


def test_identity_is_content_and_code_not_place_or_time(tmp_path):
    a = read_manifest(_artifact(tmp_path / "one" / "a"))
    b = read_manifest(_artifact(tmp_path / "elsewhere" / "deeper" / "a"))
    assert identity_digest(a) == identity_digest(b)                    # another checkout path: same identity
    assert not {"source", "record"} & set(a)                           # no commit, dirty flag, host or timings
    assert a["params"]["sha256"] and a["code"] == {"pipeline/x.py": "c0de"}
    b["toolchain"] = {"x": "2"}
    assert identity_digest(a) != identity_digest(b)


def test_read_verified_refuses_a_modified_input(tmp_path):
    path = _artifact(tmp_path / "a")
    assert read_verified(path)["name"] == "thing"
    (tmp_path / "a" / "model.bin").write_bytes(b"engine bytez")
    with pytest.raises(KilnError, match="files do not match their manifest"):
        read_verified(path)


@pytest.mark.parametrize("porcelain, dirty", [
    (" M dvc.lock\0", False),                          # the first line is the lock: not dirty (was misread)
    (" M dvc.lock\0 M pipeline/cli.py\0", True),
    ("M  artifacts/x\0", False),
    ("R  new.py\0old.py\0", True),                     # a rename: two entries, both paths
    ("", False),
])
def test_dirty_flag_ignores_only_the_lock_and_artifacts(porcelain, dirty):
    assert dirty_files(porcelain)["dirty"] is dirty


def test_manifest_bytes_are_deterministic(tmp_path):
    p1, p2 = _artifact(tmp_path / "a"), _artifact(tmp_path / "b")
    assert p1.read_bytes() == p2.read_bytes()
    assert json.loads(p1.read_text())["files"][0]["path"] == "model.bin"


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    dest = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_path(dest) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_keeps_old_contents_on_failure(tmp_path):
    dest = tmp_path / "art"
    dest.mkdir()
    (dest / "old").write_text("released")
    with pytest.raises(RuntimeError):
        with atomic_dir(dest) as d:
            (d / "new").write_text("half")
            raise RuntimeError("killed")
    assert [p.name for p in tmp_path.iterdir()] == ["art"] and (dest / "old").read_text() == "released"
    with atomic_dir(dest) as d:
        (d / "new").write_text("whole")
    assert sorted(p.name for p in dest.iterdir()) == ["new"]


def test_foreign_json_is_rejected(tmp_path):
    p = tmp_path / "x.manifest.json"
    p.write_text('{"hello": 1}')
    with pytest.raises(KilnError, match="not a Kiln manifest"):
        read_manifest(p)
