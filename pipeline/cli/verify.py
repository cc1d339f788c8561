"""`kiln verify`: recompute checksums of artifacts against their manifests (exit 1 on mismatch)"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.errors import KilnError

NAME = "verify"
HELP = ("recompute checksums of artifacts against their manifests (exit 1 on mismatch)")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a manifest file or a directory searched for *.manifest.json")
    p.add_argument("--root", help="project root, to check input manifests (default: the one holding the "
                   "artifacts/ folder they are in, else .)")


def run(args) -> int:
    from pipeline.manifest import find_manifests, project_root, verify_manifest

    manifests = find_manifests(Path(args.path))
    if not manifests:
        raise KilnError(f"{args.path}: no *.manifest.json found", "pass an artifact directory or a manifest file")
    bad, roots = 0, set()
    for m in manifests:
        # inputs are recorded relative to the project root: the artifacts' own, whatever the working directory
        root = Path(args.root) if args.root else project_root(m) or Path(".")
        roots.add(root.resolve())
        try:
            problems = verify_manifest(m, root=root)
        except KilnError as e:
            problems = [e.message]
        print(f"{'ok ' if not problems else 'BAD'} {m}")
        for p in problems:
            print(f"    {p}")
        bad += bool(problems)
    if elsewhere := sorted(str(r) for r in roots if r != Path.cwd().resolve()):
        print(f"verify: inputs checked against the project root {', '.join(elsewhere)}")
    print(f"verify: {len(manifests) - bad} ok, {bad} mismatched")
    return 1 if bad else 0
