"""register-index@<size>: the chosen FAISS index of a gallery, registered as what it is (kind "index") in MLflow as
`kiln-gallery-<size>`, with the same rules as engines (pipeline/stages/register.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, stage
from pipeline.registry import registration as reg
from pipeline.registry.receipts import print_receipt, write_receipt

if TYPE_CHECKING:
    from pipeline.config import Config

STAGE = stage.Stage(
    "register-index", "pipeline.stages.register_index",
    "log + register a gallery's chosen FAISS index in MLflow as kiln-gallery-<size> (idempotent by content)",
    keys=lambda cfg: [str(s) for s in cfg.matching.gallery_sizes],
    deps=lambda cfg, key: [paths.index(int(key)).as_posix(), paths.matching(int(key)).as_posix()],
    params=lambda cfg, key: ["register.experiment"],
    outs=lambda cfg, key: [stage.Out(paths.receipt(paths.gallery_name(int(key))).as_posix(), cache=False)],
    help="register a gallery's chosen index in MLflow as kiln-gallery-<size>")


def run(cfg: Config, size: int, root: Path = Path(".")) -> reg.Receipt:
    art = reg.index_registrable(cfg, size, root)
    receipt = reg.register(cfg, art, root)
    write_receipt(cfg, STAGE, str(size), art, receipt, root)
    return receipt


def main(argv: list[str] | None = None) -> int:
    def body(args, run_) -> int:
        print_receipt(f"register-index@{args.key}", run(args.cfg, int(args.key)), run_)
        return 0

    return stage.main(STAGE, body, argv, key_help="gallery size from matching.gallery_sizes")


if __name__ == "__main__":
    sys.exit(main())
