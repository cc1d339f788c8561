"""`kiln release` / `kiln verify-release`: one signed, deterministic archive per released version.

A release is built from a *registered* version (downloaded and proven like `promote` proves it: stored files against
the stored manifest, manifest and verdict against the digests logged as run parameters, verdict pass) plus the
provenance chain of that exact build in this workspace (`pipeline/release/provenance.py`, every link re-verified). The
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

Signing (offline, deterministic, EC P-256): pipeline/release/signing.py. The SLSA statement:
pipeline/release/attestation.py. The tar is deterministic too: sorted entries, mtime 0, uid/gid 0, fixed modes, gzip
without name or time.

`verify-release` needs no MLflow and no network, and reads with the deployment runtime's code (kiln_runtime/release.py
`verified`: what `kiln-run verify` runs on a host). It reads the archive once, as a stream, as strictly as it was
written (kiln_runtime/archive.py), so GNU tar can find nothing in it that the verifier did not check. Then the
signature and every file's digest are verified against the signed statement (kiln_runtime/signature.py: nothing
unsigned is accepted; model-signing's own verifier accepts the same bundles), and Kiln re-checks the
engine against its manifest, the verdict, every manifest link of the chain and the SLSA subjects, reading no
document over a fixed size (pipeline/release/content.py). The first failure is named and the exit code is 1.

A face system's release (`kiln release --system NAME`: every engine, the system manifest, the config slice and the
gallery in one archive) is pipeline/release/system.py, built on this module; its `verify` reads either kind
(`kiln verify-release` dispatches on release.json's schema there).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kiln_runtime.release import writing as _writing  # a full disk while staging: one line, as when extracting
from pipeline import paths
from pipeline.errors import GateFailed, KilnError
from pipeline.manifest import identity_digest, json_bytes, manifest_path, sha256_file
from pipeline.release import attestation, signing
from pipeline.release.archive import safe_extract, write_archive  # noqa: F401 — safe_extract: tests read with it
from pipeline.release.content import SCHEMA, check_content

if TYPE_CHECKING:
    from pipeline.config import Config

RELEASES = Path("releases")
SIG_SUFFIX = ".sig"
RELEASE_ALIAS = "release"                         # the registered model's alias of its latest released version
RELEASE_TAG = "kiln.release.sha256"               # on the version: its release archive's sha256


@dataclass(frozen=True)
class Release:
    archive: Path
    sha256: str
    name: str                 # registered model
    version: int
    new: bool                 # False: this exact archive was already released (and recorded) before


# ---------------------------------------------------------------------------------------------- building a release
def _resolve_version(reg, name: str, ref: str) -> int:
    from pipeline.registry.aliases import PRODUCTION, SYSTEMS, production_pins

    if ref.lstrip("v").isdigit():
        return int(ref.lstrip("v"))
    paths.slug(ref, "alias")
    version = reg.aliases(name).get(ref)
    if version is None:
        raise KilnError(f"{name}: no version has the alias {ref!r}",
                        f"promote one first (kiln promote {name} VERSION)" if ref == PRODUCTION else
                        f"see the aliases with: kiln history {name}")
    if ref == PRODUCTION:       # what production runs is the production system's pin, where a system runs it
        for pin in production_pins(reg):
            if pin.registered_model == name and pin.version != int(version):
                system = pin.system.removeprefix(SYSTEMS)
                raise KilnError(f"{name}: its production alias is v{version}, but production system {system} "
                                f"v{pin.system_version} runs v{pin.version}", f"release the system (kiln release "
                                f"--system {system}), or name the version: kiln release {name} {pin.version}")
    return int(version)


def build(cfg: Config, name: str, ref: str, root: Path = Path("."), key: Path | None = None,
          out_dir: Path | None = None) -> Release:
    """Release version `ref` (a number or an alias) of registered model `name` as a signed deterministic archive."""
    from pipeline.release import provenance
    from pipeline.registry.client import Registry, errors, registered_name
    from pipeline.registry.registration import BENCH_FILE, RECORD_FILE
    from pipeline.registry.aliases import KILN_DIR, gate_verified, download_verified

    root = Path(root)
    key = signing.key_path(str(key) if key else None)
    if not key.is_file():
        raise KilnError(f"{key}: signing key not found", "make one with `kiln keygen --out PATH`")
    signing.outside_repo(key, "signing key")
    out_dir = Path(out_dir) if out_dir else root / RELEASES
    name = registered_name(cfg, name)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-release-") as tmp, _writing(Path(tmp)):
        reg.require_model(name)
        version = _resolve_version(reg, name, ref)
        v = download_verified(reg, name, version, Path(tmp) / "download")
        gate_verified(reg, name, version, v, Path(tmp) / "attached")        # a release passes what promote demands
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
            copy_file(v.directory / f, engine / f)
        for f in sorted((v.directory / KILN_DIR).iterdir()):
            copy_file(f, engine / KILN_DIR / f.name)
        for m in chain.manifests:                  # root-relative by construction (provenance refuses others)
            if Path(m).is_absolute() or ".." in Path(m).parts:
                raise KilnError(f"{m}: a chain manifest outside the project root", "rebuild the artifact")
            copy_file(root / m, tree / "chain" / m)
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
        lockfiles = attestation.lockfiles()
        portable = attestation.portable(chain.tree)
        engine_files = {f: e["sha256"] for e in v.manifest["files"] for f in [e["path"]]}
        write_json(tree / "release.json", doc)
        write_json(tree / "provenance.json", {"subject": rel, "chain": portable})
        write_json(tree / "lockfiles.json", lockfiles)
        write_json(tree / "slsa-provenance.json", attestation.slsa_statement(doc, engine_files, portable, record,
                                                                          v.verdict, bench, lockfiles))
        from pipeline.report import page as report

        report.write(report.for_release(cfg, tree), tree / "report.html")    # from the release's own files only
        signing.sign_tree(tree, Path(tmp) / f"{rel}{SIG_SUFFIX}", key)
        dest = out_dir / f"{rel}.tar.gz"
        staged = Path(tmp) / "archive.tar.gz"
        sha = write_archive(staged, Path(tmp), [rel, f"{rel}{SIG_SUFFIX}"])
        place_archive(staged, dest, sha)
        recorded = record_release(reg, name, version, ref, dest, sha)
    return Release(dest, sha, name, version, recorded)


def copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(json_bytes(obj))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def place_archive(staged: Path, dest: Path, sha: str) -> None:
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


def record_release(reg, name: str, version: int, ref: str, archive: Path, sha: str, locked: bool = False) -> bool:
    """Tag the version and append a `release` entry (with the archive) to the release history, once per archive.
    The alias moves with its record (move_alias); a kill before the final tag leaves a recorded move that the next
    release of the same archive completes instead of recording again. `locked`: the caller holds the model's lock
    (it resolved an alias under it), else it is taken here."""
    from contextlib import nullcontext

    from pipeline.registry.aliases import AliasMove, actor_name, move_alias, now, settle

    with nullcontext() if locked else reg.lock(name):
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


def release_all_production(cfg: Config, root: Path = Path("."), key: Path | None = None, out_dir: Path | None = None,
                           on_release: Callable[[Release], None] | None = None,
                           build_system: Callable[..., Release] | None = None) -> list[Release]:
    """Release every model's production version, in name order; `on_release` hears of each as it is written. The
    first failure stops the run and says which models were not released. A face system's production version
    (kiln-system-NAME) is released by `build_system` (pipeline/release/system.py `build`, which builds on this
    module); without it, one is an error."""
    from pipeline.registry.systems import is_system

    from pipeline.registry.client import Registry, errors, is_lock
    from pipeline.registry.aliases import PRODUCTION

    reg = Registry(cfg, root)
    with errors(reg.uri):
        names = sorted(m.name for m in reg.client.search_registered_models(max_results=1000)
                       if not is_lock(m) and PRODUCTION in (m.aliases or {}))
    if not names:
        raise KilnError("no registered model has a production version", "promote one first (kiln promote NAME N)")
    made: list[Release] = []
    for i, n in enumerate(names):
        try:
            if is_system(n) and build_system is None:
                raise KilnError(f"{n} is a face system", "release it with `kiln release --system` "
                                "(pipeline/release/system.py)")
            made.append((build_system if is_system(n) else build)(cfg, n, PRODUCTION, root, key, out_dir))
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
    with verified(archive, public_key) as (_, done):
        return done


def verified(archive: Path, public_key: Path, check: Callable[[Path, str], list[str]] = check_content):
    """Verify a release archive offline and yield (the signed tree, extracted in a private temporary folder, what was
    checked); the folder is removed on exit. kiln_runtime.release `verified` (a deployment host's, the one
    implementation) with `check(tree, signed name)`: an engine release's content check by default;
    pipeline/release/system.py passes one that reads a system's release too."""
    from kiln_runtime.release import verified as runtime_verified

    return runtime_verified(archive, public_key, check)


__all__ = ["Release", "build", "release_all_production", "verified", "verify", "write_archive"]
