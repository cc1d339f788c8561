"""Signing keys and signatures of a release tree: `kiln keygen`, reading keys, `sign_tree`; `verify_tree` re-exported.

Signing is offline with a local EC P-256 key (`kiln keygen`; its path from $KILN_SIGNING_KEY, never inside the
repository). ECDSA normally draws a random nonce, which would make every archive different; the key is used with
RFC 6979 deterministic nonces (cryptography's `deterministic_signing`), so the same inputs give the same signature
and the same archive sha256 — a standard ECDSA signature that model-signing's own verifier (and any other) accepts.
This is the one module that touches model-signing's private modules (`_model_signing_internals`).

Verifying (`verify_tree`, `signed_name`, `load_public_key`, `one_line`) lives in the runtime,
kiln_runtime/signature.py, with `cryptography` alone: a deployment host checks a release without model-signing,
sigstore or pydantic, and the build verifies with that same code. tests/runtime/test_signature.py checks that it and
model-signing's own verifier accept and refuse the same trees.
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln_runtime.signature import (load_private_key, load_public_key, one_line, public_pem,  # noqa: F401
                                    read_key, sign_statement, signed_name, verify_tree)     # (re-exported)
from pipeline.errors import KilnError

KEY_ENV = "KILN_SIGNING_KEY"


# ---------------------------------------------------------------------------------------------- keys
def outside_repo(path: Path, what: str) -> Path:
    from pipeline.checkout import REPO

    p = Path(path).expanduser().resolve()
    repo = REPO.resolve()
    if p == repo or repo in p.parents:
        raise KilnError(f"{what} {path} is inside the repository ({REPO})",
                        f"keep signing keys out of the checkout, e.g. {KEY_ENV}=~/.config/kiln/signing-key.pem")
    return p


def key_path(given: str | None = None) -> Path:
    raw = given or os.environ.get(KEY_ENV)
    if not raw:
        raise KilnError(f"no signing key: pass --key or set {KEY_ENV}",
                        f"make one with `kiln keygen --out ~/.config/kiln/signing-key.pem` and export {KEY_ENV}")
    return Path(raw).expanduser()


def keygen(private: Path) -> tuple[Path, Path]:
    """A new EC P-256 key pair: `private` (PEM, mode 0600) and `private`.pub. Never overwrites a key, never writes
    through a link (a dangling `.pub` link could point into the checkout), never into the repository."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    given = Path(private).expanduser()
    folder = outside_repo(given.parent, "signing key folder")      # links in the folder's path resolved
    private, public = folder / given.name, folder / f"{given.name}.pub"
    for p in (private, public):
        if os.path.lexists(p):
            raise KilnError(f"{p} already exists{' (a link)' if p.is_symlink() else ''}; a key is never overwritten "
                            "or written through a link", "choose another path with --out")
    key = ec.generate_private_key(ec.SECP256R1())
    pems = {private: (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()), 0o600),
            public: (key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo), 0o644)}
    written: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for p, (pem, mode) in pems.items():     # O_EXCL | O_NOFOLLOW: a link or file put there meanwhile fails
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            written.append(p)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
    except BaseException as e:                  # both keys or neither (an error, Ctrl-C, SIGTERM)
        for p in written:
            p.unlink(missing_ok=True)
        if isinstance(e, OSError):
            why = f"{e.filename} is not a folder" if isinstance(e, (FileExistsError, NotADirectoryError)) else \
                f"{e.filename or private}: {e.strerror}"
            raise KilnError(f"cannot write the key {private} ({why})",
                            "choose a path in a writable folder with --out") from None
        raise
    return private, public


# ---------------------------------------------------------------------------------------------- signing
def _hashing():
    """What model-signing hashes: every file, sha256, no symlinks, nothing ignored (not even .git paths)."""
    from model_signing import hashing

    return hashing.Config().use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False) \
        .set_ignored_paths(paths=[], ignore_git_paths=False)


