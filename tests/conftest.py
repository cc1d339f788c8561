"""Shared fixtures: the real pinned assets (fetched once, sha256-verified) and a built workspace."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipeline import assets, config
from pipeline.manifest import verify_manifest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def assets_dir(tmp_path_factory) -> Path:
    """The repository's artifacts/assets when it verifies, else a fresh fetch (PyPI or the Kiln archive cache)."""
    repo_assets = REPO / "artifacts" / "assets"
    manifest = repo_assets / "assets.manifest.json"
    if manifest.is_file() and not verify_manifest(manifest):
        return repo_assets
    out = tmp_path_factory.mktemp("fetched") / "assets"
    assets.run(out, root=REPO, progress=lambda _: None)
    return out


@pytest.fixture(scope="session")
def cfg() -> config.Config:
    return config.load(REPO / "params.yaml")


def write_params(tmp: Path, mutate) -> Path:
    """A copy of the repository's params.yaml, changed by `mutate(raw_dict)`, written into `tmp`."""
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    mutate(raw)
    p = tmp / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def make_root(tmp: Path, assets_dir: Path) -> Path:
    """A scratch project root whose artifacts/assets is the verified assets directory."""
    (tmp / "artifacts").mkdir(parents=True, exist_ok=True)
    link = tmp / "artifacts" / "assets"
    if not link.exists():
        os.symlink(assets_dir, link)
    shutil.copy(REPO / "params.yaml", tmp / "params.yaml")
    return tmp


@pytest.fixture(scope="session")
def built(tmp_path_factory, assets_dir, cfg) -> Path:
    """A root with golden set, calibration set, golden embeddings and the exported embedder, built by the stages."""
    from pipeline.stages import dataset, export, golden

    root = make_root(tmp_path_factory.mktemp("built"), assets_dir)
    dataset.run(cfg, "golden", root)
    dataset.run(cfg, "calibration", root)
    golden.run(cfg, "embedder", root)
    export.run(cfg, "embedder", root)
    return root
