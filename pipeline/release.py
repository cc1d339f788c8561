"""`kiln release` / `kiln verify-release` / `kiln keygen`: one signed, deterministic archive per released version.

A release is built from a *registered* version (downloaded and proven like `promote` proves it: stored files against
the stored manifest, manifest and verdict against the digests logged as run parameters, verdict pass) plus the
provenance chain of that exact build in this workspace (`pipeline/provenance.py`, every link re-verified). The
archive `releases/<registered>-v<version>.tar.gz` holds two entries:

    <R>/                    the signed tree
      release.json          what this is: registered model, version, artifact, identity digests, verdict
      engine/               the registered files, their manifest, kiln/ (validation.json + manifest, bench, record)
      chain/artifacts/...   every upstream manifest (quantized → calibration → export → golden → data → assets)
      provenance.json       the walked chain (pins: package==version, archive sha256, license)
      lockfiles.json        sha256 of the lockfiles of the checkout that made the release
      slsa-provenance.json  an in-toto Statement v1 with a SLSA Provenance v1 predicate for the build
      report.html           the release's page: latency, accuracy, verdict, fallbacks, provenance graph
    <R>.sig                 the OpenSSF model-signing signature of <R>/: a Sigstore bundle holding a DSSE
                            envelope around an in-toto statement whose resources are every file's sha256

Signing is offline with a local EC P-256 key (`kiln keygen`; its path from $KILN_SIGNING_KEY, never inside the
repository). ECDSA normally draws a random nonce, which would make every archive different; the key is used with
RFC 6979 deterministic nonces (cryptography's `deterministic_signing`), so the same inputs give the same signature
and the same archive sha256 — a standard ECDSA signature that model-signing's own verifier (and any other) accepts.
The tar is deterministic too: sorted entries, mtime 0, uid/gid 0, fixed modes, gzip without name or time.

`verify-release` needs no MLflow and no network. It reads the archive once, as a stream, as strictly as it was
written (pipeline/archive.py), so GNU tar can find nothing in it that the verifier did not check. Then
model-signing verifies the signature and every file's digest (nothing unsigned is accepted), and Kiln re-checks the
engine against its manifest, the verdict, every manifest link of the chain and the SLSA subjects, reading no
document over a fixed size. The first failure is named and the exit code is 1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline import paths
from pipeline.archive import DISK_FULL, safe_extract, write_archive
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import (check_files, identity_digest, json_bytes, manifest_path, read_manifest,
                               sha256_file)

SCHEMA = "kiln.release/1"
KEY_ENV = "KILN_SIGNING_KEY"
RELEASES = Path("releases")
SLSA_PREDICATE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://kiln.invalid/buildtypes/dvc-repro/v1"   # names Kiln's build recipe (dvc.yaml); not fetched
SIG_SUFFIX = ".sig"
RELEASE_ALIAS = "release"                         # the registered model's alias of its latest released version
RELEASE_TAG = "kiln.release.sha256"               # on the version: its release archive's sha256
# Bounds on what Kiln reads from a release or a key file, applied before parsing (the archive's own: pipeline/archive.py)
_MAX_DOC = 8 << 20                                # one JSON document: signature, release.json, a manifest, ...
_MAX_KEY = 64 << 10                               # a PEM key file


@dataclass(frozen=True)
class Release:
    archive: Path
    sha256: str
    name: str                 # registered model
    version: int
    new: bool                 # False: this exact archive was already released (and recorded) before


# ---------------------------------------------------------------------------------------------- keys
def _outside_repo(path: Path, what: str) -> Path:
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


def _read_key(path: Path, what: str, hint: str) -> bytes:
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


def keygen(private: Path) -> tuple[Path, Path]:
    """A new EC P-256 key pair: `private` (PEM, mode 0600) and `private`.pub. Never overwrites a key, never writes
    through a link (a dangling `.pub` link could point into the checkout), never into the repository."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    given = Path(private).expanduser()
    folder = _outside_repo(given.parent, "signing key folder")      # links in the folder's path resolved
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


