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
from kiln_runtime.files import scratch
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

    def _redact(self, text: str, limit: int = 200) -> str:
        """Text a registry (or a proxy) controls, as Kiln prints it: the credentials in any form it could echo
        (the password, `user:password` and its base64, an Authorization header's value) replaced by ***, then
        escaped and bounded (`shown`)."""
        import base64

        user, password = os.environ.get(USER_ENV) or "", os.environ.get(PASSWORD_ENV) or ""
        secrets = [password, f"{user}:{password}", base64.b64encode(f"{user}:{password}".encode()).decode()] \
            if password else []
        auth = getattr(getattr(self, "client", None), "headers", {}).get("Authorization", "")
        secrets += [auth, auth.partition(" ")[2]] if auth else []
        for secret in sorted({x for x in secrets if len(x) >= 4}, key=len, reverse=True):
            text = text.replace(secret, "***")
        text = re.sub(r"(?i)\b(basic|bearer)\s+[A-Za-z0-9._~+/=-]{8,}", r"\1 ***", text)
        return shown(text, limit)

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
        except r.TooManyRedirects:
            raise KilnError(f"{host}: the registry redirected too many times (a redirect loop)",
                            "check the registry's address and its proxy; nothing was placed") from None
        except r.ContentDecodingError:
            raise KilnError(f"{host}: a response's body does not decode as its Content-Encoding says",
                            "the registry or a proxy between is corrupting responses; nothing was placed") from None
        except r.RequestException as e:        # any other failure of the HTTP exchange itself
            raise KilnError(f"{host}: the request failed ({type(e).__name__})", "check the registry and the network "
                            "between; nothing was placed") from None
        except RecursionError:
            raise GateFailed(f"{self.ref}: a registry response is nested too deeply to read",
                             "this is not a Kiln release; nothing was placed") from None
        except ValueError as e:                # oras-py's own failures (an auth or upload step the registry refused)
            raise KilnError(f"{host}: the registry refused the request ({self._redact(str(e))})",
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
        if response.status_code >= 300:       # the standard phrase: the registry's own reason may echo anything
            raise KilnError(f"{self.ref.host}: {what} failed ({response.status_code} "
                            f"{_phrase(response.status_code)})", "see the registry's log")

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


def _phrase(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "(a status HTTP does not define)"


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


def release_manifest(archive: Path, doc: dict[str, Any]) -> tuple[bytes, str, dict[str, Any]]:
    """A release's own manifest (canonical: one release, one digest), its digest and its layer."""
    digest = _sha256(archive)
    layer = {"mediaType": LAYER_TYPE, "digest": digest, "size": archive.stat().st_size,
             "annotations": {TITLE: archive.name}}
    raw = manifest_bytes(layer, annotations(doc, archive.name, digest))
    return raw, "sha256:" + hashlib.sha256(raw).hexdigest(), layer


def push(archive: Path, ref: Ref, doc: dict[str, Any], plain_http: bool = False) -> Pushed:
    """Push a verified release archive (`doc`: its release.json) as REF (a version tag; no tag: by its digest
    only); the manifest digest."""
    bind(ref, str(doc["system"]), int(doc["version"]))
    raw, _, layer = release_manifest(archive, doc)
    reg = Registry(ref, plain_http)
    with scratch("push") as tmp:
        empty = tmp / "config.json"
        empty.write_bytes(EMPTY)
        reg.push_blob(empty, EMPTY_DESCRIPTOR)
    uploaded = reg.push_blob(archive, layer)
    return Pushed(ref, reg.put_manifest(raw), layer, uploaded)


# ---------------------------------------------------------------------------------------------- pull
def _manifest_doc(raw: bytes, ref: Ref) -> dict[str, Any]:
    """A Kiln manifest (a release's or a channel's) as a dict; GateFailed for anything else."""
    from kiln_runtime import channels
    from kiln_runtime.signature import parse_json

    try:
        doc = parse_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):     # JSON, a key twice, nesting past the limit
        raise GateFailed(f"{ref}: the manifest is not JSON a Kiln release has", "this is not a Kiln release") \
            from None
    if not isinstance(doc, dict) or doc.get("mediaType", MANIFEST_TYPE) != MANIFEST_TYPE or \
            doc.get("artifactType") not in (ARTIFACT_TYPE, channels.ARTIFACT_TYPE):
        got = doc.get("artifactType") if isinstance(doc, dict) else None
        raise GateFailed(f"{ref}: not a Kiln system release (artifactType {shown(str(got), 80)})",
                         "pull a reference `kiln push` wrote")
    return doc


def _descriptor(layer: Any, media_type: str, ref: Ref, max_bytes: int, what: str) -> dict[str, Any]:
    """A layer's descriptor checked before a byte of it is fetched."""
    size = layer.get("size") if isinstance(layer, dict) else None
    if not isinstance(layer, dict) or layer.get("mediaType") != media_type or not isinstance(layer.get("digest"), str) \
            or not DIGEST.fullmatch(layer["digest"]) or not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise GateFailed(f"{ref}: the {what} layer's descriptor is malformed", "pull a reference `kiln push` wrote")
    if size > max_bytes:
        raise GateFailed(f"{ref}: the {what} layer declares {size} bytes, more than the {max_bytes} allowed",
                         "if a release really is that large, pass --max-bytes; nothing was fetched")
    return layer


def _layer(raw: bytes, ref: Ref, max_bytes: int) -> dict[str, Any]:
    """The one release layer of a release manifest, its descriptor checked before a byte of it is fetched."""
    layers = _manifest_doc(raw, ref).get("layers")
    if not isinstance(layers, list) or len(layers) != 1:
        raise GateFailed(f"{ref}: a Kiln release manifest has exactly one layer", "pull a reference `kiln push` wrote")
    return _descriptor(layers[0], LAYER_TYPE, ref, max_bytes, "release")


@dataclass(frozen=True)
class Pulled:
    ref: Ref
    digest: str               # the manifest's
    archive: Path             # where the verified archive now is
    system: str
    version: int
    checked: list[str]
    placed: bool              # False: the same bytes were already there
    notes: tuple[str, ...] = ()   # what a channel pull adds: the statement, a signed rollback


def _channel(reg: "Registry", doc: dict, ref: Ref, public_key: Path, max_bytes: int, tmp: Path, fresh: bool):
    """A channel manifest's statement fetched (bounded, digest checked), verified with the publisher's key and bound
    to the reference (its channel too when pulled by tag); with `fresh`, also unexpired and not below this host's
    floor. (the statement, the release layer)"""
    from kiln_runtime import channels

    layers = doc.get("layers")
    if not isinstance(layers, list) or len(layers) != 2:
        raise GateFailed(f"{ref}: a Kiln channel manifest has exactly two layers (statement, release)",
                         "pull a reference `kiln push` wrote")
    sd = _descriptor(layers[0], channels.STATEMENT_MEDIA_TYPE, ref, channels.MAX_STATEMENT, "channel statement")
    layer = _descriptor(layers[1], LAYER_TYPE, ref, max_bytes, "release")
    reg.blob(sd, tmp)
    st = channels.read(tmp.read_bytes(), public_key, f"{ref}: the channel statement")
    channels.bind(st, ref.path, None if ref.digest else ref.tag)
    if st.archive != layer["digest"]:
        raise GateFailed(f"{ref}: the channel statement names archive {st.archive}, the manifest carries "
                         f"{layer['digest']}", "the channel was re-pointed without a new statement; nothing was "
                         "placed")
    if fresh:
        channels.fresh(st)
        channels.check_floor(st)
    return st, layer


def pull(ref: Ref, public_key: Path, out_dir: Path, plain_http: bool = False, max_bytes: int = MAX_BLOB,
         progress: Callable[[str], None] | None = None) -> Pulled:
    """Fetch REF, check every digest, verify the release (signature, then content, as `kiln-run verify`) and that
    it is what REF names — by a channel tag, through its signed statement (kiln_runtime/channels.py); only then place
    the archive in `out_dir` (a rename: a failed pull leaves nothing) and move this host's floor for the channel."""
    from kiln_runtime import channels, release, signature

    signature.load_public_key(public_key)                  # a bad key is refused before the network
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise KilnError(f"{out_dir}: exists and is not a folder", "pass --out a folder (created if missing)")
    staging = out_dir if out_dir.is_dir() else out_dir.parent       # the same filesystem: the rename is atomic
    if not staging.is_dir():
        raise KilnError(f"{out_dir}: its folder {staging} does not exist", "create it, or pass --out in an existing "
                        "folder")
    reg = Registry(ref, plain_http)
    raw, digest = reg.manifest()
    doc = _manifest_doc(raw, ref)
    channel = doc.get("artifactType") == channels.ARTIFACT_TYPE
    if not channel and ref.tag and not VERSION_TAG.fullmatch(ref.tag) and not ref.digest:
        raise GateFailed(f"{ref}: '{ref.tag}' is a channel tag, and it points at a release with no signed channel "
                         "statement: anyone who can push could have re-pointed it", "pull by a version tag or the "
                         "digest, or have the publisher push the channel with its signing key (kiln push ARCHIVE "
                         "REF:CHANNEL)")
    fd, tmp_name = tempfile.mkstemp(prefix=".kiln-pull-", suffix=".tar.gz", dir=staging)
    os.close(fd)
    fd, st_name = tempfile.mkstemp(prefix=".kiln-pull-", suffix=".statement", dir=staging)
    os.close(fd)
    tmp, st_tmp = Path(tmp_name), Path(st_name)
    notes: list[str] = []
    try:
        st = None
        with release.writing(tmp):
            if channel:
                # pinned by digest: the caller chose this manifest, fresh or not (no floor read or moved)
                st, layer = _channel(reg, doc, ref, public_key, max_bytes, st_tmp, fresh=not ref.digest)
                notes.append(f"channel {st.channel} → {st.system} v{st.version}: statement signed, issued "
                             f"{st.issued}, expires {st.expires}" + ("" if not ref.digest else
                                                                      " (pinned by digest: freshness not checked)"))
            else:
                layer = _layer(raw, ref, max_bytes)
            if progress:
                progress(f"pulling {ref}{'' if ref.digest else ' → ' + digest} (1 layer, {layer['size'] / 1e6:.1f} MB)")
            reg.blob(layer, tmp)
        try:
            with release.verified(tmp, public_key, runtime=False) as (tree, checked):
                rel = json.loads((tree / "release.json").read_bytes())
                system, version = str(rel["system"]), int(rel["version"])
                bind(ref, system, version)
                if st is not None and (st.system, st.version) != (system, version):
                    raise GateFailed(f"{ref}: the channel statement says {shown(st.system, 64)} v{st.version}, the "
                                     f"signed release is {shown(system, 64)} v{version}", "nothing was placed")
        except KilnError as e:                # name what was pulled, not the temporary file it was checked in
            e.message = e.message.replace(str(tmp), f"{ref} ({digest})")
            raise
        dest = out_dir / f"{release.registered(system)}-v{version}.tar.gz"
        placed = not dest.exists() and not dest.is_symlink()
        if not placed and (dest.is_symlink() or not dest.is_file() or _sha256(dest) != layer["digest"]):
            raise KilnError(f"{dest} exists with other bytes", "nothing released is overwritten: pull into another "
                            "--out folder, or move that file away")
        if st is not None and not ref.digest and (note := channels.accept(st, f"{ref} ({digest})")):
            notes.append(note)                # the floor moves first: a pull that loses a race places nothing
        if placed:
            out_dir.mkdir(exist_ok=True)
            os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
        st_tmp.unlink(missing_ok=True)
    return Pulled(ref, digest, dest, system, version, checked, placed, tuple(notes))


# ---------------------------------------------------------------------------------------------- push a channel
@dataclass(frozen=True)
class Channel:
    pushed: Pushed            # the channel manifest
    statement: Any            # channels.Statement
    release_digest: str       # the version's own manifest


def current_channel(ref: Ref, public_key: Path, plain_http: bool = False):
    """The statement the channel tag carries now, verified with the publisher's key: (statement, None), (None, why
    it could not be read) — or (None, None) when the tag does not exist."""
    from kiln_runtime import channels

    reg = Registry(ref, plain_http)
    try:
        raw, _ = reg.manifest()
    except KilnError as e:
        if "not found in the registry" in e.message:
            return None, None
        raise
    try:
        doc = _manifest_doc(raw, ref)
        if doc.get("artifactType") != channels.ARTIFACT_TYPE:
            return None, "it points at a release with no channel statement"
        with scratch("push") as tmp:                            # the publisher's side: no floor of its own
            st, _ = _channel(reg, doc, ref, public_key, MAX_BLOB, tmp / "statement", fresh=False)
        return st, None
    except GateFailed as e:
        return None, e.message


def push_channel(archive: Path, ref: Ref, doc: dict[str, Any], statement_bundle: Callable[[Any], bytes], st,
                 plain_http: bool = False) -> Channel:
    """Push `archive` under the channel tag REF with the signed statement `statement_bundle(st)` (the build signs):
    the release's own manifest by its digest, then the channel manifest (statement + release layers) under the tag —
    one PUT, so the channel and its statement move together."""
    from kiln_runtime import channels

    released = push(archive, Ref(ref.host, ref.path, None, None), doc, plain_http)      # by digest, untagged
    if st.release_manifest != released.digest or st.archive != released.layer["digest"]:
        raise KilnError("the channel statement does not name the release being pushed", "this is a bug in kiln push")
    bundle = statement_bundle(st)
    sd = {"mediaType": channels.STATEMENT_MEDIA_TYPE, "digest": "sha256:" + hashlib.sha256(bundle).hexdigest(),
          "size": len(bundle)}
    notes = {**annotations(doc, archive.name, released.layer["digest"]), PREFIX + "channel": ref.tag or "",
             PREFIX + "channel.issued": st.issued, PREFIX + "channel.expires": st.expires}
    raw = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": channels.ARTIFACT_TYPE,
                      "config": EMPTY_DESCRIPTOR, "layers": [sd, released.layer], "annotations": notes},
                     sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    reg = Registry(ref, plain_http)
    with scratch("push") as tmp:
        (tmp / "statement.json").write_bytes(bundle)
        reg.push_blob(tmp / "statement.json", sd)
    digest = reg.put_manifest(raw)
    return Channel(Pushed(ref, digest, released.layer, released.uploaded), st, released.digest)


@contextmanager
def local(source: str, public_key: Path, plain_http: bool = False,
          progress: Callable[[str], None] | None = None) -> Iterator[Path]:
    """`source` as a local archive path: a file as it is, a registry reference pulled and verified into a private
    temporary folder (removed on exit). For the commands that take either."""
    if Path(source).exists() or not is_ref(source):
        yield Path(source)
        return
    ref = parse_ref(source)
    with scratch("run-pull") as tmp:
        got = pull(ref, public_key, tmp / "release", plain_http, progress=progress)
        if progress:
            progress(f"pulled {ref}{'' if ref.digest else ' (' + got.digest + ')'}: {got.system} v{got.version}")
            for note in got.notes:
                progress(note)
        yield got.archive