# Why private names: model-signing's public signer (model_signing.signing.Config().use_elliptic_key_signer) draws a
# random ECDSA nonce and writes the statement in protobuf's per-process map order, so signing the same tree twice gives
# two signatures and every release a new archive sha256. sign_tree builds the same bundle deterministically from the
# signer's private pieces listed here, checked against model-signing==1.1.1 (lockfiles/main.txt). This is the only
# code that touches them: after an upgrade that moved or renamed one, `kiln release` says so in one line.
MODEL_SIGNING_CHECKED = "1.1.1"
_PRIVATE = (("model_signing._signing.sign_ec_key", ("Signer", "Signer._get_verification_material", "get_ec_key_hash")),
            ("model_signing._signing.sign_sigstore_pb", ("pae", "Signature", "_BUNDLE_MEDIA_TYPE")),
            ("model_signing._signing.signing", ("Payload", "_IN_TOTO_JSON_PAYLOAD_TYPE")))


def _model_signing_internals():
    """model-signing's private modules sign_tree builds its bundle from (sign_ec_key, sign_sigstore_pb, signing),
    each checked for every name sign_tree uses; a KilnError naming the installed model-signing, not an ImportError
    or AttributeError traceback, if one of them is gone."""
    import importlib

    found = []
    for module, names in _PRIVATE:
        missing = module
        try:
            mod = importlib.import_module(module)
            for name in names:
                missing, obj = f"{module}.{name}", mod
                for part in name.split("."):
                    obj = getattr(obj, part)
        except (ImportError, AttributeError):
            raise KilnError(f"{_installed_model_signing()} has no {missing}, which kiln's deterministic signing uses "
                            f"(checked against model-signing=={MODEL_SIGNING_CHECKED})",
                            f"install the locked model-signing=={MODEL_SIGNING_CHECKED} (bash scripts/setup.sh), or "
                            "port pipeline/release/signing.py (_model_signing_internals, sign_tree) to the installed "
                            "one") \
                from None
        found.append(mod)
    return tuple(found)


def _installed_model_signing() -> str:
    from importlib import metadata

    try:
        return f"model-signing {metadata.version('model-signing')}"
    except metadata.PackageNotFoundError:
        return "model-signing (not installed)"


def sign_tree(tree: Path, signature: Path, private_key: Path) -> None:
    """Sign directory `tree` with model-signing's EC-key signer, made deterministic in its two random parts: the
    statement's JSON (protobuf Struct maps iterate in a per-process order; here keys are sorted) and the ECDSA nonce
    (RFC 6979). The bundle is otherwise built exactly as model-signing==1.1.1 builds it (pinned: this uses its
    signer's internals), and its own verifier checks it."""
    import base64

    from cryptography.hazmat.primitives.asymmetric import ec
    from google.protobuf import json_format
    from sigstore_models import intoto as intoto_pb
    from sigstore_models.bundle import v1 as bundle_pb

    sign_ec_key, sigstore_pb, ms_signing = _model_signing_internals()     # private: see MODEL_SIGNING_CHECKED
    key = load_private_key(Path(private_key))
    signer = sign_ec_key.Signer(Path(private_key))
    statement = ms_signing.Payload(_hashing().hash(tree)).statement
    raw = json_format.MessageToJson(statement.pb, sort_keys=True).encode("utf-8")
    sig = key.sign(sigstore_pb.pae(raw), ec.ECDSA(sign_ec_key.get_ec_key_hash(key.public_key()),
                                                 deterministic_signing=True))
    envelope = intoto_pb.Envelope(payload=base64.b64encode(raw), payload_type=ms_signing._IN_TOTO_JSON_PAYLOAD_TYPE,
                                  signatures=[intoto_pb.Signature(sig=base64.b64encode(sig), keyid="")])
    bundle = bundle_pb.Bundle(media_type=sigstore_pb._BUNDLE_MEDIA_TYPE, dsse_envelope=envelope,
                              verification_material=signer._get_verification_material())
    sigstore_pb.Signature(bundle).write(Path(signature))
