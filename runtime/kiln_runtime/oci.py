"""A system release as an OCI artifact in any OCI registry: `kiln push` writes it, `kiln-run pull` (and `serve`,
`verify`, `identify`, `bench` given a reference) fetches it. The registry protocol — auth, TLS, uploads — is the ORAS
project's Python client (oras-py); nothing the registry says is trusted: the manifest's digest, every blob's digest
and size, then the release's signature and content decide, and only then is anything placed.

The artifact (OCI image-spec v1.1, artifact guidance):

    manifest  application/vnd.oci.image.manifest.v1+json, artifactType ARTIFACT_TYPE, the empty config descriptor,
              annotations: org.opencontainers.image.{title,version,description} and dev.kiln.* (system, version,
              verdict, the system's content digest, each part's engine and identity digest, the archive's sha256)
    layer     the release archive exactly as `kiln release --system` wrote it (LAYER_TYPE; its file name in the
              org.opencontainers.image.title annotation)

One layer, the archive itself: the archive already holds the model-signing bundle (`<R>.sig`) beside the tree it
signs, so the file a host pulls is byte for byte the file `kiln-run verify` checks, whatever the transport (a
registry, scp, a bucket), and a pull needs exactly one blob. Files as layers would let two versions share unchanged
engines' blobs, but the host would have to reassemble the archive before it could verify anything. The manifest is
serialised canonically (sorted keys, no spaces) from the archive's signed content only — no time, host or path — so
pushing the same release twice gives the same manifest digest.

A reference is `[oci://]HOST[:PORT]/PATH/NAME[:TAG][@sha256:HEX]`. NAME is the system's name (lower case, as OCI
repository names are); a TAG that is a version (`3`, `v3`) must be the signed release's version, other tags (`prod`,
`latest`) are channels. The pulled release must be system NAME — so a tag re-pointed at another system's archive, or
at another version under a version tag, fails even though that archive's signature holds. A digest pins the manifest.

Credentials: KILN_OCI_USERNAME and KILN_OCI_PASSWORD, else the docker config file ($DOCKER_CONFIG/config.json, else
~/.docker/config.json: `auths`, `credHelpers`, `credsStore`, as docker reads them) — never from argv or params, never
printed. TLS is verified against the system's trust store, or SSL_CERT_FILE (a private CA); `--plain-http` only
where asked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from kiln_runtime.errors import GateFailed, KilnError
from kiln_runtime.text import shown

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.kiln.system-release.v1"
LAYER_TYPE = "application/vnd.kiln.system-release.v1.tar+gzip"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
EMPTY_DESCRIPTOR = {"mediaType": EMPTY_TYPE, "digest": "sha256:" + hashlib.sha256(EMPTY).hexdigest(), "size": 2}
TITLE = "org.opencontainers.image.title"
PREFIX = "dev.kiln."
MAX_MANIFEST = 4 << 20            # the OCI distribution spec's suggested manifest limit
MAX_BLOB = 4 << 30                # the default ceiling on a release archive's size (`kiln-run pull --max-bytes`)
TIMEOUT_S = 30.0                  # per connect and per read: a registry that stops answering is an error, not a hang
USER_ENV, PASSWORD_ENV = "KILN_OCI_USERNAME", "KILN_OCI_PASSWORD"

_HOST = r"(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?|[A-Za-z0-9-]+:[0-9]{1,5}"
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
REF = re.compile(rf"(?:oci://)?(?P<host>{_HOST})/(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
                 r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
VERSION_TAG = re.compile(r"v?([0-9]+)")


@dataclass(frozen=True)
class Ref:
    host: str                 # HOST[:PORT]
    path: str                 # PATH/NAME, the repository
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def reference(self) -> str:
        """What the registry is asked for: the digest when there is one (the tag is then only a label)."""
        return self.digest or self.tag or ""

    def __str__(self) -> str:
        return f"{self.host}/{self.path}" + (f":{self.tag}" if self.tag else "") + \
            (f"@{self.digest}" if self.digest else "")


def is_ref(text: str) -> bool:
    """Whether `text` reads as a registry reference: oci://…, or HOST/PATH with a :TAG or an @DIGEST (a file that
    exists is a file: callers look first)."""
    m = REF.fullmatch(text)
    return bool(m) and (text.startswith("oci://") or bool(m["tag"] or m["digest"]))


def parse_ref(text: str, need_tag: bool = False) -> Ref:
    m = REF.fullmatch(text)
    if not m:
        raise KilnError(f"{shown(text, 200)} is not an OCI reference",
                        "write HOST[:PORT]/PATH/NAME:TAG or HOST[:PORT]/PATH/NAME@sha256:DIGEST, lower-case path, "
                        "e.g. registry.example.com/kiln/frontdoor:3")
    ref = Ref(m["host"], m["path"], m["tag"], m["digest"])
    if need_tag and not ref.tag:
        raise KilnError(f"{ref}: a push needs a tag", f"add one, e.g. {ref.host}/{ref.path}:VERSION")
    if not ref.tag and not ref.digest:
        raise KilnError(f"{ref}: names no tag and no digest", "add :TAG or @sha256:DIGEST")
    return ref


def bind(ref: Ref, system: str, version: int) -> None:
    """The reference must name what the signed release is: its system as the repository's last component, and its
    version when the tag is a version. GateFailed otherwise — a tag is a hint, and this one points elsewhere."""
    if ref.name != system.lower():
        raise GateFailed(f"{ref}: the signed release is system {shown(system, 64)!r} v{version}, but the reference "
                         f"names {ref.name!r}", "a tag was re-pointed, or this is not the release you asked for: pull "
                         "the system's own repository (…/" + shown(system.lower(), 64) + ") by digest")
    m = VERSION_TAG.fullmatch(ref.tag or "")
    if m and int(m[1]) != version:
        raise GateFailed(f"{ref}: the tag says version {m[1]}, but the signed release is {shown(system, 64)} "
                         f"v{version}", "the tag was re-pointed: pull by the digest `kiln push` printed")


def annotations(doc: dict[str, Any], archive_name: str, archive_sha256: str) -> dict[str, str]:
    """The manifest's annotations, from a verified release's release.json: standard keys where they fit, the rest
    under dev.kiln. Strings only (the OCI rule); nothing here depends on time, host or path."""
    system, version = str(doc["system"]), str(doc["version"])
    out = {TITLE: archive_name, "org.opencontainers.image.version": version,
           "org.opencontainers.image.description": f"Kiln face system {system} v{version} (signed release)",
           PREFIX + "system": system, PREFIX + "version": version, PREFIX + "verdict": str(doc.get("verdict")),
           PREFIX + "system.sha256": str(doc.get("system_sha256")), PREFIX + "archive.sha256": archive_sha256}
    for p in doc.get("parts") or []:
        out[f"{PREFIX}part.{p['model']}"] = f"{p['engine']} v{p['version']} xxh3_128:{p['xxh3_128']}"
    return out


def manifest_bytes(layer: dict[str, Any], notes: dict[str, str]) -> bytes:
    doc = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
           "config": EMPTY_DESCRIPTOR, "layers": [layer], "annotations": notes}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------------------------------------- the registry
def _docker_config() -> str | None:
    folder = os.environ.get("DOCKER_CONFIG")
    path = Path(folder) / "config.json" if folder else Path.home() / ".docker" / "config.json"
    return str(path) if path.is_file() else None


class Registry:
    """One registry, through oras-py: the auth scheme the registry asks for (basic, or a bearer token fetched with
    the credentials), bounded waits, at most one quick retry, and every failure as one KilnError line."""

    def __init__(self, ref: Ref, plain_http: bool = False) -> None:
        import logging

        import oras.provider              # first: importing oras.decorator before it is a circular import in oras-py
        import requests
        from requests.adapters import HTTPAdapter

        oras.provider.logger.set_level(logging.CRITICAL)        # its own log lines would break the one-line errors

        class _Bounded(HTTPAdapter):
            def send(self, request, **kw):                    # noqa: ANN001 — requests' signature
                kw["timeout"] = kw.get("timeout") or TIMEOUT_S
                return super().send(request, **kw)

        class _Client(oras.provider.Registry):
            # oras-py retries a failed request 5 times over ~2 minutes; one quick retry, then the error
            do_request = oras.provider.decorator.retry(attempts=1, timeout=0)(
                oras.provider.Registry.do_request.__wrapped__)

        self.ref, self.requests = ref, requests
        self.scheme = "http" if plain_http else "https"
        verify = os.environ.get("SSL_CERT_FILE") or True
        probe = requests.Session()
        probe.mount("https://", _Bounded())
        probe.mount("http://", _Bounded())
        with self._errors():
            challenge = probe.get(f"{self.scheme}://{ref.host}/v2/", verify=verify).headers.get("WWW-Authenticate", "")
        backend = "basic" if challenge.lower().startswith("basic") else "token"
        self.client = _Client(hostname=ref.host, insecure=plain_http, tls_verify=verify, auth_backend=backend)
        self.client.session.mount("https://", _Bounded())     # the auth backend shares this session
        self.client.session.mount("http://", _Bounded())
        self.container = self.client.get_container(f"{ref.host}/{ref.path}:{ref.tag or 'latest'}")
        user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
        self.client.auth.logout(ref.host)                      # start with no credentials, then find them
        if user and password:
            self.client.auth.set_basic_auth(user, password)
        else:
            self.client.auth.load_configs(self.container, configs=[c] if (c := _docker_config()) else None)
        if backend == "basic" and getattr(self.client.auth, "_basic_auth", None):
            # sent with every request, not after a 401: a registry answers a large upload's 401 before reading
            # its body and closes the connection mid-send (oras-py's upload_blob sends these headers)
            self.client.headers.update(self.client.auth.get_auth_header())

    @contextmanager
    def _errors(self) -> Iterator[None]:
        r = self.requests.exceptions
        host = self.ref.host
        try:
            yield
        except r.SSLError:
            raise KilnError(f"{host}: the registry's TLS certificate did not verify",
                            "trust its CA (SSL_CERT_FILE=ca.crt), or pass --plain-http for a registry without "
                            "TLS") from None
        except (r.ConnectionError, r.Timeout, r.ChunkedEncodingError) as e:
            import urllib3

            # a read timeout while streaming a body comes as ConnectionError(ReadTimeoutError)
            stalled = isinstance(e, r.Timeout) or any(isinstance(a, urllib3.exceptions.TimeoutError) for a in e.args)
            why = "it stopped answering" if stalled else "the connection failed or was cut"
            raise KilnError(f"{host}: cannot reach the registry ({why})", "check that the registry is up and "
                            "reachable from this host, then run the command again; nothing was placed") from None
        except ValueError as e:                # oras-py's own failures (an auth or upload step the registry refused)
            raise KilnError(f"{host}: the registry refused the request ({shown(str(e), 200)})",
                            "check the reference and your credentials (KILN_OCI_USERNAME / KILN_OCI_PASSWORD or "
                            "docker login)") from None

    def _url(self, kind: str, reference: str) -> str:
        return f"{self.scheme}://{self.ref.host}/v2/{self.ref.path}/{kind}/{reference}"

    def _status(self, response, what: str) -> None:
        if response.status_code in (401, 403):
            raise KilnError(f"{self.ref.host}: the registry refused the credentials ({response.status_code}) for "
                            f"{what}", f"set {USER_ENV} and {PASSWORD_ENV}, or log in with docker (docker login "
                            f"{self.ref.host}); needs {'push' if what.startswith('push') else 'pull'} access")
        if response.status_code == 404:
            raise KilnError(f"{self.ref}: not found in the registry ({what})", "check the reference: "
                            "repository, tag or digest")
        if response.status_code >= 300:
            raise KilnError(f"{self.ref.host}: {what} failed ({response.status_code} {shown(response.reason, 80)})",
                            "see the registry's log")

    # ------------------------------------------------------------------------------------------ pull side
    def manifest(self) -> tuple[bytes, str]:
        """The manifest's bytes (at most MAX_MANIFEST) and their digest — computed here, never taken from the
        registry; equal to the reference's digest when it has one."""
        with self._errors():
            r = self.client.do_request(self._url("manifests", self.ref.reference), "GET",
                                       headers={**self.client.headers, "Accept": MANIFEST_TYPE}, stream=True)
            with r:
                self._status(r, "the manifest")
                raw = _bounded_read(r, MAX_MANIFEST, f"{self.ref}: the manifest")
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if self.ref.digest and digest != self.ref.digest:
            raise GateFailed(f"{self.ref}: the registry served a manifest whose digest is {digest}",
                             "the registry or something between is not serving what was pushed; nothing was placed")
        return raw, digest

    def blob(self, descriptor: dict[str, Any], out: Path) -> None:
        """Stream one blob into `out`: never more than its declared size, and its sha256 must be its digest."""
        digest, size = descriptor["digest"], descriptor["size"]
        h, n = hashlib.sha256(), 0
        with self._errors():
            r = self.client.do_request(self._url("blobs", digest), "GET", headers=dict(self.client.headers),
                                       stream=True)
            with r:
                self._status(r, f"blob {digest[:19]}…")
                declared = r.headers.get("Content-Length")
                if declared and declared.isdigit() and int(declared) > size:
                    raise GateFailed(f"{self.ref}: blob {digest} is served with {int(declared)} bytes, its "
                                     f"descriptor says {size}", "the registry is not serving what was pushed; "
                                     "nothing was placed")
                with open(out, "wb") as f:
                    for chunk in r.iter_content(1 << 20):
                        n += len(chunk)
                        if n > size:
                            raise GateFailed(f"{self.ref}: blob {digest} runs past its declared {size} bytes",
                                             "the registry is not serving what was pushed; nothing was placed")
                        h.update(chunk)
                        f.write(chunk)
        if n != size or "sha256:" + h.hexdigest() != digest:
            raise GateFailed(f"{self.ref}: blob {digest} does not match its digest ({n} bytes received, "
                             f"sha256:{h.hexdigest()[:16]}…)", "the registry is not serving what was pushed; "
                             "nothing was placed")

    # ------------------------------------------------------------------------------------------ push side
    def push_blob(self, path: Path, descriptor: dict[str, Any]) -> bool:
        """Upload one blob unless the repository has it; whether it was uploaded."""
        with self._errors():
            head = self.client.do_request(self._url("blobs", descriptor["digest"]), "HEAD",
                                          headers=dict(self.client.headers))
            if head.status_code == 200:
                return False
            if head.status_code != 404:               # 404: not there yet, upload it
                self._status(head, "push (checking a blob)")
            r = self.client.upload_blob(str(path), self.container, descriptor)
            self._status(r, f"push of blob {descriptor['digest'][:19]}…")
        return True

    def put_manifest(self, raw: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        with self._errors():
            r = self.client.do_request(self._url("manifests", self.ref.tag or digest), "PUT", data=raw,
                                       headers={**self.client.headers, "Content-Type": MANIFEST_TYPE})
            self._status(r, "push of the manifest")
        said = r.headers.get("Docker-Content-Digest")
        if said and said != digest:
            raise KilnError(f"{self.ref.host}: the registry stored the manifest as {said}, not {digest}",
                            "this registry rewrites manifests; use another registry")
        return digest


def _bounded_read(response, limit: int, what: str) -> bytes:
    data = bytearray()
    for chunk in response.iter_content(1 << 16):
        data += chunk
        if len(data) > limit:
            raise GateFailed(f"{what} is larger than {limit >> 20} MiB", "this is not a Kiln release manifest")
    return bytes(data)


# ---------------------------------------------------------------------------------------------- push
@dataclass(frozen=True)
class Pushed:
    ref: Ref
    digest: str               # the manifest's
    layer: dict[str, Any]
    uploaded: bool            # False: the registry already had the archive's blob


def push(archive: Path, ref: Ref, doc: dict[str, Any], plain_http: bool = False) -> Pushed:
    """Push a verified release archive (`doc`: its release.json) as REF; the manifest digest."""
    bind(ref, str(doc["system"]), int(doc["version"]))
    digest = _sha256(archive)
    layer = {"mediaType": LAYER_TYPE, "digest": digest, "size": archive.stat().st_size,
             "annotations": {TITLE: archive.name}}
    raw = manifest_bytes(layer, annotations(doc, archive.name, digest))
    reg = Registry(ref, plain_http)
    with tempfile.TemporaryDirectory(prefix="kiln-push-") as tmp:
        empty = Path(tmp) / "config.json"
        empty.write_bytes(EMPTY)
        reg.push_blob(empty, EMPTY_DESCRIPTOR)
    uploaded = reg.push_blob(archive, layer)
    return Pushed(ref, reg.put_manifest(raw), layer, uploaded)


# ---------------------------------------------------------------------------------------------- pull
def _layer(raw: bytes, ref: Ref, max_bytes: int) -> dict[str, Any]:
    """The one release layer of a Kiln manifest, its descriptor checked before a byte of it is fetched."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise GateFailed(f"{ref}: the manifest is not JSON", "this is not a Kiln release") from None
    if not isinstance(doc, dict) or doc.get("mediaType", MANIFEST_TYPE) != MANIFEST_TYPE or \
            doc.get("artifactType") != ARTIFACT_TYPE:
        got = doc.get("artifactType") if isinstance(doc, dict) else None
        raise GateFailed(f"{ref}: not a Kiln system release (artifactType {shown(str(got), 80)})",
                         "pull a reference `kiln push` wrote")
    layers = doc.get("layers")
    if not isinstance(layers, list) or len(layers) != 1 or not isinstance(layers[0], dict):
        raise GateFailed(f"{ref}: a Kiln release manifest has exactly one layer", "pull a reference `kiln push` wrote")
    layer = layers[0]
    size = layer.get("size")
    if layer.get("mediaType") != LAYER_TYPE or not isinstance(layer.get("digest"), str) or \
            not DIGEST.fullmatch(layer["digest"]) or not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise GateFailed(f"{ref}: the release layer's descriptor is malformed", "pull a reference `kiln push` wrote")
    if size > max_bytes:
        raise GateFailed(f"{ref}: the release layer declares {size} bytes, more than the {max_bytes} allowed",
                         "if a release really is that large, pass --max-bytes; nothing was fetched")
    return layer


@dataclass(frozen=True)
class Pulled:
    ref: Ref
    digest: str               # the manifest's
    archive: Path             # where the verified archive now is
    system: str
    version: int
    checked: list[str]
    placed: bool              # False: the same bytes were already there


def pull(ref: Ref, public_key: Path, out_dir: Path, plain_http: bool = False, max_bytes: int = MAX_BLOB,
         progress: Callable[[str], None] | None = None) -> Pulled:
    """Fetch REF, check every digest, verify the release (signature, then content, as `kiln-run verify`) and that
    it is what REF names; only then place the archive in `out_dir` (a rename: a failed pull leaves nothing)."""
    from kiln_runtime import release, signature

    signature.load_public_key(public_key)                  # a bad key is refused before the network
    out_dir = Path(out_dir)
    staging = out_dir if out_dir.is_dir() else out_dir.parent       # the same filesystem: the rename is atomic
    if not staging.is_dir():
        raise KilnError(f"{out_dir}: its folder {staging} does not exist", "create it, or pass --out in an existing "
                        "folder")
    reg = Registry(ref, plain_http)
    raw, digest = reg.manifest()
    layer = _layer(raw, ref, max_bytes)
    if progress:
        progress(f"pulling {ref}{'' if ref.digest else ' → ' + digest} (1 layer, {layer['size'] / 1e6:.1f} MB)")
    fd, tmp_name = tempfile.mkstemp(prefix=".kiln-pull-", suffix=".tar.gz", dir=staging)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with release.writing(tmp):
            reg.blob(layer, tmp)
        try:
            with release.verified(tmp, public_key) as (tree, checked):
                doc = json.loads((tree / "release.json").read_bytes())
                system, version = str(doc["system"]), int(doc["version"])
                bind(ref, system, version)
        except KilnError as e:                # name what was pulled, not the temporary file it was checked in
            e.message = e.message.replace(str(tmp), f"{ref} ({digest})")
            raise
        dest = out_dir / f"{release.registered(system)}-v{version}.tar.gz"
        placed = not dest.exists() and not dest.is_symlink()
        if not placed and (dest.is_symlink() or not dest.is_file() or _sha256(dest) != layer["digest"]):
            raise KilnError(f"{dest} exists with other bytes", "nothing released is overwritten: pull into another "
                            "--out folder, or move that file away")
        if placed:
            out_dir.mkdir(exist_ok=True)
            os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return Pulled(ref, digest, dest, system, version, checked, placed)


@contextmanager
def local(source: str, public_key: Path, plain_http: bool = False,
          progress: Callable[[str], None] | None = None) -> Iterator[Path]:
    """`source` as a local archive path: a file as it is, a registry reference pulled and verified into a private
    temporary folder (removed on exit). For the commands that take either."""
    if Path(source).exists() or not is_ref(source):
        yield Path(source)
        return
    ref = parse_ref(source)
    with tempfile.TemporaryDirectory(prefix="kiln-run-pull-") as tmp:
        got = pull(ref, public_key, Path(tmp) / "release", plain_http, progress=progress)
        if progress:
            progress(f"pulled {ref}{'' if ref.digest else ' (' + got.digest + ')'}: {got.system} v{got.version}")
        yield got.archive
