"""`kiln identify`: detect, align, embed and match faces in photos using only built, verified engines (exit 1 if a
photo has no face)"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.cli.common import load_cfg
from pipeline.errors import KilnError

if TYPE_CHECKING:
    import numpy as np

    from kiln_runtime.system import System as DeployedSystem
    from pipeline.config import Config
    from pipeline.e2e import System

NAME = "identify"
HELP = ("detect, align, embed and match faces in photos using only built, verified engines (exit 1 if a photo "
        "has no face)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("images", nargs="+", help="image files (JPEG, PNG, ...)")
    p.add_argument("--target", help="engine target (default: the system's own engines, as system@ gates them; "
                   "else ort-cpu); `fastest`: per graph the leaderboard's fastest engine that passed its gate; "
                   "`pytorch`: the eager reference")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16", "int8"],
                   help="preferred precision per graph (default int8 with --target); graphs without such an engine "
                        "use their FP32 engine")
    p.add_argument("--release", nargs="?", const=True, default=None, metavar="ARCHIVE",
                   help="alone (after the photos): run the face system's production version from the registry — "
                        "the parts it pins, downloaded and verified — instead of the local build; with ARCHIVE: run "
                        "the face system of a system release (kiln release --system) from the verified archive "
                        "alone — no checkout, no registry")
    p.add_argument("--key", help="with --release ARCHIVE: the publisher's public key (.pub) to verify it with")
    p.add_argument("--gallery", type=int, metavar="SIZE",
                   help="match through the chosen FAISS index of this gallery size (default: brute force over the "
                        "golden enrolment chips)")
    p.add_argument("--system",
                   help="the face system (params.yaml `systems:`: a detector and an embedder; default dlib-mtcnn), "
                        "e.g. sface-retinaface after `kiln profile sface-retinaface`")


def run(args) -> int:
    import tempfile

    from pipeline.data import load_rgb
    from pipeline.e2e import DEFAULT_SYSTEM, System, resolve

    rgbs = [(p, load_rgb(Path(p))) for p in args.images]  # a corrupt, oversized or non-image file stops here
    if isinstance(args.release, str):
        return _identify_release(args, rgbs)
    if args.key:
        raise KilnError("--key verifies a system release archive: it needs --release ARCHIVE",
                        "pass --release ARCHIVE --key KEY.pub, or drop --key")
    cfg = load_cfg(args)
    name = args.system or DEFAULT_SYSTEM
    cfg.system(name)                    # an unknown system: one clear error, before anything loads
    if args.release:
        with tempfile.TemporaryDirectory(prefix="kiln-release-") as tmp:
            return _identify_production(args, cfg, name, Path(tmp), rgbs)
    if args.target == "pytorch":             # the reference system: PyTorch modules, or an ONNX model's own file
        system = System.eager(cfg, system=name)
    elif args.target == "fastest":
        system = System.fastest(cfg, system=name)
    elif args.target is None:           # the system as system@ gates it (its pins first), or in another precision
        system = System.from_picks(cfg, name, resolve(cfg, name, None, args.precision), system=name)
    else:
        system = System.from_engines(cfg, args.target or "ort-cpu", args.precision or "int8", system=name)
    system.enroll()
    if args.gallery:
        system.use_index(args.gallery)
    return _print_identities(system, rgbs)


def _identify_production(args, cfg: Config, name: str, scratch: Path, rgbs) -> int:
    """`kiln identify --release` (no archive): the face system's production version — its pinned parts, downloaded
    from the registry and verified — the one truth of what production runs (never each engine's own alias)."""
    from pipeline.e2e import System
    from pipeline.registry import systems

    given = [f for f, v in (("--target", args.target), ("--precision", args.precision)) if v is not None]
    if given:
        raise KilnError(f"{given[0]} does not apply to --release: production runs the engines its production system "
                        "version pins", f"drop {given[0]}, or run the local build without --release")
    version, v, dirs = systems.fetch_production(cfg, name, scratch)
    system = System.from_dirs(cfg, name, dirs, {p.model: p.engine for p in v.parts}, name,
                              labels={p.model: f"{p.registered_model}:v{p.version}" for p in v.parts})
    print(f"production: {systems.registered(name)} v{version} (its pins, downloaded and verified)")
    system.enroll()
    if args.gallery:
        system.use_index(args.gallery)
    return _print_identities(system, rgbs)


def _identify_release(args, rgbs) -> int:
    """`kiln identify --release ARCHIVE`: verify a system release offline, extract it privately, run it from its own
    files (engines, config slice, gallery): no checkout, no params.yaml, no DVC, no registry."""
    from pipeline.release import system as system_release
    from pipeline.tables import shown

    given = [f for f, v in (("--target", args.target), ("--precision", args.precision), ("--gallery", args.gallery))
             if v is not None]
    if given:
        raise KilnError(f"{given[0]} does not apply to a system release: its engines and gallery are in the archive",
                        "drop it, or run from the checkout without --release ARCHIVE")
    if not args.key:
        raise KilnError("--release ARCHIVE needs the publisher's public key to verify it", "pass --key KEY.pub")
    with system_release.verified(Path(args.release), Path(args.key)) as (tree, checked):
        if not system_release.is_system_release(tree):
            raise KilnError(f"{args.release}: an engine release, not a face system's",
                            "pass an archive made by `kiln release --system NAME`")
        d = system_release.deployed(tree, checked)
        if args.system and d.system_name != args.system:
            raise KilnError(f"{args.release}: a release of system {d.system_name}, not {args.system}",
                            f"drop --system, or pass --system {d.system_name}")
        print(f"release: {shown(args.release, 1000)} verified offline ({d.name} v{d.version}: {len(checked)} "
              f"checks, signature by {shown(Path(args.key).name, 200)})")
        return _print_identities(d.system, rgbs)


def _print_identities(system: System | DeployedSystem, rgbs: list[tuple[str, np.ndarray]]) -> int:
    """kiln_runtime.cli's: `kiln identify` prints what `kiln-run identify` prints on a deployment host."""
    from kiln_runtime.cli import print_identities

    return print_identities(system, rgbs)
