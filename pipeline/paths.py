"""Where each stage's artifacts live, and the one rule for names that become paths (kiln_runtime/names.py).

dvc.yaml is generated from the same functions (pipeline/dagtools/dag.py), so a stage's declared outs are these paths.

Every name that becomes a path component (model, engine, recipe, target, release, gallery size) must be a slug:
1-64 characters from letters, digits, '-' and '_', starting with a letter or digit. So no name can be empty,
`.`/`..`, hold a separator or a dot, and every path built here stays under `<root>/artifacts`.

An identity (a photo folder's name: what `kiln identify` prints and a system release ships as a label) must be an
identity slug: a slug other than the words identify prints in a name's place (`unknown`, `distractor`). So no label
can hold a newline that forges an output line, a terminal escape, or a bidi character.
"""

from __future__ import annotations

from pathlib import Path

from kiln_runtime.names import NOT_IDENTITIES, SLUG, is_identity, is_slug, slug  # noqa: F401 — the one rule
from pipeline.errors import KilnError

ARTIFACTS = Path("artifacts")

PROGRAM_FILE = "program.pt2"     # in program/<model>/
ONNX_FILE = "model.onnx"         # in export/<model>/ and quantized/<model>-<recipe>/
VALIDATION_FILE = "validation.json"
BENCH_FILE = "bench.json"
SYSTEM_FILE = "system.json"      # in systems/<name>/, beside VERDICT_FILE
VERDICT_FILE = "verdict.json"


def identity(name: object, where: str) -> str:
    """`name` if it is an identity slug, else a KilnError naming it (repr: its controls escaped; bounded)."""
    if not is_identity(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:79] + "…"
        raise KilnError(f"{where}: {shown} is not an identity name",
                        "name each identity (its photo folder) with 1-64 letters, digits, '-' or '_', starting with a "
                        f"letter or digit, and not {' or '.join(NOT_IDENTITIES)}; e.g. jacinda_ardern")
    return name  # type: ignore[return-value]


def _under(root: Path, *parts: str) -> Path:
    return Path(root) / ARTIFACTS / Path(*parts)


def data_set(name: str, root: Path = Path(".")) -> Path:
    return _under(root, "data", slug(name, "image set"))


def golden(model: str, root: Path = Path(".")) -> Path:
    return _under(root, "golden", slug(model, "model"))


def export(model: str, root: Path = Path(".")) -> Path:
    return _under(root, "export", slug(model, "model"))


def program(model: str, root: Path = Path(".")) -> Path:
    return _under(root, "program", slug(model, "model"))


def calibration(model: str, root: Path = Path(".")) -> Path:
    return _under(root, "calibration", slug(model, "model"))


def quantized(model: str, recipe: str, root: Path = Path(".")) -> Path:
    return _under(root, "quantized", f"{slug(model, 'model')}-{slug(recipe, 'recipe')}")


def toolchain_dir(root: Path = Path(".")) -> Path:
    return _under(root, "toolchain")


def toolchain_file(target: str, root: Path = Path(".")) -> Path:
    return toolchain_dir(root) / f"{slug(target, 'target')}.yaml"


def engine(name: str, root: Path = Path(".")) -> Path:
    return _under(root, "engines", slug(name, "engine"))


def tuning(name: str, root: Path = Path(".")) -> Path:
    return _under(root, "tuning", slug(name, "engine"))


def validation(name: str, root: Path = Path(".")) -> Path:
    return _under(root, "validation", slug(name, "engine"))


def bench(model: str, root: Path = Path(".")) -> Path:
    return _under(root, "bench", slug(model, "model"))


def system(name: str, root: Path = Path(".")) -> Path:
    """system@<name>: system.json (what the system is) + verdict.json (its end-to-end gate) + manifest."""
    return _under(root, "systems", slug(name, "system"))


def sysbench(name: str, root: Path = Path(".")) -> Path:
    """sysbench@<name>: sysbench.json (the load sweep) + bottleneck.json: one run's timings, never cached."""
    return _under(root, "sysbench", slug(name, "system"))


def receipt(name: str, root: Path = Path(".")) -> Path:
    return _under(root, "registry", slug(name, "registered name"))


def gallery_name(size: int) -> str:
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise KilnError(f"gallery size {size!r} is not a positive integer", "e.g. 10000")
    return f"gallery-{size}"


def gallery(size: int, root: Path = Path(".")) -> Path:
    gallery_name(size)  # validates the size
    return _under(root, "gallery", str(size))


def index(size: int, root: Path = Path(".")) -> Path:
    """The chosen FAISS index of a gallery: index.faiss + manifest."""
    return _under(root, "index", gallery_name(size))


def matching(size: int, root: Path = Path(".")) -> Path:
    """The index choice's verdict (validation.json + manifest); the timed curve is `matching/<name>.curve.json`."""
    return _under(root, "matching", gallery_name(size))


def curve(size: int, root: Path = Path(".")) -> Path:
    return _under(root, "matching", f"{gallery_name(size)}.curve.json")


def reports(root: Path = Path(".")) -> Path:
    return _under(root, "reports")


def precision(key: str, root: Path = Path(".")) -> Path:
    """debug-precision@<model>-<recipe>: layers.json (SNR per layer) + manifest."""
    return reports(root) / "precision" / slug(key, "model-recipe")


def summary(root: Path = Path(".")) -> Path:
    """The build's summary (summary.md + summary.json): the last stage of the default DAG."""
    return reports(root) / "summary"


def records(root: Path = Path(".")) -> Path:
    """Per-run records (commit, host, timings): beside the DVC outputs, never inside one, never cached."""
    return _under(root, "records")
