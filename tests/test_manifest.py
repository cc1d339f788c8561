"""Manifests: hashes, identity vs record, verification of files and inputs, atomic writes."""

from __future__ import annotations

import hashlib
import json

import pytest
import xxhash

from pipeline import cli
from pipeline.manifest import (atomic_dir, atomic_path, build_manifest, file_digests, identity_digest, input_ref,
                               read_manifest, verify_manifest, write_manifest)
from pipeline.errors import KilnError


def _artifact(d, name="thing", payload=b"engine bytes", inputs=(), record=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.bin").write_bytes(payload)
    m = build_manifest(kind="engine", name=name, directory=d, files=[d / "model.bin"], inputs=list(inputs),
                       toolchain={"x": "1"}, build={}, source={"git_commit": "abc"}, record=record)
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


def test_identity_digest_ignores_run_records(tmp_path):
    a = read_manifest(_artifact(tmp_path / "a", record={"wall_s": 1.0}))
    b = read_manifest(_artifact(tmp_path / "b", record={"wall_s": 9.0, "host": "other"}))
    assert identity_digest(a) == identity_digest(b)
    b["toolchain"] = {"x": "2"}
    assert identity_digest(a) != identity_digest(b)


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
