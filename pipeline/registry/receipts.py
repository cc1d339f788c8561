"""The receipt of a registration: what register@<engine> and register-index@<size> write and print.

artifacts/registry/<name>/receipt.json + manifest names the registered content only (registered model, content and
manifest digests, verdict), the same in every clone; the version number and the tracking URI are one registry's
facts and go to the stage's record (`print_receipt`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.manifest import atomic_dir, build_manifest, input_ref, write_json_atomic, write_manifest

if TYPE_CHECKING:
    from pipeline.config import Config

if TYPE_CHECKING:
    from pipeline import stage
    from pipeline.registry import registration as reg

RECEIPT_FILE = "receipt.json"
REPAIRED = "; its interrupted registration was completed (alias and history)"


def write_receipt(cfg: Config, spec: stage.Stage, key: str, art: reg.Registrable, receipt: reg.Receipt,
                  root: Path) -> Path:
    out = paths.receipt(art.name, root)
    with atomic_dir(out) as d:
        write_json_atomic(d / RECEIPT_FILE, {"kind": art.kind, **receipt.content()})
        write_manifest(d, build_manifest(
            kind="registration", name=art.name, directory=d, files=[d / RECEIPT_FILE],
            inputs=[input_ref(art.kind, art.manifest_file, root), input_ref("validation", art.verdict_manifest, root)],
            build={"registry": "mlflow"}, results={"verdict": receipt.verdict}, **spec.identity(cfg, key, root)))
    return out


def print_receipt(label: str, r: reg.Receipt, run_: stage.Run) -> None:
    run_.record.update(registered_model=r.name, version=r.version, tracking_uri=r.tracking_uri, new=r.new)
    state = "registered new version" if r.new else "already registered as version"
    alias = {"pass": ", alias candidate", "not-run": ", alias built: promotable once a host with the runtime "
             f"passes it (kiln validate-release {r.name} {r.version})"}.get(r.verdict, "") if r.new else ""
    alias += REPAIRED if r.repaired else ""
    print(f"{label}: {state} {r.name} v{r.version} (sha256 {r.sha256[:12]}…, validation {r.verdict}{alias}) "
          f"in {r.tracking_uri}")
