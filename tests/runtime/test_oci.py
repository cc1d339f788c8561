"""kiln_runtime/oci.py against a real OCI registry (scripts/oci-registry.sh: Debian's docker-registry, TLS, basic
auth): references, the artifact's manifest, push twice → one digest, and every way a registry (or something between)
can lie or fail during `kiln-run pull` — each one `kiln-run: error:` line, nothing placed.

The archive here is a stand-in (random bytes): these cases fail before verification, which is what they test. The
signed-release cases (push → pull → verify → serve, a re-signed archive, a tag re-pointed at another system) are in
tests/release/test_system_release.py, on a real release.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import ssl
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from kiln_runtime import cli as runtime_cli
from kiln_runtime import oci
from kiln_runtime.errors import GateFailed, KilnError

DOC = {"system": "demo", "version": 3, "verdict": "pass", "system_sha256": "ab" * 32, "registered_model":
       "kiln-system-demo", "parts": [{"model": "embedder", "engine": "embedder-ort-cpu-int8", "version": 2,
                                      "xxh3_128": "cd" * 16}]}


# ---------------------------------------------------------------------------------------------- references
@pytest.mark.parametrize("text, want", [
    ("127.0.0.1:5000/kiln/demo:3", ("127.0.0.1:5000", "kiln/demo", "3", None)),
    ("oci://registry.example.com/team/ml/demo:prod", ("registry.example.com", "team/ml/demo", "prod", None)),
    ("localhost/demo@sha256:" + "a" * 64, ("localhost", "demo", None, "sha256:" + "a" * 64)),
    ("reg.io:443/a/b_c-d:v3@sha256:" + "0" * 64, ("reg.io:443", "a/b_c-d", "v3", "sha256:" + "0" * 64)),
])
def test_a_reference_parses(text, want):
    r = oci.parse_ref(text)
    assert (r.host, r.path, r.tag, r.digest) == want and oci.is_ref(text)


@pytest.mark.parametrize("text", ["demo:3", "127.0.0.1:5000/Kiln/demo:3", "reg.io/demo:a/b", "reg.io/../x:1",
                                  "reg.io/demo@sha256:abc", "reg.io/demo:-x", "reg.io/demo\n:1", "reg.io/demo"])
def test_a_bad_reference_is_one_clear_error(text):
    with pytest.raises(KilnError, match="is not an OCI reference|names no tag and no digest"):
        oci.parse_ref(text)


def test_files_are_not_references():
    assert not oci.is_ref("releases/kiln-system-demo-v3.tar.gz") and not oci.is_ref("my.dir/file.tar.gz")
    assert not oci.is_ref("./kiln-system-demo-v3.tar.gz") and oci.is_ref("oci://reg.io/demo@sha256:" + "1" * 64)
    with pytest.raises(KilnError, match="a push needs a tag"):
        oci.parse_ref("reg.io/demo@sha256:" + "1" * 64, need_tag=True)


def test_a_reference_must_name_the_signed_release():
    oci.bind(oci.parse_ref("reg.io/kiln/demo:3"), "demo", 3)
    oci.bind(oci.parse_ref("reg.io/kiln/demo:prod"), "demo", 7)            # a channel: any version
    oci.bind(oci.parse_ref("reg.io/demo-sys:v2"), "Demo-Sys", 2)          # repository names are lower case
    with pytest.raises(GateFailed, match="signed release is system 'other'"):
        oci.bind(oci.parse_ref("reg.io/kiln/demo:3"), "other", 3)
    with pytest.raises(GateFailed, match="the tag says version 4"):
        oci.bind(oci.parse_ref("reg.io/kiln/demo:v4"), "demo", 3)


def test_the_manifest_is_canonical_and_names_what_it_carries():
    layer = {"mediaType": oci.LAYER_TYPE, "digest": "sha256:" + "e" * 64, "size": 10,
             "annotations": {oci.TITLE: "kiln-system-demo-v3.tar.gz"}}
    notes = oci.annotations(DOC, "kiln-system-demo-v3.tar.gz", "sha256:" + "e" * 64)
    raw = oci.manifest_bytes(layer, notes)
    assert raw == oci.manifest_bytes(json.loads(json.dumps(layer)), dict(reversed(list(notes.items()))))
    doc = json.loads(raw)
    assert doc["artifactType"] == oci.ARTIFACT_TYPE and doc["config"] == oci.EMPTY_DESCRIPTOR
    assert all(isinstance(v, str) for v in doc["annotations"].values())
    assert doc["annotations"]["dev.kiln.system"] == "demo" and doc["annotations"]["dev.kiln.verdict"] == "pass"
    assert doc["annotations"]["org.opencontainers.image.version"] == "3"
    assert doc["annotations"]["dev.kiln.part.embedder"] == "embedder-ort-cpu-int8 v2 xxh3_128:" + "cd" * 16


# ---------------------------------------------------------------------------------------------- a real registry
@pytest.fixture(scope="module")
def pushed(oci_registry, tmp_path_factory):
    """A stand-in archive pushed as demo:3 (twice: one digest); (ref, the Pushed, the archive)."""
    d = tmp_path_factory.mktemp("oci-archive")
    archive = d / "kiln-system-demo-v3.tar.gz"
    archive.write_bytes(os.urandom(24 << 20))    # larger than socket buffers: a 401 mid-upload would cut the send
    ref = oci.parse_ref(f"{oci_registry.host}/kiln/demo:3")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in oci_registry.env().items():
            mp.setenv(k, v)
        first = oci.push(archive, ref, DOC)
        again = oci.push(archive, ref, DOC)
    assert first.uploaded and not again.uploaded and first.digest == again.digest
    return ref, first, archive


def _pull(env: dict, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    for k in [k for k in os.environ if k.startswith(("KILN_OCI_", "SSL_CERT_"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = runtime_cli.main(["pull", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(code: int, err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert code in (1, 2) and lines[0].startswith("kiln-run: error:") and needle in lines[0], err
    assert len(lines) <= 2 and all(ln.startswith("hint:") for ln in lines[1:]) and "Traceback" not in err, err


def test_the_artifact_in_the_registry_is_what_was_pushed(oci_registry, pushed, monkeypatch):
    ref, first, archive = pushed
    for k, v in oci_registry.env().items():
        monkeypatch.setenv(k, v)
    reg = oci.Registry(ref)
    raw, digest = reg.manifest()
    assert digest == first.digest and json.loads(raw)["layers"][0]["digest"] == first.layer["digest"]
    by_digest = oci.Registry(oci.parse_ref(f"{ref.host}/{ref.path}@{digest}"))
    assert by_digest.manifest() == (raw, digest)
    assert oci_registry.blob_file(first.layer["digest"]).read_bytes() == archive.read_bytes()


def test_wrong_or_missing_credentials_are_one_line_and_never_printed(oci_registry, pushed, tmp_path, monkeypatch,
                                                                    capsys):
    ref, _, _ = pushed
    for env in (oci_registry.env(KILN_OCI_PASSWORD="not-the-password-x7"),
                {k: v for k, v in oci_registry.env().items() if not k.startswith("KILN_OCI_")}):
        code, out, err = _pull(env, monkeypatch, capsys, str(ref), "--key", str(_key(tmp_path)), "--out",
                               str(tmp_path / "out"))
        _one_error(code, err, "refused the credentials (401)")
        assert "not-the-password-x7" not in out + err and oci_registry.password not in out + err
        assert not (tmp_path / "out").exists() and _stray(tmp_path) == []


def test_docker_config_credentials_are_read(oci_registry, pushed, tmp_path, monkeypatch, capsys):
    """No KILN_OCI_* in the environment: the docker config file ($DOCKER_CONFIG/config.json) logs in."""
    import base64

    ref, _, _ = pushed
    (tmp_path / "docker").mkdir()
    auth = base64.b64encode(f"kiln:{oci_registry.password}".encode()).decode()
    (tmp_path / "docker" / "config.json").write_text(json.dumps({"auths": {ref.host: {"auth": auth}}}),
                                                     encoding="utf-8")
    env = {k: v for k, v in oci_registry.env(DOCKER_CONFIG=str(tmp_path / "docker")).items()
           if not k.startswith("KILN_OCI_")}
    code, out, err = _pull(env, monkeypatch, capsys, str(ref), "--key", str(_key(tmp_path)), "--out",
                           str(tmp_path / "out"))
    # logged in, fetched, digests checked: the stand-in then fails verification (it is not a signed release)
    _one_error(code, err, "")
    assert "pulling" in out and oci_registry.password not in out + err and not (tmp_path / "out").exists()


def test_untrusted_tls_and_no_registry_are_one_line(oci_registry, pushed, tmp_path, monkeypatch, capsys):
    ref, _, _ = pushed
    env = {k: v for k, v in oci_registry.env().items() if k != "SSL_CERT_FILE"}
    code, _, err = _pull(env, monkeypatch, capsys, str(ref), "--key", str(_key(tmp_path)), "--out", str(tmp_path))
    _one_error(code, err, "TLS certificate did not verify")
    from kiln_runtime.serve import free_port

    code, _, err = _pull(oci_registry.env(), monkeypatch, capsys, f"127.0.0.1:{free_port()}/kiln/demo:3", "--key",
                         str(_key(tmp_path)), "--out", str(tmp_path))
    _one_error(code, err, "cannot reach the registry")
    assert _stray(tmp_path) == []


def test_a_blob_whose_bytes_do_not_match_its_digest_is_refused(oci_registry, tmp_path, monkeypatch, capsys):
    """The registry's stored bytes changed under the same digest (same length, then longer): refused, nothing
    placed — the digest is checked as the bytes arrive, and never more than the declared size is read."""
    archive = tmp_path / "kiln-system-demo-v3.tar.gz"
    archive.write_bytes(os.urandom(1 << 20))
    ref = oci.parse_ref(f"{oci_registry.host}/kiln/demo:v3")
    for k, v in oci_registry.env().items():
        monkeypatch.setenv(k, v)
    got = oci.push(archive, ref, DOC)
    stored = oci_registry.blob_file(got.layer["digest"])
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x01
    stored.write_bytes(bytes(data))
    out = tmp_path / "out"
    code, _, err = _pull(oci_registry.env(), monkeypatch, capsys, str(ref), "--key", str(_key(tmp_path)), "--out",
                         str(out))
    _one_error(code, err, "does not match its digest")
    stored.write_bytes(bytes(data) + os.urandom(4096))
    code, _, err = _pull(oci_registry.env(), monkeypatch, capsys, f"{ref.host}/{ref.path}@{got.digest}", "--key",
                         str(_key(tmp_path)), "--out", str(out))
    _one_error(code, err, "is served with")
    assert not out.exists() and _stray(tmp_path) == []


def test_a_huge_declared_blob_is_refused_before_a_byte_of_it(oci_registry, pushed, tmp_path, monkeypatch, capsys):
    """A manifest that declares a 1 TB layer (the registry accepts it: its blob exists, the size is the manifest's
    word): refused from the descriptor, nothing fetched; a manifest that is not a Kiln release is refused too."""
    ref, first, _ = pushed
    for k, v in oci_registry.env().items():
        monkeypatch.setenv(k, v)
    reg = oci.Registry(oci.parse_ref(f"{ref.host}/kiln/demo:997"))
    huge = dict(first.layer, size=10 ** 12)
    reg.put_manifest(oci.manifest_bytes(huge, {}))
    code, _, err = _pull(oci_registry.env(), monkeypatch, capsys, f"{ref.host}/kiln/demo:997", "--key",
                         str(_key(tmp_path)), "--out", str(tmp_path / "out"))
    _one_error(code, err, "declares 1000000000000 bytes")
    other = json.loads(oci.manifest_bytes(first.layer, {}))
    other["artifactType"] = "application/vnd.example.model"
    oci.Registry(oci.parse_ref(f"{ref.host}/kiln/demo:other")).put_manifest(json.dumps(other).encode())
    code, _, err = _pull(oci_registry.env(), monkeypatch, capsys, f"{ref.host}/kiln/demo:other", "--key",
                         str(_key(tmp_path)), "--out", str(tmp_path / "out"))
    _one_error(code, err, "not a Kiln system release")
    assert not (tmp_path / "out").exists() and _stray(tmp_path) == []


@pytest.mark.parametrize("mode, needle", [("endless", "runs past its declared"),
                                          ("cut", "cannot reach the registry"),
                                          ("stall", "stopped answering")])
def test_a_registry_that_misbehaves_mid_pull_places_nothing(oci_registry, pushed, tmp_path, monkeypatch, capsys,
                                                            mode, needle):
    """Through a proxy in front of the real registry (TLS with the registry's own certificate): a blob that never
    ends, a connection cut halfway through the blob, a registry that stops sending mid-blob. One line each."""
    ref, _, _ = pushed
    monkeypatch.setattr(oci, "TIMEOUT_S", 2.0)
    with _hostile(oci_registry, mode) as host:
        code, _, err = _pull(oci_registry.env(), monkeypatch, capsys, f"{host}/kiln/demo:3", "--key",
                             str(_key(tmp_path)), "--out", str(tmp_path / "out"))
    _one_error(code, err, needle)
    assert not (tmp_path / "out").exists() and _stray(tmp_path) == []


@pytest.mark.parametrize("mode, needle", [("redirect", "redirected too many times (a redirect loop)"),
                                          ("encoding", "does not decode as its Content-Encoding says"),
                                          ("nested", "the manifest is not JSON a Kiln release has"),
                                          ("echo", "failed (500 Internal Server Error)")])
def test_a_registry_that_loops_lies_or_echoes_credentials_is_one_line(oci_registry, pushed, tmp_path, monkeypatch,
                                                                      capsys, mode, needle):
    """Reliability round 5, item 5: a redirect loop, a body whose Content-Encoding lies, a manifest nested past
    Python's recursion limit — each a traceback before — and a registry error whose reason phrase echoes the
    Authorization header: one line, which never holds the password, `user:password` or its base64."""
    import base64

    ref, _, _ = pushed
    with _hostile(oci_registry, mode) as host:
        code, out, err = _pull(oci_registry.env(), monkeypatch, capsys, f"{host}/kiln/demo:3", "--key",
                               str(_key(tmp_path)), "--out", str(tmp_path / "out"))
    _one_error(code, err, needle)
    secret = base64.b64encode(f"kiln:{oci_registry.password}".encode()).decode()
    assert oci_registry.password not in out + err and secret not in out + err
    assert not (tmp_path / "out").exists() and _stray(tmp_path) == []


def test_out_naming_a_file_is_refused_before_anything_is_fetched(oci_registry, tmp_path, monkeypatch, capsys):
    """`--out` naming an existing file was refused only after the whole download and verification: now at once (the
    reference names a registry that does not exist, so reaching it would be another error)."""
    from kiln_runtime.serve import free_port

    (tmp_path / "a-file").write_bytes(b"keep me")
    code, _, err = _pull(oci_registry.env(), monkeypatch, capsys, f"127.0.0.1:{free_port()}/kiln/demo:3", "--key",
                         str(_key(tmp_path)), "--out", str(tmp_path / "a-file"))
    _one_error(code, err, "a-file: exists and is not a folder")
    assert (tmp_path / "a-file").read_bytes() == b"keep me"


# ---------------------------------------------------------------------------------------------- helpers
def _key(tmp_path: Path) -> Path:
    """A real public key (the stand-in archives never get as far as a signature that matches it)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = tmp_path / "publisher.pub"
    if not path.exists():
        pub = ec.generate_private_key(ec.SECP256R1()).public_key()
        path.write_bytes(pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def _stray(tmp_path: Path) -> list[str]:
    """Anything a pull left behind: its temporary files (.kiln-pull-*)."""
    return sorted(p.name for p in tmp_path.rglob(".kiln-pull-*"))


@contextmanager
def _hostile(reg, mode: str):
    """A TLS proxy in front of the registry that forwards everything but blob downloads, which it serves `mode`:
    `endless` (random bytes with no length, forever), `cut` (the real headers, half the bytes, then the
    connection closed), `stall` (the real headers, a few bytes, then silence), `encoding` (the real bytes declared
    gzip-encoded), `echo` (a 500 whose reason phrase echoes the request's Authorization header, as some proxies do);
    or manifests: `redirect` (a redirect to itself, forever), `nested` (JSON nested 100 000 deep)."""
    up_host, up_port = reg.host.rsplit(":", 1)
    upstream_ctx = ssl.create_default_context(cafile=str(reg.dir / "ca.crt"))
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):        # quiet
            pass

        def _forward(self, method: str) -> None:
            if "/manifests/" in self.path and mode in ("redirect", "nested"):
                body = b"[" * 100_000 + b"]" * 100_000 if mode == "nested" else b""
                self.send_response(302 if mode == "redirect" else 200)
                if mode == "redirect":
                    self.send_header("Location", self.path)
                self.send_header("Content-Type", oci.MANIFEST_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if "/blobs/" in self.path and method == "GET" and mode == "echo":
                self.send_response(500, f"upstream said no to {self.headers.get('Authorization')}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            conn = http.client.HTTPSConnection(up_host, int(up_port), context=upstream_ctx, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            conn.request(method, self.path, headers=headers)
            r = conn.getresponse()
            body = r.read()
            blob = method == "GET" and "/blobs/" in self.path and r.status == 200
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("connection", "transfer-encoding") and not (blob and mode == "endless"
                                                                                   and k.lower() == "content-length"):
                    self.send_header(k, v)
            if blob and mode == "endless":
                self.send_header("Connection", "close")
            if blob and mode == "encoding":
                self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            if not blob or mode == "encoding":
                self.wfile.write(body)
                return
            if mode == "endless":
                try:
                    while not stop.is_set():
                        self.wfile.write(os.urandom(1 << 16))
                except OSError:
                    pass
            elif mode == "cut":
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.connection.shutdown(2)
            else:
                self.wfile.write(body[:1000])
                self.wfile.flush()
                stop.wait(30)
            self.close_connection = True

        def do_GET(self):
            self._forward("GET")

        def do_HEAD(self):
            self._forward("HEAD")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # a client that gives up mid-body (as kiln-run must) breaks the proxy's write: socketserver would print that
    # to this process's stderr — which the test reads as kiln-run's — so the proxy's own errors stay silent
    server.handle_error = lambda request, address: None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(reg.dir / "server.crt"), str(reg.dir / "server.key"))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_the_proxy_forwards_faithfully(oci_registry, pushed, monkeypatch):
    """The hostile proxy's honest part: manifests and blob HEADs pass through unchanged (so each hostile case above
    differs from a good pull in the one way it names)."""
    ref, first, _ = pushed
    for k, v in oci_registry.env().items():
        monkeypatch.setenv(k, v)
    with _hostile(oci_registry, "cut") as host:
        raw, digest = oci.Registry(oci.parse_ref(f"{host}/kiln/demo:3")).manifest()
    assert digest == first.digest