def sign_tree(tree: Path, signature: Path, private_key: Path) -> None:
    """Sign directory `tree` with model-signing's EC-key signer, made deterministic in its two random parts: the
    statement's JSON (protobuf Struct maps iterate in a per-process order; here keys are sorted) and the ECDSA nonce
    (RFC 6979). The bundle is otherwise built exactly as model-signing==1.1.1 builds it (pinned: this uses its
    signer's internals), and its own verifier checks it."""
    import base64

    from cryptography.hazmat.primitives.asymmetric import ec
    from google.protobuf import json_format
    from model_signing._signing import sign_ec_key
    from model_signing._signing import sign_sigstore_pb as sigstore_pb
    from model_signing._signing import signing as ms_signing
    from sigstore_models import intoto as intoto_pb
    from sigstore_models.bundle import v1 as bundle_pb

    from cryptography.hazmat.primitives import serialization

    hint = "use a key made by `kiln keygen` (EC P-256, PEM, unencrypted)"
    try:
        key = serialization.load_pem_private_key(_read_key(Path(private_key), "signing key", hint), None)
    except (ValueError, TypeError) as e:
        raise KilnError(f"{private_key}: not a usable signing key ({str(e)[:200]})", hint) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        kind = key.curve.name if isinstance(key, ec.EllipticCurvePrivateKey) else \
            type(key).__name__.removesuffix("PrivateKey")                # RSA, Ed25519, DSA, ...
        raise KilnError(f"{private_key}: a {kind} key; kiln signs with EC P-256 keys",
                        "make one with `kiln keygen --out PATH`")
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


def verify_tree(tree: Path, signature: Path, public_key: Path) -> None:
    """model-signing's verifier: the signature over the statement, then every file's sha256 (extra or missing files
    fail too). Raises GateFailed naming what failed."""
    from model_signing import verifying

    try:
        verifying.Config().use_elliptic_key_verifier(public_key=Path(public_key)).set_hashing_config(_hashing()) \
            .verify(Path(tree), Path(signature))
    except Exception as e:  # noqa: BLE001 — model-signing raises ValueError, InvalidSignature, JSON and proto errors
        msg = str(e) or type(e).__name__
        hint = "do not use this release; get the archive and the publisher's key again"
        if changed := re.findall(r"Hash mismatch for \\*'([^'\\]+)", msg):
            raise GateFailed(f"signed content: {', '.join(changed[:5])[:500]}: sha256 differs from the signed "
                             "statement", hint) from None
        if msg.startswith("Signature mismatch"):                    # files added or removed after signing
            raise GateFailed(f"signed content: {_one_line(msg, 500)}", hint) from None
        if callable(getattr(e, "errors", None)):                     # pydantic (the bundle's schema): first error
            first = e.errors()[0]
            msg = f"{'.'.join(map(str, first.get('loc', ())))}: {first.get('msg')}"
        raise GateFailed(f"signature: {_one_line(msg, 300)} ({type(e).__name__})", hint) from None


