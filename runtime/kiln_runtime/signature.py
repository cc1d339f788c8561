"""Verifying a release's signature with `cryptography` alone: the deployment host checks a release before it trusts
anything in it, without model-signing, sigstore or pydantic. The build verifies with this same code
(pipeline/release/signing.py re-exports it); only signing (`sign_tree`, `kiln keygen`) stays on model-signing, in
the build.

What the build signs (pipeline/release/signing.py `sign_tree`, model-signing==1.1.1's EC-key signer made
deterministic) is a sigstore bundle, JSON:

    {"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
     "verificationMaterial": {"publicKey": {"hint": sha256 hex of the signer's public key PEM}, "tlogEntries": []},
     "dsseEnvelope": {"payload": base64 statement, "payloadType": "application/vnd.in-toto+json",
                      "signatures": [{"sig": base64 DER ECDSA signature, "keyid": ""}]}}

The signature is ECDSA over the DSSE pre-authentication encoding `DSSEv1 <len type> <type> <len payload> <payload>`
with the hash model-signing pairs with the key's curve (SHA-256 for P-256, which `kiln keygen` makes). The payload
is an in-toto statement: `_type` https://in-toto.io/Statement/v1, `predicateType`
https://model_signing/signature/v1.0, one subject (the signed directory's name; callers compare it, `signed_name`)
whose sha256 is the sha256 of every resource's raw digest bytes in the order listed, and a predicate with
`serialization` {method files, hash_type sha256, allow_symlinks false} and `resources`: one {name, algorithm sha256,
digest hex} per regular file, named by its path relative to the tree.

Signing a document or a tree in this format without model-signing (`sign_statement`, `sign_tree`) is here too: a
deployment host signs its gallery snapshots (kiln_runtime/gallery.py) and the build its channel statements with it;
the build signs releases with model-signing's own signer (pipeline/release/signing.py), and tests/runtime/
test_signature.py checks that model-signing's verifier accepts what `sign_tree` makes.

`verify_tree` checks all of it, then the tree: every regular file's sha256 is the signed one, no file added or
missing, no symbolic link, FIFO or device anywhere (empty directories carry no content and are not signed). It is
stricter than model-signing's verifier where Kiln never writes otherwise: one signature, exactly that serialization,
canonical unique resource names, lowercase sha256 digests, no duplicate JSON keys, no pre-1.0 (v0.2) formats.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from kiln_runtime.errors import GateFailed, KilnError
from kiln_runtime.text import shown

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
SERIALIZATION = {"method": "files", "hash_type": "sha256", "allow_symlinks": False}
MAX_SIGNATURE = 8 << 20                           # bytes of a bundle (a 10,000-file release signs in ~2 MiB)
_MAX_KEY = 64 << 10                               # a PEM key file
_CURVE_HASH = {"secp256r1": "SHA256", "secp384r1": "SHA384", "secp521r1": "SHA512"}   # model-signing's pairing
_HEX64 = re.compile(r"[0-9a-f]{64}")
HINT = "do not use this release; get the archive and the publisher's key again"


class _Malformed(ValueError):
    """A bundle or statement field that is missing or of the wrong kind: `where: what`."""


# ---------------------------------------------------------------------------------------------- keys
def read_key(path: Path, what: str, hint: str) -> bytes:
    """A key file's bytes: a regular file of at most _MAX_KEY bytes (not a FIFO, a device or a padded file)."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_KEY:
            raise KilnError(f"{path}: not a {what} (a PEM key is a regular file under {_MAX_KEY >> 10} KiB)", hint)
        return path.read_bytes()
    except FileNotFoundError:
        raise KilnError(f"{path}: no such {what}", hint) from None
    except OSError as e:
        raise KilnError(f"{path}: cannot read the {what} ({e.strerror})", hint) from None


