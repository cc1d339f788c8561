"""Channel tags a host can trust: what `…/NAME:prod` points at is a statement the publisher signs, and a host never
goes back to an older statement than one it already accepted.

A version tag (`:3`) is bound by the release itself (the signed release is that version). A channel tag (`:prod`,
`:latest`) names whatever the registry says — so a registry, a proxy or anyone with push rights could re-point it at
an older, validly signed release (TUF's *rollback* attack) or keep serving a stale one forever (its *freeze* attack).
So a channel is pushed (`kiln push ARCHIVE REF:CHANNEL`, with the signing key) as its own OCI manifest whose first
layer is a signed **channel statement** and whose second is the release archive:

    {"_type": "https://in-toto.io/Statement/v1", "predicateType": PREDICATE_TYPE,
     "subject": [{"name": "kiln-system-NAME-vV.tar.gz", "digest": {"sha256": the archive's sha256}}],
     "predicate": {"repository": "kiln/NAME", "channel": "prod", "system": NAME, "version": V,
                   "release_manifest": "sha256:…" (the version's own manifest), "issued": T, "expires": E,
                   "previous": {"version": V0, "issued": T0} | null}}

signed in the release signing format (a sigstore bundle with a DSSE envelope, ECDSA P-256: kiln_runtime/signature.py).
A pull by channel (`kiln-run pull`, `serve`, `identify` given the reference) verifies the statement with the
publisher's key, binds it to the reference (repository and channel) and to the release it carries (the archive's
digest, then the signed release's system and version), refuses it past `expires` (a freeze), and refuses it when it
was issued before the newest statement this host already accepted for that channel (a rollback) — the **floor**,
kept per repository and channel in `STATE/channels.json` (STATE: $KILN_RUN_STATE, else $XDG_STATE_HOME/kiln-run, else
~/.local/state/kiln-run), every acceptance appended to `STATE/channels.log`. A real rollback is a newer statement that
points at an older version: it is accepted, and recorded as one. A pull by digest pins one manifest: its statement's
signature and binding are checked, its freshness is the caller's choice (no floor is read or moved).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from kiln_runtime.errors import GateFailed, KilnError
from kiln_runtime.text import shown

PREDICATE_TYPE = "https://kiln.dev/channel-statement/v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
STATEMENT_MEDIA_TYPE = "application/vnd.kiln.channel-statement.v1+json"     # the statement's blob: a bundle
ARTIFACT_TYPE = "application/vnd.kiln.channel.v1"                          # a channel's manifest
MAX_STATEMENT = 64 << 10
CLOCK_SKEW_S = 300                # a statement issued further in the future than this: a clock is wrong
STATE_ENV = "KILN_RUN_STATE"
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z")
_SHA = re.compile(r"sha256:[0-9a-f]{64}")
HINT = "pull by the digest `kiln push` printed, or ask the publisher to sign the channel again (kiln push ARCHIVE " \
       "REF:CHANNEL)"


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def stamp(t: dt.datetime) -> str:
    """RFC 3339 UTC with microseconds: statements issued within one second still order."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: Any, where: str) -> dt.datetime:
    if not isinstance(text, str) or not _TIME.fullmatch(text):
        raise ValueError(f"{where}: not an RFC 3339 UTC time (YYYY-MM-DDTHH:MM:SS[.ffffff]Z)")
    return dt.datetime.strptime(text if "." in text else text[:-1] + ".0Z", "%Y-%m-%dT%H:%M:%S.%fZ") \
        .replace(tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class Statement:
    repository: str           # PATH/NAME in the registry
    channel: str
    system: str
    version: int
    archive_name: str
    archive: str              # sha256:… of the release archive (the manifest's release layer)
    release_manifest: str     # sha256:… of the version's own canonical manifest
    issued: str
    expires: str
    previous: dict | None     # {"version", "issued"} of the statement it replaced, as the publisher read it
    digest: str = ""          # sha256:… of the signed bundle: this statement's identity

    @property
    def key(self) -> str:
        return f"{self.repository}:{self.channel}"


def payload(st: Statement) -> bytes:
    """The in-toto statement the publisher signs (canonical JSON)."""
    doc = {"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE,
           "subject": [{"name": st.archive_name, "digest": {"sha256": st.archive.removeprefix("sha256:")}}],
           "predicate": {"repository": st.repository, "channel": st.channel, "system": st.system,
                         "version": st.version, "release_manifest": st.release_manifest, "issued": st.issued,
                         "expires": st.expires, "previous": st.previous}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def read(data: bytes, public_key: Path, what: str) -> Statement:
    """A channel statement's bundle verified with the publisher's key and its fields checked; GateFailed naming
    `what` otherwise."""
    import hashlib

    from kiln_runtime import signature

    raw = signature.verify_envelope(data, public_key, what, HINT)
    try:
        doc = signature.parse_json(raw.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("_type") != STATEMENT_TYPE or \
                doc.get("predicateType") != PREDICATE_TYPE:
            raise ValueError(f"not a Kiln channel statement (predicateType {PREDICATE_TYPE})")
        subjects, p = doc.get("subject"), doc.get("predicate")
        if not isinstance(subjects, list) or len(subjects) != 1 or not isinstance(subjects[0], dict) or \
                not isinstance(p, dict):
            raise ValueError("a channel statement has one subject and a predicate")
        name, sha = subjects[0].get("name"), (subjects[0].get("digest") or {}).get("sha256")
        version = p.get("version")
        prev = p.get("previous")
        fields = (p.get("repository"), p.get("channel"), p.get("system"), name)
        if not all(isinstance(f, str) and 0 < len(f) <= 256 for f in fields) or not isinstance(version, int) or \
                isinstance(version, bool) or version < 1 or not isinstance(sha, str) or \
                not _SHA.fullmatch("sha256:" + sha) or not isinstance(p.get("release_manifest"), str) or \
                not _SHA.fullmatch(p["release_manifest"]):
            raise ValueError("predicate: repository, channel, system, version, release_manifest or the subject's "
                             "digest is missing or malformed")
        if prev is not None and (not isinstance(prev, dict) or not isinstance(prev.get("version"), int)):
            raise ValueError("predicate.previous: not {version, issued}")
        issued, expires = parse_time(p.get("issued"), "issued"), parse_time(p.get("expires"), "expires")
        if expires <= issued:
            raise ValueError("expires is not after issued")
    except (ValueError, RecursionError, UnicodeDecodeError, AttributeError) as e:
        raise GateFailed(f"{what}: {shown(str(e) or type(e).__name__, 300)}", HINT) from None
    return Statement(p["repository"], p["channel"], p["system"], version, name, "sha256:" + sha,
                     p["release_manifest"], p["issued"], p["expires"], prev,
                     "sha256:" + hashlib.sha256(data).hexdigest())


def bind(st: Statement, repository: str, channel: str | None) -> None:
    """The statement must be about the reference pulled: its repository, and its channel when pulled by tag."""
    if st.repository != repository or (channel is not None and st.channel != channel):
        raise GateFailed(f"the channel statement is for {shown(st.key, 200)}, not {shown(repository, 200)}"
                         + (f":{shown(channel, 64)}" if channel else ""), "a channel was copied or re-pointed "
                         "from another repository or channel; " + HINT)


def fresh(st: Statement, at: dt.datetime | None = None) -> None:
    """Not past its expiry (a freeze), not issued in the future (a wrong clock)."""
    at = at or now()
    if at >= parse_time(st.expires, "expires"):
        raise GateFailed(f"the channel statement for {shown(st.key, 200)} (v{st.version}) expired at {st.expires}: "
                         "the registry serves a stale channel, or the publisher has not renewed it",
                         "ask the publisher to sign the channel again (kiln push ARCHIVE REF:CHANNEL renews it), or "
                         "pull a version by its digest")
    if (parse_time(st.issued, "issued") - at).total_seconds() > CLOCK_SKEW_S:
        raise GateFailed(f"the channel statement for {shown(st.key, 200)} was issued at {st.issued}, in this host's "
                         "future", "this host's clock or the publisher's is wrong: fix it (NTP), then pull again")


# ---------------------------------------------------------------------------------------------- the host's floor
def state_dir() -> Path:
    if given := os.environ.get(STATE_ENV):
        return Path(given)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kiln-run"


def _floors(doc: Any) -> dict:
    """channels.json's floors, every entry checked (ValueError otherwise): a floor Kiln cannot read is never taken
    for no floor."""
    floors = doc.get("channels") if isinstance(doc, dict) else None
    if not isinstance(floors, dict):
        raise ValueError("no channels")
    for key, f in floors.items():
        if not isinstance(f, dict) or not isinstance(f.get("version"), int) or not isinstance(f.get("statement"), str):
            raise ValueError(key)
        parse_time(f.get("issued"), key)
    return floors


def _below(st: "Statement", floor: dict | None) -> bool:
    """Whether `st` is older than the floor, or another statement issued at the same instant."""
    if floor is None:
        return False
    issued, held = parse_time(st.issued, "issued"), parse_time(floor["issued"], "floor")
    return issued < held or (issued == held and st.digest != floor.get("statement"))


@contextmanager
def _locked(folder: Path) -> Iterator[dict]:
    """channels.json under an exclusive lock; written back (atomically) when the block changes it."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(folder / "channels.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise KilnError(f"cannot keep this host's channel floors in {folder} ({e.strerror})",
                        f"set {STATE_ENV} to a writable folder of this host") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = folder / "channels.json"
        try:
            floors = _floors(json.loads(path.read_text(encoding="utf-8"))) if path.exists() else {}
        except (OSError, ValueError, RecursionError):
            raise KilnError(f"{path}: unreadable (this host's channel floors)", f"restore it from a backup; removing "
                            "it forgets which channel statements this host accepted") from None
        before = json.dumps(floors, sort_keys=True)
        yield floors
        if json.dumps(floors, sort_keys=True) != before:
            tmp = folder / f".channels.json.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"schema": "kiln.channel-floors/1", "channels": floors}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        os.close(fd)


def check_floor(st: Statement, folder: Path | None = None) -> dict | None:
    """GateFailed when this host already accepted a newer statement for the channel (or another one issued at the
    same instant); the floor (None: the first statement for it here)."""
    with _locked(folder or state_dir()) as floors:
        floor = floors.get(st.key)
    if _below(st, floor):
        raise GateFailed(f"the channel statement for {shown(st.key, 200)} (v{st.version}, issued {st.issued}) is "
                         f"older than the one this host already accepted (v{floor['version']}, issued "
                         f"{floor['issued']}): refusing to roll back", "a registry or proxy is serving an old "
                         "channel; a real rollback is a new statement the publisher signs (kiln push OLD_ARCHIVE "
                         "REF:CHANNEL)")
    return floor


def accept(st: Statement, source: str, folder: Path | None = None) -> str | None:
    """Move the channel's floor to `st` (after the release it names verified, before it is placed) and append the
    acceptance to channels.log; a note when this is a signed rollback to a lower version, else None."""
    folder = folder or state_dir()
    with _locked(folder) as floors:
        floor = floors.get(st.key)
        if _below(st, floor):
            raise GateFailed(f"the channel {shown(st.key, 200)} moved on while this pull ran (this host accepted "
                             f"v{floor['version']}, issued {floor['issued']})", "pull again; nothing was placed")
        floors[st.key] = {"issued": st.issued, "expires": st.expires, "system": st.system, "version": st.version,
                          "statement": st.digest, "archive": st.archive}
        rollback = floor is not None and st.version < int(floor["version"])
        if floor is None or floor.get("statement") != st.digest:
            entry = {"at": stamp(now()), "channel": st.key, "source": source, **asdict(st),
                     "from_version": None if floor is None else floor["version"], "rollback": rollback}
            with open(folder / "channels.log", "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
    if rollback:
        return (f"a signed rollback of {st.key}: v{floor['version']} → v{st.version} (statement issued {st.issued}; "
                f"recorded in {folder / 'channels.log'})")
    return None


__all__ = ["ARTIFACT_TYPE", "MAX_STATEMENT", "PREDICATE_TYPE", "STATEMENT_MEDIA_TYPE", "Statement", "accept", "bind",
           "check_floor", "fresh", "now", "parse_time", "payload", "read", "stamp", "state_dir"]
