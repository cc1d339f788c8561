"""Pinned assets: hashes are enforced, failures name the asset, nothing half-filled is left behind."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline import assets
from pipeline.errors import KilnError
from pipeline.manifest import verify_manifest

MTCNN = next(a for a in assets.ARCHIVES if a.name == "mtcnn")


def test_fetched_assets_verify(assets_dir):
    assert verify_manifest(assets_dir / "assets.manifest.json") == []
    assert (assets_dir / "photos" / "CREDITS.md").is_file()
    assert len(list((assets_dir / "photos").rglob("*.jpg"))) == 6


def test_wrong_member_hash_fails_and_leaves_previous_output(tmp_path, assets_dir, monkeypatch, cfg):
    from pipeline.stages import assets as assets_stage

    bad = dataclasses.replace(MTCNN, members=(dataclasses.replace(MTCNN.members[0], sha256="0" * 64),))
    monkeypatch.setattr(assets, "ARCHIVES", (bad,))
    out = tmp_path / cfg.assets_dir
    out.mkdir(parents=True)
    (out / "keep").write_text("previous build")
    with pytest.raises(KilnError, match=r"asset 'mtcnn': facenet_pytorch/data/pnet.pt has sha256"):
        assets_stage.run(cfg, tmp_path, progress=lambda _: None)
    assert [p.name for p in out.parent.iterdir()] == ["assets"] and (out / "keep").read_text() == "previous build"


def test_missing_member_is_named(tmp_path, monkeypatch):
    bad = dataclasses.replace(MTCNN, members=(assets.Member("facenet_pytorch/data/qnet.pt", "q.pt", "0" * 64),))
    with pytest.raises(KilnError, match="qnet.pt is missing from facenet_pytorch-2.6.0"):
        assets.materialize(tmp_path, (bad,), progress=lambda _: None)


def test_wrong_archive_hash_is_refused(tmp_path):
    bad = dataclasses.replace(MTCNN, sha256="0" * 64)
    with pytest.raises(KilnError, match=r"asset 'mtcnn': could not download .*(?i:hash)"):
        assets.fetch_archive(bad, tmp_path / "cache")
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def test_no_network_fails_clearly(tmp_path, monkeypatch):
    """An unreachable index is one clear error naming the asset, and the cache stays empty."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    cache = tmp_path / "cache"
    with pytest.raises(KilnError, match=r"asset 'mtcnn': could not download facenet-pytorch==2.6.0") as e:
        assets.fetch_archive(MTCNN, cache)
    assert "network" in e.value.hint
    assert not any(p.is_file() for p in cache.rglob("*")), "a failed download must not fill the cache"