def load_public_key(path: Path):
    """The publisher's EC public key (cryptography's EllipticCurvePublicKey). A user error (exit 2), not a failed
    verification, when the key itself is missing or unusable."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = read_key(Path(path), "public key", "pass the publisher's .pub key (kiln keygen writes it)")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise KilnError(f"{path}: not a PEM public key ({one_line(str(e), 200)})",
                        "pass the publisher's public key (KEY.pub), not the private key") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise KilnError(f"{path}: not an EC public key", "pass the .pub written by kiln keygen")
    if key.curve.name not in _CURVE_HASH:
        raise KilnError(f"{path}: an EC key on curve {key.curve.name}; a release is signed with P-256 (P-384 and "
                        "P-521 are read too)", "pass the .pub written by kiln keygen")
    return key


def load_private_key(path: Path):
    """The publisher's EC P-256 private key (cryptography's EllipticCurvePrivateKey), or one KilnError."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    hint = "use a key made by `kiln keygen` (EC P-256, PEM, unencrypted)"
    try:
        key = serialization.load_pem_private_key(read_key(Path(path), "signing key", hint), None)
    except (ValueError, TypeError) as e:
        raise KilnError(f"{shown(path, 300)}: not a usable signing key ({one_line(str(e), 200)})", hint) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        kind = key.curve.name if isinstance(key, ec.EllipticCurvePrivateKey) else \
            type(key).__name__.removesuffix("PrivateKey")                # RSA, Ed25519, DSA, ...
        raise KilnError(f"{shown(path, 300)}: a {kind} key; kiln signs with EC P-256 keys", "make one with `kiln "
                        "keygen --out PATH`")
    return key


def public_pem(key) -> bytes:
    """The SubjectPublicKeyInfo PEM of a private key's public half (its sha256 is a bundle's key hint)."""
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


# ---------------------------------------------------------------------------------------------- the bundle
def one_line(text: str, limit: int) -> str:
    """A message (often several lines, sometimes quoting its input) as one bounded line, any control or bidi
    character in it shown escaped (kiln_runtime/text.py `shown`)."""
    return shown(" ".join(text.split()), limit)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Malformed(f"key '{shown(dup, 80)}' appears twice in one object")
    return out


def _json(data: bytes | str) -> Any:
    return json.loads(data, object_pairs_hook=_no_duplicates)


def _get(obj: Any, where: str, kind: type, required: bool = True) -> Any:
    """obj[last part of `where`] checked to be of `kind` (pydantic's wording, the field named by its JSON path)."""
    key = where.rsplit(".", 1)[-1]
    if key not in obj:
        if required:
            raise _Malformed(f"{where}: Field required")
        return None
    value = obj[key]
    if kind is str and not isinstance(value, str) or kind is dict and not isinstance(value, dict) or \
            kind is list and not isinstance(value, list):
        word = {str: "string", dict: "dictionary", list: "list"}[kind]
        raise _Malformed(f"{where}: Input should be a valid {word}")
    return value


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _Malformed(f"{where}: not base64") from None


def _read_bundle(signature: Path) -> dict[str, Any]:
    """The bundle's JSON object, read bounded (OSError, UnicodeDecodeError, JSONDecodeError, _Malformed)."""
    fd = os.open(signature, os.O_RDONLY | os.O_NONBLOCK)          # a FIFO neither blocks nor passes
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise _Malformed(f"{Path(signature).name}: not a regular file")
        data = f.read(MAX_SIGNATURE + 1)
    if len(data) > MAX_SIGNATURE:
        raise _Malformed(f"{Path(signature).name}: more than {MAX_SIGNATURE >> 20} MiB; a signature bundle is far "
                         "smaller")
    bundle = _json(data.decode("utf-8"))
    if not isinstance(bundle, dict):
        raise _Malformed(f"the bundle is a JSON {type(bundle).__name__}, not an object")
    return bundle


def _envelope(bundle: dict[str, Any]) -> tuple[str | None, str, bytes, bytes]:
    """(public key hint, payload type, payload, signature) — every field checked for kind before it is used."""
    if _get(bundle, "mediaType", str) != BUNDLE_MEDIA_TYPE:
        raise _Malformed(f"mediaType: {shown(bundle['mediaType'], 100)} is not {BUNDLE_MEDIA_TYPE}")
    material = _get(bundle, "verificationMaterial", dict)
    public = _get(material, "verificationMaterial.publicKey", dict)
    hint = public.get("hint")                 # model-signing reads a bundle without one (before 1.0); null too
    if hint is not None and not isinstance(hint, str):
        raise _Malformed("verificationMaterial.publicKey.hint: Input should be a valid string")
    envelope = _get(bundle, "dsseEnvelope", dict)
    payload_type = _get(envelope, "dsseEnvelope.payloadType", str)
    payload = _b64(_get(envelope, "dsseEnvelope.payload", str), "dsseEnvelope.payload")
    signatures = _get(envelope, "dsseEnvelope.signatures", list)
    if len(signatures) != 1:
        raise _Malformed(f"dsseEnvelope.signatures: {len(signatures)} entries; a release has exactly one signature")
    if not isinstance(signatures[0], dict):
        raise _Malformed("dsseEnvelope.signatures.0: Input should be a valid dictionary")
    sig = _b64(_get(signatures[0], "dsseEnvelope.signatures.0.sig", str), "dsseEnvelope.signatures.0.sig")
    return hint, payload_type, payload, sig