def _one_line(text: str, limit: int) -> str:
    """A message from a library (often several lines, sometimes quoting its input) as one bounded line."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


# ---------------------------------------------------------------------------------------------- building a release
def _portable(node: Any) -> Any:
    """The chain as shipped: without what depends on the releasing checkout (code drift, local run records)."""
    if isinstance(node, dict):
        out = {k: _portable(v) for k, v in node.items() if k != "commit"}
        if isinstance(out.get("code"), dict):
            out["code"] = {"modules": out["code"].get("modules", {})}
        return out
    if isinstance(node, list):
        return [_portable(v) for v in node]
    return node


def _lockfiles() -> dict[str, str]:
    from pipeline.checkout import REPO

    found = [*(REPO / "lockfiles").glob("*.in"), *(REPO / "lockfiles").glob("*.txt")]
    return {p.relative_to(REPO).as_posix(): sha256_file(p) for p in sorted(found) if p.is_file()}


def _chain_nodes(tree: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], [tree]
    while stack:
        n = stack.pop()
        if "kind" in n:
            out.append(n)
        for e in n.get("inputs", []):
            for k in ("node", "owner"):
                if isinstance(e.get(k), dict):
                    stack.append(e[k])
    return sorted(out, key=lambda n: n["manifest"])


def slsa_statement(release: dict[str, Any], engine_files: dict[str, str], tree: dict[str, Any],
                   record: dict[str, Any], verdict: dict[str, Any], bench: dict[str, Any] | None,
                   lockfiles: dict[str, str]) -> dict[str, Any]:
    """in-toto Statement v1, SLSA Provenance v1 predicate (checked against the SLSA protobuf schema)."""
    from google.protobuf import json_format
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
    from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
    from in_toto_attestation.v1.statement import STATEMENT_TYPE_URI, Statement

    nodes = _chain_nodes(tree)
    deps: list[dict[str, Any]] = []
    pins = {}
    for n in nodes:
        for pin in n.get("pins") or []:
            pins[pin["requirement"]] = pin
    for req, pin in sorted(pins.items()):
        name, _, version = req.partition("==")
        deps.append({"uri": f"pkg:pypi/{name}@{version}", "name": pin["archive"],
                     "digest": {"sha256": pin["archive_sha256"]},
                     "annotations": {"license": pin["license"], "members": pin["members"]}})
    for path, sha in sorted(lockfiles.items()):
        deps.append({"name": path, "digest": {"sha256": sha}})
    code: dict[str, set[str]] = {}
    for n in nodes:
        for module, digest in (n.get("code") or {}).get("modules", {}).items():
            code.setdefault(module, set()).add(digest)
    for module in sorted(code):
        for digest in sorted(code[module]):
            deps.append({"name": module, "digest": {"xxh3_128": digest}})
    commit = (record.get("git") or {}).get("commit")
    if commit:
        deps.append({"name": "kiln source", "digest": {"gitCommit": commit},
                     "annotations": {"dirty": bool((record.get("git") or {}).get("dirty"))}})
    predicate = {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {"registered_model": release["registered_model"], "version": release["version"],
                                   "params": {n["manifest"]: {"stage": n["stage"], "values": n["params"]["values"]}
                                              for n in nodes}},
            "internalParameters": {"toolchain": {n["manifest"]: n["toolchain"] for n in nodes}},
            "resolvedDependencies": deps},
        "runDetails": {
            "builder": {"id": "https://kiln.invalid/builders/dvc-repro"},
            "metadata": {"invocationId": str(record.get("stage", release["artifact"]))}
            | ({"startedOn": record["started_at"]} if record.get("started_at") else {}),
            "byproducts": [{"name": "validation.json", "annotations": {
                "verdict": verdict.get("verdict"), "metrics": verdict.get("metrics") or {}}}]
            + ([{"name": "bench.json", "annotations": bench}] if bench else [])}}
    json_format.ParseDict(predicate, provenance_pb2.Provenance())           # schema check: raises on a bad field
    subjects = [ResourceDescriptor(name=f"engine/{path}", digest={"sha256": sha}).pb
                for path, sha in sorted(engine_files.items())]
    st = Statement(subjects, SLSA_PREDICATE, predicate)
    st.validate()
    # written from the dicts, not the protobuf Struct (which turns every integer into a float)
    return {"_type": STATEMENT_TYPE_URI, "subject": [json_format.MessageToDict(s) for s in subjects],
            "predicateType": SLSA_PREDICATE, "predicate": predicate}


def _resolve_version(reg, name: str, ref: str) -> int:
    from pipeline.registry.releases import PRODUCTION

    if ref.lstrip("v").isdigit():
        return int(ref.lstrip("v"))
    paths.slug(ref, "alias")
    version = reg.aliases(name).get(ref)
    if version is None:
        raise KilnError(f"{name}: no version has the alias {ref!r}",
                        f"promote one first (kiln promote {name} VERSION)" if ref == PRODUCTION else
                        f"see the aliases with: kiln history {name}")
    return int(version)


def build(cfg, name: str, ref: str, root: Path = Path("."), key: Path | None = None,
          out_dir: Path | None = None) -> Release:
    """Release version `ref` (a number or an alias) of registered model `name` as a signed deterministic archive."""
    from pipeline import provenance
    from pipeline.registry.client import Registry, errors, registered_name
    from pipeline.registry.registration import BENCH_FILE, RECORD_FILE
    from pipeline.registry.releases import KILN_DIR, _gate, download_verified

    root = Path(root)
    key = key_path(str(key) if key else None)
    if not key.is_file():
        raise KilnError(f"{key}: signing key not found", "make one with `kiln keygen --out PATH`")
    _outside_repo(key, "signing key")
    out_dir = Path(out_dir) if out_dir else root / RELEASES
    name = registered_name(cfg, name)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-release-") as tmp, _writing(Path(tmp)):
        reg.require_model(name)
        version = _resolve_version(reg, name, ref)
        v = download_verified(reg, name, version, Path(tmp) / "download")
        _gate(reg, name, version, v, Path(tmp) / "attached")        # a release passes what promote demands
        artifact = v.params["kiln.artifact"]
        ident = identity_digest(v.manifest)
        start = provenance.resolve(f"{name}/{version}", root, cfg)
        chain = provenance.walk(start, root)
        if not chain.ok:
            raise GateFailed(f"{name} v{version}: its provenance chain is broken: {chain.breaks[0]}",
                             f"see `kiln provenance {name}/{version}`; rebuild or restore the artifact (dvc checkout)")
        rel = f"{name}-v{version}"
        tree = Path(tmp) / rel
        engine = tree / "engine"
        files = [e["path"] for e in v.manifest["files"]]
        for f in files + [manifest_path(Path(""), artifact).as_posix()]:
            _copy(v.directory / f, engine / f)
        for f in sorted((v.directory / KILN_DIR).iterdir()):
            _copy(f, engine / KILN_DIR / f.name)
        for m in chain.manifests:                  # root-relative by construction (provenance refuses others)
            if Path(m).is_absolute() or ".." in Path(m).parts:
                raise KilnError(f"{m}: a chain manifest outside the project root", "rebuild the artifact")
            _copy(root / m, tree / "chain" / m)
        record = _read_json(engine / KILN_DIR / RECORD_FILE) or {}
        bench = (_read_json(engine / KILN_DIR / BENCH_FILE) or {}).get("metrics")
        doc = {"schema": SCHEMA, "registered_model": name, "version": version, "artifact": artifact,
               "kind": v.params.get("kiln.kind", "engine"), "manifest": f"engine/{artifact}.manifest.json",
               "manifest_xxh3_128": ident, "artifact_sha256": v.params["kiln.sha256"],
               "validation_manifest_xxh3_128": v.params["kiln.validation_manifest_xxh3_128"],
               "verdict": v.verdict.get("verdict"),
               "gate": "stored" if v.verdict.get("verdict") == "pass" else "attached",
               "model": v.manifest.get("model"), "target": v.manifest.get("target"),
               "precision": v.manifest.get("precision"), "chain": sorted(chain.manifests),
               "chain_root": chain.manifests[0]}
        lockfiles = _lockfiles()
        portable = _portable(chain.tree)
        engine_files = {f: e["sha256"] for e in v.manifest["files"] for f in [e["path"]]}
        _write(tree / "release.json", doc)
        _write(tree / "provenance.json", {"subject": rel, "chain": portable})
        _write(tree / "lockfiles.json", lockfiles)
        _write(tree / "slsa-provenance.json", slsa_statement(doc, engine_files, portable, record, v.verdict, bench,
                                                              lockfiles))
        from pipeline import report

        report.write(report.for_release(cfg, tree), tree / "report.html")    # from the release's own files only
        sign_tree(tree, Path(tmp) / f"{rel}{SIG_SUFFIX}", key)
        dest = out_dir / f"{rel}.tar.gz"
        staged = Path(tmp) / "archive.tar.gz"
        sha = write_archive(staged, Path(tmp), [rel, f"{rel}{SIG_SUFFIX}"])
        _place(staged, dest, sha)
        recorded = _record(reg, name, version, ref, dest, sha)
    return Release(dest, sha, name, version, recorded)


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def _write(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(json_bytes(obj))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def _bounded(path: Path, what: str) -> None:
    """Refuse a document of a release that is larger than any real one, before anything parses it."""
    size = path.stat().st_size if path.is_file() else 0
    if size > _MAX_DOC:
        raise GateFailed(f"{what}: {size} bytes; no document of a release is over {_MAX_DOC >> 20} MiB",
                         "do not use this release")


def _doc(path: Path, what: str) -> Any:
    """A JSON document of the release, bounded in size and nesting; None when missing or not JSON."""
    _bounded(path, what)
    try:
        return json.loads(path.read_bytes())
    except RecursionError:
        raise GateFailed(f"{what}: JSON nested too deeply for a release document", "do not use this release") from None
    except (OSError, ValueError):
        return None


def _manifest(path: Path, what: str) -> dict[str, Any]:
    """A manifest of the release (read_manifest's checks), bounded like every document; a gate failure if bad."""
    _bounded(path, what)
    try:
        return read_manifest(path)
    except RecursionError:
        raise GateFailed(f"{what}: JSON nested too deeply for a manifest", "do not use this release") from None
    except KilnError as e:
        raise GateFailed(f"{what}: {e.message}", "do not use this release") from None


def _place(staged: Path, dest: Path, sha: str) -> None:
    """Copy the archive to `dest` (whole or not at all); an existing archive is kept if identical and never
    overwritten if not."""
    from pipeline.manifest import atomic_path

    if dest.exists():
        if sha256_file(dest) == sha:
            return
        raise KilnError(f"{dest} exists with other bytes (sha256 {sha256_file(dest)}, this build {sha}); a release "
                        "is never overwritten", "move the old archive away deliberately, or pass --out DIR")
    try:
        with atomic_path(dest) as tmp:
            shutil.copyfile(staged, tmp)
    except OSError as e:          # full, over quota or `ulimit -f`, read-only, not ours: atomic_path removed its .tmp
        raise KilnError(f"cannot write {dest}: {e.strerror}",
                        "free space there (or pass --out DIR elsewhere), then run the same command again") from None


@contextmanager
def _writing(scratch: Path) -> Iterator[None]:
    """A full disk (or quota, or `ulimit -f`) while staging in the scratch folder or recording: one line naming
    where, not a traceback; the scratch folder itself is removed by its own context manager."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        where = e.filename2 or e.filename or f"in the temporary folder {scratch.parent}"
        raise KilnError(f"cannot write {where}: {e.strerror}",
                        "free space there, or point TMPDIR at a roomier filesystem, then run the command again") \
            from None


def _record(reg, name: str, version: int, ref: str, archive: Path, sha: str) -> bool:
    """Tag the version and append a `release` entry (with the archive) to the release history, once per archive.
    The alias moves with its record (move_alias); a kill before the final tag leaves a recorded move that the next
    release of the same archive completes instead of recording again."""
    from pipeline.registry.releases import AliasMove, actor_name, move_alias, now, settle

    with reg.lock(name):
        settle(reg, name)
        tags = reg.version(name, version).tags or {}
        if tags.get(RELEASE_TAG) == sha:
            return False
        reason = f"released {archive.name} sha256 {sha[:12]} (from {ref})"
        run_id = tags.get(f"{RELEASE_ALIAS}_release_run")
        if not (run_id and reg.aliases(name).get(RELEASE_ALIAS) == version
                and reg.client.get_run(run_id).data.tags.get("reason", "").startswith(reason.split(" (from")[0])):
            move_alias(reg, AliasMove(name, RELEASE_ALIAS, reg.aliases(name).get(RELEASE_ALIAS), version, "release",
                                      actor_name(), now(), reason))
            run_id = (reg.version(name, version).tags or {})[f"{RELEASE_ALIAS}_release_run"]   # stamped by it
        reg.client.log_artifact(run_id, str(archive))
        reg.client.set_model_version_tag(name, str(version), RELEASE_TAG, sha)      # last: marks it recorded
    return True


def release_all_production(cfg, root: Path = Path("."), key: Path | None = None, out_dir: Path | None = None,
                           on_release: Callable[[Release], None] | None = None) -> list[Release]:
    """Release every model's production version, in name order; `on_release` hears of each as it is written. The
    first failure stops the run and says which models were not released."""
    from pipeline.registry.client import Registry, errors, is_lock
    from pipeline.registry.releases import PRODUCTION

    reg = Registry(cfg, root)
    with errors(reg.uri):
        names = sorted(m.name for m in reg.client.search_registered_models(max_results=1000)
                       if not is_lock(m) and PRODUCTION in (m.aliases or {}))
    if not names:
        raise KilnError("no registered model has a production version", "promote one first (kiln promote NAME N)")
    made: list[Release] = []
    for i, n in enumerate(names):
        try:
            made.append(build(cfg, n, PRODUCTION, root, key, out_dir))
        except KilnError as e:
            left = ", ".join(names[i:])
            raise type(e)(f"{'' if n in e.message else n + ': '}{e.message} — not released: {left}; released "
                          f"{len(made)} of {len(names)}"
                          + (" (listed above)" if made else ""), e.hint) from None
        if on_release:
            on_release(made[-1])
    return made


# ---------------------------------------------------------------------------------------------- verifying a release
def verify(archive: Path, public_key: Path) -> list[str]:
    """Verify a release archive offline. Returns what was checked; raises GateFailed at the first failure."""
    archive, public_key = Path(archive), Path(public_key)
    if not archive.is_file():
        raise KilnError(f"{archive}: no such release archive", "pass the .tar.gz that `kiln release` wrote")
    _load_public_key(public_key)
    done: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kiln-verify-release-") as tmp, _writing(Path(tmp)):
        tmp = Path(tmp)
        safe_extract(archive, tmp, top_file_max=_MAX_DOC)
        top = sorted(p.name for p in tmp.iterdir())
        sigs = sorted(tmp.glob(f"*{SIG_SUFFIX}"))
        dirs = sorted(p for p in tmp.iterdir() if p.is_dir())
        if len(sigs) != 1 or len(dirs) != 1 or sigs[0].name != dirs[0].name + SIG_SUFFIX or len(top) != 2:
            found = ", ".join(repr(n[:100]) for n in top[:5]) + (f" and {len(top) - 5} more" if len(top) > 5 else "")
            raise GateFailed(f"{archive}: expected exactly <R>/ and <R>{SIG_SUFFIX} at the top, found {found}",
                             "get the archive again")
        tree, sig = dirs[0], sigs[0]
        _bounded(sig, sig.name)
        verify_tree(tree, sig, public_key)
        signed_name = _signed_name(sig)
        done.append(f"signature: model-signing bundle verified with {public_key.name}; every file's sha256 matches "
                    f"the signed statement (subject {signed_name[:200]!r}), none unsigned")
        try:
            done += _check_content(tree, signed_name)
        except KilnError as e:        # messages quote the release's own values: bounded, whatever they hold
            raise GateFailed(_one_line(e.message, 500), e.hint if isinstance(e, GateFailed) else
                             "do not use this release") from None
        except (KeyError, TypeError, AttributeError, ValueError, RecursionError) as e:   # signed, not Kiln's layout
            raise GateFailed(f"{tree.name}: release content is malformed ({type(e).__name__}: "
                             f"{_one_line(str(e), 200)})", "do not use this release") from None
    return done


def _load_public_key(path: Path) -> None:
    """A user error (exit 2), not a failed verification, when the key itself is missing or unusable."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = _read_key(Path(path), "public key", "pass the publisher's .pub key (kiln keygen writes it)")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise KilnError(f"{path}: not a PEM public key ({_one_line(str(e), 200)})",
                        "pass the publisher's public key (KEY.pub), not the private key") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise KilnError(f"{path}: not an EC public key", "pass the .pub written by kiln keygen")


