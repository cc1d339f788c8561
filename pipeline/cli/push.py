"""`kiln push`: push a system release to an OCI registry as an OCI artifact (verified first; credentials from
KILN_OCI_USERNAME / KILN_OCI_PASSWORD or the docker config file, never argv); prints the manifest digest — the same
release pushed twice has the same digest. A channel tag (prod, latest: not a version) is pushed with a channel
statement signed by the publisher's key ($KILN_SIGNING_KEY), which hosts verify before they follow it
(kiln_runtime/channels.py); moving a channel to a lower version is said, and recorded in the statement."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.errors import KilnError

NAME = "push"
HELP = ("push a system release to an OCI registry as an OCI artifact (verified first; credentials from "
        "KILN_OCI_USERNAME / KILN_OCI_PASSWORD or the docker config file, never argv); prints the manifest "
        "digest — the same release pushed twice has the same digest; a channel tag (prod) carries a signed "
        "channel statement hosts check before they follow it")
DEFAULT_EXPIRES_DAYS = 30


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("archive", help="the system release archive (kiln release --system)")
    p.add_argument("ref", metavar="REF", help="HOST[:PORT]/PATH/NAME:TAG — NAME the system's name (lower case), TAG "
                   "its version or a channel (prod, latest)")
    p.add_argument("--key", help="the publisher's public key to verify the archive with (default: "
                   "$KILN_SIGNING_KEY.pub)")
    p.add_argument("--signing-key", help="a channel tag: the private key that signs its statement (default: "
                   "$KILN_SIGNING_KEY); the pair of --key")
    p.add_argument("--expires", type=float, default=DEFAULT_EXPIRES_DAYS, metavar="DAYS",
                   help=f"a channel tag: days until hosts refuse its statement unless it is pushed again "
                   f"({DEFAULT_EXPIRES_DAYS}; a host never follows a channel frozen longer)")
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
    channel = not oci.VERSION_TAG.fullmatch(ref.tag or "")
    if channel and not 0 < args.expires <= 3650:
        raise KilnError(f"--expires {args.expires:g}: a channel statement expires after 0-3650 days",
                        f"e.g. --expires {DEFAULT_EXPIRES_DAYS}")
    key = Path(args.key) if args.key else Path(f"{signing.key_path(None)}.pub")
    private = signing.key_path(args.signing_key) if channel else None         # before the registry is asked
    archive = Path(args.archive)
    with system_release.verified(archive, key, runtime=False) as (tree, checked):         # publishes, runs nothing
        if not runtime_release.is_system_release(tree):
            raise GateFailed(f"{archive}: an engine release, not a system release", "push what `kiln release "
                             "--system NAME` wrote: the deployable unit kiln-run pulls")
        doc = json.loads((tree / "release.json").read_bytes())
    print(f"verified: {doc['registered_model']} v{doc['version']} ({len(checked)} checks, signature by {key.name})")
    if channel:
        return _push_channel(args, ref, archive, doc, key, private)
    pushed = oci.push(archive, ref, doc, args.plain_http)
    size = pushed.layer["size"] / 1e6
    print(f"pushed {archive.name} ({size:.1f} MB{'' if pushed.uploaded else ', the registry had it already'}) → "
          f"{ref}\nmanifest {pushed.digest}\npull it: kiln-run pull {ref.host}/{ref.path}@{pushed.digest} --key "
          f"{key.name} --out DIR")
    return 0


def _push_channel(args, ref, archive: Path, doc: dict, key: Path, private: Path) -> int:
    """A channel tag: the statement signed with the publisher's key — issued after the one the channel carries now,
    naming it as `previous` — and the channel manifest pushed in one PUT."""
    import datetime as dt

    from kiln_runtime import channels, oci, signature

    from pipeline.release import signing
    from pipeline.tables import shown

    if signing.public_pem(signing.load_private_key(private)) != signature.load_public_key(key).public_bytes(
            *_pem_format()):
        raise KilnError(f"{private} is not the private half of {key}", "hosts verify the channel with the key the "
                        "release verifies with: pass the pair (--signing-key, --key)")
    previous, unreadable = oci.current_channel(ref, key, args.plain_http)
    if unreadable:
        print(f"kiln: WARNING: {ref}: the channel's current statement could not be read ({shown(unreadable, 300)}); "
              "replacing it", file=sys.stderr)
    issued = channels.now()
    if previous is not None and issued <= channels.parse_time(previous.issued, "issued"):
        raise KilnError(f"{ref}: the channel's statement was issued at {previous.issued}, after this host's clock "
                        f"({channels.stamp(issued)})", "fix this host's clock (NTP): hosts refuse a statement older "
                        "than the one they follow")
    _, release_digest, layer = oci.release_manifest(archive, doc)
    st = channels.Statement(ref.path, str(ref.tag), str(doc["system"]), int(doc["version"]), archive.name,
                            layer["digest"], release_digest, channels.stamp(issued),
                            channels.stamp(issued + dt.timedelta(days=args.expires)),
                            None if previous is None else {"version": previous.version, "issued": previous.issued})
    if previous is not None and st.version < previous.version:
        print(f"kiln push: channel {ref.tag} moves to a LOWER version: {shown(st.system, 64)} v{previous.version} → "
              f"v{st.version} — a signed rollback (hosts follow it and record it; the statement names v"
              f"{previous.version} as the one it replaces)")
    got = oci.push_channel(archive, ref, doc, lambda s: signing.sign_statement(channels.payload(s), private), st,
                           args.plain_http)
    size = got.pushed.layer["size"] / 1e6
    moved = "new channel" if previous is None else f"was v{previous.version}, issued {previous.issued}"
    print(f"pushed {archive.name} ({size:.1f} MB{'' if got.pushed.uploaded else ', the registry had it already'}) "
          f"→ {ref}: channel {ref.tag} → {st.system} v{st.version} ({moved})\nstatement issued {st.issued}, expires "
          f"{st.expires} (push it again before then: hosts refuse an expired channel)\nmanifest {got.pushed.digest}"
          f" (the channel); the release itself: {ref.host}/{ref.path}@{got.release_digest}")
    return 0


def _pem_format():
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