def pae(payload: bytes, payload_type: str = PAYLOAD_TYPE) -> bytes:
    """DSSE's pre-authentication encoding (DSSE v1.0 protocol): what the ECDSA signature covers."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def _check_signature(key, hint: str | None, payload: bytes, sig: bytes, key_name: str) -> None:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    if hint and hint != hashlib.sha256(pem).hexdigest():
        raise GateFailed(f"signature: Key mismatch: the bundle was made for another public key than "
                         f"{shown(key_name, 100)} (its verification material's hint is not this key's sha256)", HINT)
    try:
        key.verify(sig, pae(payload), ec.ECDSA(getattr(hashes, _CURVE_HASH[key.curve.name])()))
    except InvalidSignature:
        raise GateFailed(f"signature: InvalidSignature: the ECDSA signature over the statement does not verify with "
                         f"{shown(key_name, 100)} (the bundle was changed, or signed by another key)", HINT) from None


# ---------------------------------------------------------------------------------------------- the statement
def _canonical(name: str) -> bool:
    parts = PurePosixPath(name).parts
    return bool(name) and PurePosixPath(name).as_posix() == name and not name.startswith("/") and \
        ".." not in parts and "." not in parts


def _signed_files(statement: Any) -> dict[str, str]:
    """{relative path: sha256 hex} from a verified statement, every field checked; raises _Malformed."""
    if not isinstance(statement, dict):
        raise _Malformed(f"the statement is a JSON {type(statement).__name__}, not an object")
    if (kind := _get(statement, "_type", str)) != STATEMENT_TYPE:
        raise _Malformed(f"_type: {shown(kind, 100)} is not {STATEMENT_TYPE}")
    if (kind := _get(statement, "predicateType", str)) != PREDICATE_TYPE:
        raise _Malformed(f"predicateType: {shown(kind, 100)} is not {PREDICATE_TYPE}")
    subjects = _get(statement, "subject", list)
    if len(subjects) != 1:
        raise _Malformed(f"subject: {len(subjects)} subjects; a signed tree has exactly one")
    if not isinstance(subjects[0], dict):
        raise _Malformed("subject.0: Input should be a valid dictionary")
    _get(subjects[0], "subject.0.name", str)
    root = _get(_get(subjects[0], "subject.0.digest", dict), "subject.0.digest.sha256", str)
    predicate = _get(statement, "predicate", dict)
    if (how := _get(predicate, "predicate.serialization", dict)) != SERIALIZATION:
        raise _Malformed(f"predicate.serialization: {one_line(json.dumps(how, sort_keys=True), 200)} is not "
                         f"{json.dumps(SERIALIZATION, sort_keys=True)} (every file, sha256, no links, none ignored)")
    files: dict[str, str] = {}
    whole = hashlib.sha256()
    for i, resource in enumerate(_get(predicate, "predicate.resources", list)):
        where = f"predicate.resources.{i}"
        if not isinstance(resource, dict):
            raise _Malformed(f"{where}: Input should be a valid dictionary")
        name = _get(resource, f"{where}.name", str)
        if _get(resource, f"{where}.algorithm", str) != "sha256":
            raise _Malformed(f"{where}.algorithm: {shown(resource['algorithm'], 40)} is not sha256")
        digest = _get(resource, f"{where}.digest", str)
        if not _HEX64.fullmatch(digest):
            raise _Malformed(f"{where}.digest: not a sha256 (64 lowercase hex digits)")
        if not _canonical(name):
            raise _Malformed(f"{where}.name: {shown(name, 200)} is not a plain relative path")
        if name in files:
            raise _Malformed(f"{where}.name: {shown(name, 200)} is signed twice")
        files[name] = digest
        whole.update(bytes.fromhex(digest))
    if whole.hexdigest() != root:             # model-signing: the subject digest is over the listed digests
        raise _Malformed(f"subject.0.digest.sha256: {shown(root, 80)} is not the sha256 of the resources' digests "
                         "(the statement is inconsistent)")
    return files


# ---------------------------------------------------------------------------------------------- the tree
def _tree_files(tree: Path) -> list[str]:
    """Every regular file under `tree` (relative POSIX paths, sorted); a link, FIFO, socket or device anywhere is a
    GateFailed (model-signing signed with allow_symlinks=False; nothing else is content)."""
    out: list[str] = []
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            entries = sorted(os.scandir(tree / rel if rel else tree), key=lambda e: e.name)
        except OSError as e:
            raise GateFailed(f"signed content: {shown(rel or tree, 200)}: cannot read the folder ({e.strerror})",
                             HINT) from None
        for entry in entries:
            name = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_symlink():
                raise GateFailed(f"signed content: {shown(name, 200)}: a symbolic link; a signed release holds "
                                 "regular files and folders only", HINT)
            if entry.is_dir(follow_symlinks=False):
                pending.append(name)
            elif entry.is_file(follow_symlinks=False):
                out.append(name)
            else:
                raise GateFailed(f"signed content: {shown(name, 200)}: not a regular file (a FIFO, socket or "
                                 "device); a signed release holds regular files and folders only", HINT)
    return sorted(out)


def _sha256(path: Path, name: str) -> str:
    """sha256 of the regular file at `path`, opened without following a link (a file swapped for one, or for a
    FIFO, after the walk is refused, not followed or waited on)."""
    h = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        what = "a symbolic link" if e.errno == errno.ELOOP else f"cannot read it ({e.strerror})"
        raise GateFailed(f"signed content: {shown(name, 200)}: {what}", HINT) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise GateFailed(f"signed content: {shown(name, 200)}: not a regular file", HINT)
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return shown(", ".join(names[:5]), 400) + more


def verify_tree(tree: Path, signature: Path, public_key: Path) -> None:
    """Verify directory `tree` against the bundle `signature` with the publisher's `public_key` (a PEM path): the
    ECDSA signature over the statement, the statement itself, then every file's sha256 (extra or missing files, and
    any link, fail too). Raises GateFailed naming what failed (KilnError when the key file itself is unusable)."""
    tree, signature = Path(tree), Path(signature)
    key = load_public_key(Path(public_key))
    try:
        hint, payload_type, payload, sig = _envelope(_read_bundle(signature))
        if payload_type != PAYLOAD_TYPE:        # the PAE below is over this type: checked first, said plainly
            raise _Malformed(f"dsseEnvelope.payloadType: {shown(payload_type, 100)} is not {PAYLOAD_TYPE}")
    except (OSError, ValueError, RecursionError) as e:                # _Malformed, JSON, UTF-8
        msg = f"{signature.name}: {e.strerror}" if isinstance(e, OSError) else str(e) or type(e).__name__
        why = "malformed bundle" if isinstance(e, _Malformed) else type(e).__name__
        raise GateFailed(f"signature: {one_line(msg, 300)} ({why})", HINT) from None
    _check_signature(key, hint, payload, sig, Path(public_key).name)
    try:
        signed = _signed_files(_json(payload.decode("utf-8")))
    except (ValueError, RecursionError) as e:                         # _Malformed, JSON, UTF-8
        why = "malformed statement" if isinstance(e, _Malformed) else type(e).__name__
        raise GateFailed(f"signature: statement: {one_line(str(e) or type(e).__name__, 300)} ({why})", HINT) \
            from None

    if tree.is_symlink() or not tree.is_dir():
        raise GateFailed(f"signed content: {shown(tree, 300)}: not a folder", HINT)
    found = _tree_files(tree)
    changed = [n for n in found if n in signed and _sha256(tree / n, n) != signed[n]]
    if changed:
        raise GateFailed(f"signed content: {_listed(changed)}: sha256 differs from the signed statement", HINT)
    extra, missing = [n for n in found if n not in signed], sorted(set(signed) - set(found))
    if extra or missing:
        model = shown(tree.name, 100)
        diffs = ([f"Extra files found in model '{model}': {_listed(extra)}"] if extra else []) + \
            ([f"Missing files in model '{model}': {_listed(missing)}"] if missing else [])
        raise GateFailed(f"signed content: Signature mismatch: {'; '.join(diffs)}", HINT)


def sign_statement(payload: bytes, private_key: Path) -> bytes:
    """A bundle in the release signing format whose DSSE envelope carries `payload` (an in-toto statement), ECDSA
    P-256 with RFC 6979 nonces — the same bytes for the same statement. `verify_envelope` (and `verify_tree`, for a
    tree's statement) reads it."""
    import base64

    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = load_private_key(Path(private_key))
    sig = key.sign(pae(payload), ec.ECDSA(hashes.SHA256(), deterministic_signing=True))
    bundle = {"mediaType": BUNDLE_MEDIA_TYPE,
              "verificationMaterial": {"publicKey": {"hint": hashlib.sha256(public_pem(key)).hexdigest()},
                                       "tlogEntries": []},
              "dsseEnvelope": {"payload": base64.b64encode(payload).decode("ascii"), "payloadType": PAYLOAD_TYPE,
                               "signatures": [{"sig": base64.b64encode(sig).decode("ascii"), "keyid": ""}]}}
    return json.dumps(bundle, sort_keys=True, separators=(",", ":")).encode("ascii")


def tree_statement(tree: Path) -> bytes:
    """The statement model-signing makes of a tree (every regular file, sha256, no links, none ignored): what
    `verify_tree` checks. Canonical JSON: the same tree, the same bytes."""
    tree = Path(tree)
    names = _tree_files(tree)
    resources = [{"name": n, "algorithm": "sha256", "digest": _sha256(tree / n, n)} for n in names]
    root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
    doc = {"_type": STATEMENT_TYPE, "subject": [{"name": tree.name, "digest": {"sha256": root}}],
           "predicateType": PREDICATE_TYPE, "predicate": {"serialization": SERIALIZATION, "resources": resources}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def sign_tree(tree: Path, signature: Path, private_key: Path) -> None:
    """Sign directory `tree` in the release signing format with `cryptography` alone (a deployment host has no
    model-signing): `signature` written whole (a temporary sibling, then a rename)."""
    bundle = sign_statement(tree_statement(tree), private_key)
    tmp = Path(signature).with_name(f".{Path(signature).name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(bundle)
        os.replace(tmp, signature)
    finally:
        tmp.unlink(missing_ok=True)


def verify_envelope(data: bytes, public_key: Path, what: str, hint: str = HINT,
                    payload_type: str = PAYLOAD_TYPE) -> bytes:
    """The payload of a signed document other than a release tree (a channel statement): a bundle in the release
    signing format (`data`, at most MAX_SIGNATURE bytes), its DSSE signature checked with `public_key`. GateFailed
    naming `what` for anything else; KilnError when the key file itself is unusable."""
    key = load_public_key(Path(public_key))
    try:
        if len(data) > MAX_SIGNATURE:
            raise _Malformed(f"more than {MAX_SIGNATURE >> 20} MiB")
        bundle = _json(data.decode("utf-8"))
        if not isinstance(bundle, dict):
            raise _Malformed(f"the bundle is a JSON {type(bundle).__name__}, not an object")
        key_hint, kind, payload, sig = _envelope(bundle)
        if kind != payload_type:
            raise _Malformed(f"dsseEnvelope.payloadType: {shown(kind, 100)} is not {payload_type}")
    except (ValueError, RecursionError) as e:                         # _Malformed, JSON, UTF-8
        why = "malformed bundle" if isinstance(e, _Malformed) else type(e).__name__
        raise GateFailed(f"{what}: {one_line(str(e) or type(e).__name__, 300)} ({why})", hint) from None
    try:
        _check_signature(key, key_hint, payload, sig, Path(public_key).name)
    except GateFailed as e:
        raise GateFailed(f"{what}: {e.message}", hint) from None
    return payload


def parse_json(data: bytes | str) -> Any:
    """JSON as Kiln reads signed documents: a key given twice is refused (ValueError), as is nesting past Python's
    recursion limit (RecursionError)."""
    return _json(data)


def signed_name(sig: Path) -> str:
    """The subject name inside the signed statement (model-signing: the signed directory's name). Read after
    `verify_tree` holds; a bundle it cannot read is a GateFailed."""
    try:
        _, _, payload, _ = _envelope(_read_bundle(Path(sig)))
        statement = _json(payload.decode("utf-8"))
        return str(statement["subject"][0]["name"])
    except (ValueError, KeyError, IndexError, TypeError, RecursionError, OSError) as e:
        msg = f"{Path(sig).name}: {e.strerror}" if isinstance(e, OSError) else str(e)
        raise GateFailed(f"signature: unreadable statement ({one_line(msg, 200)})", "get the archive again") \
            from None