def _signed_name(sig: Path) -> str:
    """The subject name inside the signed statement (model-signing: the signed directory's name)."""
    import base64

    try:
        bundle = json.loads(sig.read_bytes())
        statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
        return str(statement["subject"][0]["name"])
    except (ValueError, KeyError, IndexError, TypeError, RecursionError) as e:
        raise GateFailed(f"signature: unreadable statement ({_one_line(str(e), 200)})", "get the archive again") \
            from None


def _safe_rel(tree: Path, rel: Any, what: str) -> Path:
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise GateFailed(f"release.json: {what} {rel!r} is not a path inside the release", "do not use this release")
    return tree / rel


def _check_content(tree: Path, signed_name: str) -> list[str]:
    def fail(what: str, why: str) -> GateFailed:
        return GateFailed(f"{what}: {why}", "do not use this release")

    doc = _doc(tree / "release.json", "release.json")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise fail("release.json", f"missing or not schema {SCHEMA}")
    expected_name = f"{doc.get('registered_model')}-v{doc.get('version')}"
    if not (tree.name == signed_name == expected_name):     # a genuine release of something else, renamed
        raise fail("release.json", f"this is {expected_name}, but the archive's directory is {tree.name!r} and the "
                   f"signature's subject {signed_name!r}")
    paths.slug(doc.get("artifact"), "released artifact")
    mfile = _safe_rel(tree, doc.get("manifest"), "manifest")
    manifest = _manifest(mfile, doc["manifest"])
    if problems := check_files(mfile, manifest):
        raise fail(doc["manifest"], "; ".join(p.replace(str(tree) + os.sep, "") for p in problems[:3]))
    ident = identity_digest(manifest)
    if ident != doc.get("manifest_xxh3_128"):
        raise fail(doc["manifest"], f"identity {ident}, release.json says {doc.get('manifest_xxh3_128')}")
    from pipeline.manifest import artifact_digest

    if artifact_digest(manifest) != doc.get("artifact_sha256"):
        raise fail(doc["manifest"], "content digest differs from the registered one in release.json")
    done = [f"{doc.get('kind', 'engine')}: {doc['registered_model']} v{doc['version']}, {len(manifest['files'])} "
            f"file(s) match {doc['manifest']} (bytes, xxh3-128, sha256)"]
    vdir = mfile.parent / "kiln"
    vfile = manifest_path(vdir, doc["artifact"])
    vm = _manifest(vfile, f"engine/kiln/{vfile.name}")
    if check_files(vfile, vm) or identity_digest(vm) != doc.get("validation_manifest_xxh3_128"):
        raise fail(f"engine/kiln/{vfile.name}", "validation manifest or its files differ from the registered ones")
    verdict = _doc(vdir / paths.VALIDATION_FILE, f"engine/kiln/{paths.VALIDATION_FILE}")
    if not isinstance(verdict, dict) or verdict.get("engine_manifest_xxh3_128") != ident:
        raise fail(f"engine/kiln/{paths.VALIDATION_FILE}", "the validation is about another build")
    attached = verdict.get("verdict") == "not-run" and doc.get("gate") == "attached"
    if verdict.get("verdict") != "pass" and not attached:     # built-only: a pass by a host with the runtime
        raise fail(f"engine/kiln/{paths.VALIDATION_FILE}", f"verdict is {verdict.get('verdict')!r}, not 'pass'")
    done.append(f"validation: verdict {verdict.get('verdict')} about this exact build"
                + (" — the pass was attached by a host with the runtime and checked at release time; it is not in "
                   "the archive, so it cannot be re-checked offline" if attached else ""))
    chain_root = tree / "chain"
    start = _safe_rel(chain_root, doc.get("chain_root"), "chain_root")
    if not start.is_file() or identity_digest(_manifest(start, f"chain/{doc['chain_root']}")) != ident:
        raise fail("release.json", "chain_root is not this artifact's manifest")
    todo, seen, pinned, local = [(mfile, manifest)], set(), set(), set()
    while todo:
        path, m = todo.pop()
        where = path.relative_to(tree).as_posix()
        for ref in m["inputs"]:
            if "manifest" in ref:
                up = _safe_rel(chain_root, ref["manifest"], f"{where}: input")
                if not up.is_file():
                    raise fail(where, f"input {ref['manifest']} is not in the release's chain")
                um = _manifest(up, f"chain/{ref['manifest']}")
                if identity_digest(um) != ref.get("xxh3_128"):
                    raise fail(f"chain/{ref['manifest']}", f"identity {identity_digest(um)}, {m['name']} was built "
                               f"from {ref.get('xxh3_128')}")
                if ref["manifest"] not in seen:
                    seen.add(ref["manifest"])
                    todo.append((up, um))
            elif "path" in ref:
                owner = _check_file_input(chain_root, ref, where, fail)
                (pinned if owner else local).add(ref["path"])
                if owner:
                    seen.add(owner)
    listed = set(doc.get("chain", []))
    if missing := sorted(listed - seen - {doc["chain_root"]}):
        raise fail("release.json", f"chain lists {missing[0]}, which no manifest links to")
    if unlisted := sorted(seen - listed):
        raise fail("release.json", f"{unlisted[0]} is linked but not listed in the chain")
    done.append(f"chain: {len(seen)} upstream manifests, every link's identity digest matches; {len(pinned)} "
                "weight/photo file(s) are files (same sha256) of a shipped manifest with PyPI pins"
                + (f"; {len(local)} local input file(s) are known by digest only (no package pin)" if local else ""))
    st = _doc(tree / "slsa-provenance.json", "slsa-provenance.json")
    if not isinstance(st, dict) or st.get("predicateType") != SLSA_PREDICATE:
        raise fail("slsa-provenance.json", "missing or not a SLSA Provenance v1 statement")
    subjects = {s.get("name"): (s.get("digest") or {}).get("sha256") for s in st.get("subject", [])}
    expected = {f"engine/{e['path']}": e["sha256"] for e in manifest["files"]}
    if subjects != expected:
        raise fail("slsa-provenance.json", "its subjects are not exactly the released files and digests")
    done.append(f"slsa: {len(subjects)} subject(s) = the released files; "
                f"{len(st['predicate']['buildDefinition']['resolvedDependencies'])} resolved dependencies")
    return done


