"""`kiln-run gallery …`: the live gallery's operations from a shell — the same store, the same checks and the same
log as the service's (kiln_runtime/gallery_api.py), for an operator at the site or a script.

    kiln-run gallery init     STORE --release ARCHIVE --key K.pub [--empty]   a new store bound to the release's
                                                                            embedder (its build gallery first)
    kiln-run gallery enrol    STORE --release ARCHIVE --key K.pub SUBJECT PHOTO…
    kiln-run gallery list     STORE [SUBJECT]
    kiln-run gallery delete   STORE SUBJECT FACE --reason R
    kiln-run gallery erase    STORE SUBJECT --reason R [--receipt FILE]     prints the erasure receipt (JSON)
    kiln-run gallery verify   STORE --release ARCHIVE --key K.pub SUBJECT PHOTO
    kiln-run gallery audit    STORE                                         the chain verified, the gallery replayed
    kiln-run gallery snapshot STORE --signing-key K.pem --out DIR           a signed, content-addressed snapshot
    kiln-run gallery restore  STORE SNAPSHOT --key K.pub --reason R [--allow-erased]

The actor recorded is --actor, else $KILN_ACTOR, else the login name. Every command that runs the system verifies
the release first, as `kiln-run identify` does; every printed value from the store is escaped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kiln_runtime.errors import GateFailed, KilnError
from kiln_runtime.text import shown


def _actor(args) -> str:
    from kiln_runtime import gallery as g

    import getpass

    try:
        default = os.environ.get("KILN_ACTOR") or getpass.getuser()
    except (KeyError, OSError):
        default = "operator"
    return g.check_text(args.actor, "actor", default)


@contextmanager
def _system(args) -> Iterator:
    """(the verified release's tree, its loaded system) — for commands that embed photos."""
    from kiln_runtime import oci, release

    with oci.local(args.release, Path(args.key), args.plain_http,
                   progress=lambda m: print(m, file=sys.stderr, flush=True)) as archive, \
            release.verified(archive, Path(args.key), allow_drift=args.allow_runtime_drift) as (tree, _):
        yield tree, release.load(tree).system


def _faces(system, photo: str):
    """The one face of a photo file, fit to enrol (kiln_runtime/enrolment.py): (match, crop PNG, landmarks, sha256)."""
    from kiln_runtime.enrolment import crop, policy, the_face
    from kiln_runtime.images import load_rgb

    rgb = load_rgb(Path(photo))
    m = the_face(system.identify(rgb), policy(system.spec), shown(photo, 300), rgb.shape[:2])
    png, marks = crop(rgb, m.box, m.landmarks)
    return m, png, marks, hashlib.sha256(Path(photo).read_bytes()).hexdigest()


def cmd_init(args) -> int:
    import numpy as np

    from kiln_runtime import gallery as g
    from kiln_runtime import oci, release

    actor = _actor(args)
    with oci.local(args.release, Path(args.key), args.plain_http) as archive, \
            release.verified(archive, Path(args.key), runtime=False) as (tree, _):      # binds, runs no engine
        lay = release.layout(tree)
        seed = None
        if not args.empty:
            seed = (np.load(tree / release.GALLERY_DIR / release.EMBEDDINGS, allow_pickle=False),
                    json.loads((tree / release.GALLERY_DIR / release.LABELS).read_bytes()))
        store = g.create(Path(args.store), g.binding_of(tree), actor, f"a new gallery for {lay.name} v{lay.version}",
                         seed, f"{lay.name} v{lay.version}'s build gallery")
    with store:
        b = store.binding
        subjects, faces = store.counts()
        people = f"{faces} face(s) of {subjects} subject(s) from the release" if seed else "empty"
        print(f"gallery {shown(args.store, 300)}: bound to {b.embedder} {b.embedder_xxh3_128} ({b.dim}-d, "
              f"{b.chip_size} px chips, {b.metric} {'≥' if b.metric == 'cosine' else '<'} {b.threshold:g}); {people}")
    return 0


def cmd_enrol(args) -> int:
    from kiln_runtime import gallery as g

    actor = _actor(args)
    reason = g.check_text(args.reason, "reason", "enrolled with kiln-run gallery enrol")
    g.check_subject(args.subject)
    with _system(args) as (tree, system), g.Store(Path(args.store)) as store:
        store.bound_to(g.binding_of(tree), args.release)
        for photo in args.photos:
            m, png, marks, sha = _faces(system, photo)
            face, version, new = store.enrol(args.subject, m.embedding, png, marks, m.box, m.score, sha, actor,
                                             reason)
            print(f"{shown(photo, 300)}: {'enrolled' if new else 'already enrolled:'} {args.subject} face {face.id} "
                  f"(box {', '.join(f'{v:.0f}' for v in m.box)}, score {m.score:.3f}) → version {version}")
    return 0


def cmd_list(args) -> int:
    from kiln_runtime import gallery as g

    with g.Store(Path(args.store), readonly=True) as store:
        if args.subject:
            faces = store.faces(g.check_subject(args.subject))
            if not faces:
                raise KilnError(f"no subject {args.subject} in the gallery", "kiln-run gallery list STORE")
            for f in faces:
                print(f"{f.id}  {f.digest[:16]}  box {f.box}  score {f.score:.3f}  enrolled {f.created} "
                      f"(event #{f.event})")
            return 0
        subjects, faces = store.counts()
        print(f"gallery {shown(args.store, 300)}: version {store.version()}, {subjects} subject(s), {faces} face(s), "
              f"bound to {store.binding.embedder} {store.binding.embedder_xxh3_128[:12]}")
        after = ""
        while page := store.subjects(1000, after):
            for name, n in page:
                print(f"  {shown(name, 64)}  {n} face(s)")                     # a store's value: escaped
            after = page[-1][0]
    return 0


def cmd_delete(args) -> int:
    from kiln_runtime import gallery as g

    with g.Store(Path(args.store)) as store:
        version = store.delete_face(args.face, _actor(args), g.check_text(args.reason, "reason", ""),
                                    g.check_subject(args.subject))
    print(f"deleted face {shown(args.face, 40)} of {args.subject} → version {version}")
    return 0


def cmd_erase(args) -> int:
    from kiln_runtime import gallery as g

    if args.receipt:
        _writable(Path(args.receipt))
    with g.Store(Path(args.store)) as store:
        receipt = store.erase(g.check_subject(args.subject), _actor(args), g.check_text(args.reason, "reason", ""))
    text = json.dumps(receipt, indent=1, sort_keys=True)
    print(text, flush=True)                     # first: the erasure is done, its receipt must not be lost
    if args.receipt:
        tmp = Path(args.receipt).with_name(f".{Path(args.receipt).name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text + "\n", encoding="utf-8")
            os.replace(tmp, args.receipt)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise KilnError(f"the erasure is done (its receipt is above), but {shown(args.receipt, 300)} could not be "
                            f"written ({e.strerror})", "keep the receipt printed above") from None
    return 0


def cmd_verify(args) -> int:
    from kiln_runtime import gallery as g

    with _system(args) as (tree, system), g.Store(Path(args.store), readonly=True) as store:
        store.bound_to(g.binding_of(tree), args.release)
        ids, _, vectors = store.vectors(g.check_subject(args.subject))
        if not ids:
            raise KilnError(f"no subject {args.subject} in the gallery", "enrol them first")
        m, *_ = _faces(system, args.photo)
        best, value = g.closest(store.binding, m.embedding, vectors)
    b = store.binding
    same = value >= b.threshold if b.metric == "cosine" else value < b.threshold
    rule = f"cosine ≥ {b.threshold:g}" if b.metric == "cosine" else f"L2 < {b.threshold:g}"
    print(f"{shown(args.photo, 300)}: {'the same person as' if same else 'NOT'} {args.subject} ({b.metric} "
          f"{value:.3f} to face {ids[best]}, the nearest of {len(ids)}; same person when {rule})")
    return 0 if same else 1


def cmd_audit(args) -> int:
    from kiln_runtime import gallery as g

    from kiln_runtime.gallery_audit import audit

    with g.Store(Path(args.store), readonly=True) as store:
        report = audit(store, args.expect)
    for p in report.problems:
        print(f"FAIL  {p}")
    print(f"audit: {report.events} event(s), chain {'verified' if not report.problems else 'BROKEN'} to head "
          f"{report.head[:16]}…; {report.faces} face(s) of {report.subjects} subject(s) "
          + ("exactly as the log leaves them" if not report.problems else f"— {len(report.problems)} problem(s)"))
    if report.problems:
        raise GateFailed(f"{shown(args.store, 300)}: {len(report.problems)} problem(s) in the gallery (listed above)",
                         "restore a signed snapshot (kiln-run gallery restore), and find who changed the store")
    return 0


def cmd_snapshot(args) -> int:
    from kiln_runtime import gallery as g
    from kiln_runtime import snapshots

    with g.Store(Path(args.store)) as store:
        path, sha, version = snapshots.take(store, Path(args.out), Path(args.signing_key))
    print(f"snapshot of version {version} → {path}  sha256 {sha}")
    return 0


def cmd_restore(args) -> int:
    from kiln_runtime import gallery as g
    from kiln_runtime import snapshots

    with g.Store(Path(args.store)) as store:
        done = snapshots.restore(store, Path(args.snapshot), Path(args.key), _actor(args),
                                 g.check_text(args.reason, "reason", ""), args.allow_erased)
    print(f"restored {done['snapshot']} (its version {done['snapshot_version']}): {done['added']} face(s) back, "
          f"{done['removed']} removed → version {done['version']}"
          + (f"; brought back erased {', '.join(done['erased_brought_back'])}" if done["erased_brought_back"] else ""))
    return 0


def _writable(path: Path) -> None:
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise KilnError(f"{shown(path, 300)}: its folder does not exist or is not writable", "pass a writable path")


def add_parser(sub) -> None:
    """`kiln-run gallery COMMAND …` under the CLI's subparsers."""
    top = sub.add_parser("gallery", help="the live gallery store: init, enrol, list, delete, erase, verify, audit, "
                         "snapshot, restore")
    cmds = top.add_subparsers(dest="gallery_command", required=True, metavar="COMMAND")

    def store(p: argparse.ArgumentParser) -> None:
        p.add_argument("store", metavar="STORE", help="the gallery store (one SQLite file)")
        p.add_argument("--actor", help="who, for the log (default $KILN_ACTOR or the login name)")

    def with_release(p: argparse.ArgumentParser) -> None:
        p.add_argument("--release", required=True, metavar="ARCHIVE", help="the system release (or an OCI "
                       "reference) whose embedder the store is bound to")
        p.add_argument("--key", required=True, help="the publisher's public key (KEY.pub)")
        p.add_argument("--plain-http", action="store_true", help="a registry reference over plain HTTP")
        p.add_argument("--allow-runtime-drift", action="store_true", help="run its engines on a runtime outside the "
                       "release's requirement, after their golden check passes here")

    p = cmds.add_parser("init", help="a new store bound to the release's embedder, with the release's own people")
    store(p)
    with_release(p)
    p.add_argument("--empty", action="store_true", help="start with nobody (not the release's build gallery)")
    p.set_defaults(func=cmd_init)
    p = cmds.add_parser("enrol", help="enrol a subject's face from each photo (exactly one face each)")
    store(p)
    with_release(p)
    p.add_argument("subject", help="the subject id: 1-64 letters, digits, '-' or '_'")
    p.add_argument("photos", nargs="+", metavar="PHOTO")
    p.add_argument("--reason", help="why, for the log")
    p.set_defaults(func=cmd_enrol)
    p = cmds.add_parser("list", help="subjects and face counts, or one subject's faces")
    store(p)
    p.add_argument("subject", nargs="?")
    p.set_defaults(func=cmd_list)
    p = cmds.add_parser("delete", help="delete one face of a subject")
    store(p)
    p.add_argument("subject")
    p.add_argument("face")
    p.add_argument("--reason", required=True, help="why, for the log")
    p.set_defaults(func=cmd_delete)
    p = cmds.add_parser("erase", help="erase a subject: every face and all stored for it; prints the receipt")
    store(p)
    p.add_argument("subject")
    p.add_argument("--reason", required=True, help="why (the request's reference), for the log and the receipt")
    p.add_argument("--receipt", metavar="FILE", help="also write the receipt (JSON) here")
    p.set_defaults(func=cmd_erase)
    p = cmds.add_parser("verify", help="1:1: is the person in PHOTO the subject? (exit 1 when not)")
    store(p)
    with_release(p)
    p.add_argument("subject")
    p.add_argument("photo", metavar="PHOTO")
    p.set_defaults(func=cmd_verify)
    p = cmds.add_parser("audit", help="verify the hash chain and replay it against the stored faces (exit 1 on any "
                        "difference)")
    store(p)
    p.add_argument("--expect", action="append", metavar="EVENT_HASH", help="an event hash kept outside the store (a "
                   "receipt's event, a snapshot's head) that must be in its log: shows it was not cut short or "
                   "rewritten (repeatable)")
    p.set_defaults(func=cmd_audit)
    p = cmds.add_parser("snapshot", help="write a signed, content-addressed snapshot of the store")
    store(p)
    p.add_argument("--signing-key", required=True, help="the private key that signs it (kiln keygen's)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=cmd_snapshot)
    p = cmds.add_parser("restore", help="bring the store to a verified snapshot (appended to the log)")
    store(p)
    p.add_argument("snapshot", metavar="SNAPSHOT")
    p.add_argument("--key", required=True, help="the public key the snapshot was signed for")
    p.add_argument("--reason", required=True, help="why, for the log")
    p.add_argument("--allow-erased", action="store_true", help="restore even subjects erased since the snapshot "
                   "(recorded in the log)")
    p.set_defaults(func=cmd_restore)


__all__ = ["add_parser"]
