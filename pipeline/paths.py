"""Where each stage's artifacts live (dvc.yaml declares the same paths as outs)."""

from __future__ import annotations

from pathlib import Path

ARTIFACTS = Path("artifacts")


def data_set(name: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "data" / name


def golden(model: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "golden" / model


def export(model: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "export" / model


def mtcnn_weights(assets_dir: Path) -> tuple[Path, Path, Path]:
    return tuple(Path(assets_dir) / "mtcnn" / f"{n}.pt" for n in ("pnet", "rnet", "onet"))


def program(model: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "program" / model


def calibration(model: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "calibration" / model


def quantized(model: str, recipe: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "quantized" / f"{model}-{recipe}"


def toolchain_file(target: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "toolchain" / f"{target}.yaml"


def engine(name: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "engines" / name


def validation(name: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "validation" / name


def bench(model: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "bench" / model


def receipt(name: str, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "registry" / f"{name}.json"


def gallery(size: int, root: Path = Path(".")) -> Path:
    return root / ARTIFACTS / "gallery" / str(size)


def index(name: str, root: Path = Path(".")) -> Path:
    """The chosen FAISS index of a gallery (name `gallery-<size>`): index.faiss + manifest."""
    return root / ARTIFACTS / "index" / name


def matching(name: str, root: Path = Path(".")) -> Path:
    """The index choice's gate verdict (validation.json); its curve is `matching/<name>.curve.json`."""
    return root / ARTIFACTS / "matching" / name
