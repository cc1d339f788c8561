"""`kiln push`: push a system release to an OCI registry as an OCI artifact (verified first; credentials from
KILN_OCI_USERNAME / KILN_OCI_PASSWORD or the docker config file, never argv); prints the manifest digest — the same
release pushed twice has the same digest"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pipeline.errors import KilnError

NAME = "push"
HELP = ("push a system release to an OCI registry as an OCI artifact (verified first; credentials from "
        "KILN_OCI_USERNAME / KILN_OCI_PASSWORD or the docker config file, never argv); prints the manifest "
        "digest — the same release pushed twice has the same digest")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("archive", help="the system release archive (kiln release --system)")
    p.add_argument("ref", metavar="REF", help="HOST[:PORT]/PATH/NAME:TAG — NAME the system's name (lower case), TAG "
                   "its version or a channel (prod, latest)")
    p.add_argument("--key", help="the publisher's public key to verify the archive with (default: "
                   "$KILN_SIGNING_KEY.pub)")
    p.add_argument("--plain-http", action="store_true", help="a registry without TLS (never for a shared one)")


def run(args) -> int:
    """A system release to an OCI registry, verified first (as `kiln verify-release`); annotations from its signed
    release.json (kiln_runtime/oci.py: the artifact's layout and why one layer)."""
    import json

    from kiln_runtime import oci, release as runtime_release

    from pipeline.release import signing
    from pipeline.release import system as system_release
    from pipeline.errors import GateFailed

    ref = oci.parse_ref(args.ref, need_tag=True)
    if not args.key and not os.environ.get(signing.KEY_ENV):
        raise KilnError("kiln push verifies the archive first: it needs the publisher's public key",
                        f"pass --key KEY.pub (or set {signing.KEY_ENV}: its .pub beside it is used)")
    key = Path(args.key) if args.key else Path(f"{signing.key_path(None)}.pub")
    archive = Path(args.archive)
    with system_release.verified(archive, key) as (tree, checked):
        if not runtime_release.is_system_release(tree):
            raise GateFailed(f"{archive}: an engine release, not a system release", "push what `kiln release "
                             "--system NAME` wrote: the deployable unit kiln-run pulls")
        doc = json.loads((tree / "release.json").read_bytes())
    print(f"verified: {doc['registered_model']} v{doc['version']} ({len(checked)} checks, signature by {key.name})")
    pushed = oci.push(archive, ref, doc, args.plain_http)
    size = pushed.layer["size"] / 1e6
    print(f"pushed {archive.name} ({size:.1f} MB{'' if pushed.uploaded else ', the registry had it already'}) → "
          f"{ref}\nmanifest {pushed.digest}\npull it: kiln-run pull {ref.host}/{ref.path}@{pushed.digest} --key "
          f"{key.name} --out DIR")
    return 0