def _check_file_input(chain_root: Path, ref: dict, where: str, fail) -> str | None:
    """A plain input (weights, photo) must be a file, with the same sha256, of a manifest shipped in chain/ (the
    assets', which carries the pins); returns that manifest's chain path, or None for a local file outside the
    project (a user's photo folder), which only its digest identifies."""
    rel = Path(ref["path"])
    if rel.is_absolute() or ".." in rel.parts:
        return None
    for d in rel.parents:
        folder = chain_root / d
        for m in sorted(p for p in folder.glob("*.manifest.json") if p.is_file()) if folder.is_dir() else []:
            doc = _manifest(m, f"chain/{m.relative_to(chain_root).as_posix()}")
            member = rel.relative_to(d).as_posix()
            entry = next((e for e in doc["files"] if isinstance(e, dict) and e.get("path") == member), None)
            if entry is not None:
                if entry.get("sha256") != ref.get("sha256"):
                    raise fail(where, f"input {ref['path']} has sha256 {ref.get('sha256')}, the shipped "
                               f"{m.relative_to(chain_root).as_posix()} says {entry.get('sha256')}")
                return m.relative_to(chain_root).as_posix()
    raise fail(where, f"input file {ref['path']} is not a file of any manifest in the chain")


__all__ = ["KEY_ENV", "Release", "build", "keygen", "release_all_production", "verify", "write_archive"]
