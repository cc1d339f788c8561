"""`kiln release`: one signed, deterministic archive of a registered version: engine files, manifests, provenance
chain, verdict, bench, lockfile digests, SLSA provenance, model-signing signature"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.cli.common import is_system, load_cfg
from pipeline.errors import KilnError

NAME = "release"
HELP = ("one signed, deterministic archive of a registered version: engine files, manifests, provenance chain, "
        "verdict, bench, lockfile digests, SLSA provenance, model-signing signature")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="registered model (kiln-<engine>) or engine name; with --system a face "
                   "system's name (or kiln-system-NAME)")
    p.add_argument("version", nargs="?", help="version number or alias (e.g. production; a system's default)")
    p.add_argument("--system", action="store_true", help="NAME is a face system: one archive with every engine of "
                   "that system version, its config slice and its gallery (enrolled by its own embedder)")
    p.add_argument("--all-production", action="store_true", help="release every model's production version")
    p.add_argument("--key", help="private signing key (default: $KILN_SIGNING_KEY)")
    p.add_argument("--out", help="directory for the archives (default: releases/)")


def run(args) -> int:
    from pipeline.release import engine as release

    key = Path(args.key) if args.key else None
    out = Path(args.out) if args.out else None
    def show(r) -> None:
        print(f"{r.name} v{r.version} → {r.archive}  sha256 {r.sha256}"
              + ("" if r.new else "  (identical to the recorded release)"), flush=True)

    if args.name and is_system(args):     # a face system: every engine, its config slice and its gallery
        from pipeline.release import system as system_release

        show(system_release.build(load_cfg(args), args.name, args.version or "production", Path("."), key, out))
    elif args.system:
        raise KilnError("--system needs the system's name", "e.g. kiln release --system dlib-mtcnn [VERSION]")
    elif args.all_production:     # each archive is printed as it is written: a later failure does not hide it
        from pipeline.release import system as system_release

        release.release_all_production(load_cfg(args), Path("."), key, out, on_release=show,
                                       build_system=system_release.build)
    elif args.name and args.version:
        show(release.build(load_cfg(args), args.name, args.version, Path("."), key, out))
    else:
        raise KilnError("name and version (or alias) required", "e.g. kiln release kiln-embedder-ort-cpu-int8 "
                        "production, or kiln release --all-production")
    return 0
