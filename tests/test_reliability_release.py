"""Issue 37, the release half: what `kiln verify-release` parses and what `kiln release` / `kiln keygen` leave behind.

Classes covered: [tar differential] (3: the verifier and GNU tar must agree on what an archive holds, checked against
the real `tar` binary), [streaming limits] (4: caps apply while reading, every document is bounded before it is
parsed, no unbounded echo), [release half-states] (5: a full disk, `ulimit -f` and SIGTERM under `kiln release`
leave no .tmp and no scratch folder), [keygen links] (6: no key written through a link or under a file) and
[one line] (9: nested JSON, an RSA key, a malformed signature field, a partial `--all-production`).

The engine is the fast fake of test_registry / test_release (real manifests, real MLflow on SQLite, real
model-signing); archives are crafted byte by byte from a genuine release.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

from conftest import REPO
from pipeline.release import archive as tar_reader
from pipeline import cli, registry
from pipeline.release import signing
from pipeline.release import engine as release
from pipeline.errors import GateFailed, KilnError
from reliability import PY, _env, clean_error, kiln
from test_registry import FP32, INT8, make_engine, make_index, register, root  # noqa: F401  (root: a fixture)
from test_release import _extracted, keys, released, repack  # noqa: F401  (keys: a fixture)

TAR = shutil.which("tar")


# ---------------------------------------------------------------------------------------------- crafting archives
def _member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    """One GNU-format member (header + padded data), as tar itself writes it."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    return info.tobuf(tarfile.GNU_FORMAT) + data + b"\0" * (-len(data) % 512)


def _rechecksum(header: bytearray) -> bytes:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _body(archive: Path) -> bytes:
    """The genuine tar stream up to (not including) its end-of-archive marker."""
    raw = gzip.decompress(archive.read_bytes())
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        t.getmembers()
        return raw[:t.offset]


def _crafted(archive: Path, top: str) -> dict[str, bytes]:
    """Archives that hide a member from one reader or the other, each built on the genuine release."""
    body, end = _body(archive), b"\0" * 10240
    hidden = _member(f"{top}/engine/model.onnx", b"EVIL engine") + \
        _member(f"{top}/passwd", kind=tarfile.SYMTYPE, link="/etc/passwd")
    bad = bytearray(_member(f"{top}/junk", b"j"))
    bad[148:156] = b"0000000\0"                                       # a wrong header checksum
    prefixed = bytearray(_member(f"{top}/engine/model.onnx", b"EVIL engine"))
    prefixed[345:348] = b"zzz"         # Python reads bytes 345.. of a GNU header as a name prefix; GNU tar does not
    prefixed = _rechecksum(prefixed[:512]) + bytes(prefixed[512:])
    return {
        "bad-checksum": gzip.compress(body + bytes(bad) + hidden + end, mtime=0),
        "after-end-of-archive": gzip.compress(body + end + hidden + end, mtime=0),
        "lone-zero-block": gzip.compress(body + b"\0" * 512 + hidden + end, mtime=0),
        "second-gzip-member": gzip.compress(body + end, mtime=0) + gzip.compress(hidden + end, mtime=0),
        "trailing-bytes": archive.read_bytes() + b"trailing garbage",
        "gnu-prefix": gzip.compress(body + prefixed + end, mtime=0),
    }


def _tar_sees(archive: Path, dest: Path, *flags: str) -> dict[str, str]:
    """What the real GNU tar extracts (whatever its exit status: it extracts before it complains)."""
    dest.mkdir()
    subprocess.run([TAR, *flags, "-xzf", str(archive), "-C", str(dest)], capture_output=True)
    seen = {}
    for d, dirs, files in os.walk(dest):
        for n in dirs + files:
            p = Path(d) / n
            rel = p.relative_to(dest).as_posix()
            seen[rel] = f"link→{os.readlink(p)}" if p.is_symlink() else \
                "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return seen


def _verify_cli(archive: Path, key: Path, capsys) -> tuple[int, str]:
    rc = cli.main(["verify-release", str(archive), "--key", str(key)])
    return rc, capsys.readouterr().err


def _one_line(rc: int, err: str, code: int) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == code and "Traceback" not in err, (rc, err[-2000:])
    assert len(lines) <= 2 and lines[0].startswith("kiln: ") and all(ln.startswith(("kiln: ", "hint: ")) for ln in
                                                                       lines), err[-2000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------- [tar differential]
@pytest.mark.skipif(TAR is None, reason="GNU tar is not installed")
def test_verifier_refuses_every_archive_where_gnu_tar_extracts_more(cfg, root, keys, tmp_path,  # noqa: F811
                                                                     capsys):
    """[tar differential] The real `tar -xzf` (and `tar -ixzf`, which reads past end-of-archive markers) against
    `kiln verify-release`: an archive where tar extracts anything the verifier did not check is refused — in
    particular a bad header checksum hiding a replacement engine and a link to /etc/passwd (verified on main)."""
    r = released(cfg, root, keys)
    top = r.archive.name.removesuffix(".tar.gz")
    checked = _tar_sees(r.archive, tmp_path / "genuine")
    assert f"{top}/engine/model.onnx" in checked and _verify_cli(r.archive, keys[1], capsys)[0] == 0   # control
    differs = []
    for case, data in _crafted(r.archive, top).items():
        archive = tmp_path / f"{case}.tar.gz"
        archive.write_bytes(data)
        for flags in ((), ("--ignore-zeros",)):
            if _tar_sees(archive, tmp_path / f"{case}{''.join(flags)}", *flags) != checked:
                differs.append((case, flags))
        rc, err = _verify_cli(archive, keys[1], capsys)      # refused, differing or not: nothing follows the end
        assert _one_line(rc, err, 1).startswith("kiln: gate failed: "), (case, err)
    # not vacuous: tar really does extract the hidden members of these
    assert {("bad-checksum", ()), ("gnu-prefix", ()), ("after-end-of-archive", ("--ignore-zeros",)),
            ("second-gzip-member", ("--ignore-zeros",))} <= set(differs), differs
    assert (tmp_path / "bad-checksum" / top / "passwd").is_symlink()
    res = kiln(tmp_path, "verify-release", str(tmp_path / "bad-checksum.tar.gz"), "--key", str(keys[1]))
    clean_error(res, 1, "a header is invalid (bad checksum)")


# ---------------------------------------------------------------------------------------------- [streaming limits]
def _many_members(n: int) -> bytes:
    """`n` empty files in a few MB of gzip (headers made from one template: fast to build)."""
    info = tarfile.TarInfo("m/000000")
    template = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    out = bytearray()
    for i in range(n):
        h = bytearray(template)
        h[2:8] = b"%06d" % i
        out += _rechecksum(h)
    return gzip.compress(bytes(out) + b"\0" * 10240, 1)


def _peak_mb(archive: Path, key: Path) -> tuple[int, float, str]:
    """Run `kiln verify-release` in a fresh process; its exit code, peak RSS (MB) and stderr."""
    p = subprocess.Popen([PY, "-m", "pipeline.cli", "verify-release", str(archive), "--key", str(key)],
                         cwd=archive.parent, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read().decode()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, usage.ru_maxrss / 1024, err


def test_member_cap_applies_while_streaming(keys, tmp_path):
    """[streaming limits] 200k empty members (20x the cap): refused at the cap, at the memory of a tiny archive
    (main built all 200k member objects first: ~90 MB more, seconds more)."""
    assert tar_reader.MAX_MEMBERS == 10_000
    many = tmp_path / "many.tar.gz"
    many.write_bytes(_many_members(200_000))
    small = tmp_path / "small.tar.gz"
    small.write_bytes(gzip.compress(_member("x/a", b"a") + b"\0" * 10240))
    rc0, base, _ = _peak_mb(small, keys[1])
    rc, peak, err = _peak_mb(many, keys[1])
    assert rc0 == rc == 1 and f"more than {tar_reader.MAX_MEMBERS} members" in err, err
    assert peak - base < 30, (peak, base)


def test_documents_are_bounded_before_parsing(cfg, root, keys, tmp_path, capsys):  # noqa: F811
    """[streaming limits] A signature padded with whitespace past the document cap (main accepted one padded with
    1 GiB), a signed release.json over the cap, and an archive of thousands of entries with a 4 KiB name: refused,
    in one bounded line."""
    r = released(cfg, root, keys)
    pad = (8 << 20) + 1                                # one byte over the cap on any document (release_content.MAX_DOC)
    padded = repack(r.archive, tmp_path / "padded.tar.gz", lambda n, d: d + b" " * pad if n.endswith(".sig") else d)
    with pytest.raises(GateFailed, match="^.*sig: .* bytes; no file at the top of a release archive is over 8 MiB"):
        release.verify(padded, keys[1])

    tree, sig = _extracted(r.archive, tmp_path / "x")            # the publisher's own key signed the big one
    doc = (tree / "release.json").read_bytes()
    (tree / "release.json").write_bytes(doc + b" " * pad)
    signing.sign_tree(tree, sig, keys[0])
    big = tmp_path / "big.tar.gz"
    release.write_archive(big, tree.parent, [tree.name, sig.name])
    with pytest.raises(GateFailed, match="^release.json: .* bytes; no document of a release is over 8 MiB"):
        release.verify(big, keys[1])

    wide = tmp_path / "wide.tar.gz"
    with tarfile.open(wide, "w:gz", format=tarfile.GNU_FORMAT) as t:
        for i in range(3000):
            t.addfile(tarfile.TarInfo(f"f{i:05d}" + "n" * (4000 if i == 0 else 0)), io.BytesIO(b""))
    rc, err = _verify_cli(wide, keys[1], capsys)
    assert len(_one_line(rc, err, 1)) < 800, err[:2000]


# ---------------------------------------------------------------------------------------------- [release half-states]
def _release_env(root: Path, tmpdir: Path) -> dict[str, str]:
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    tmpdir.mkdir(exist_ok=True)
    return {"MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"], "TMPDIR": str(tmpdir)}


def _production(cfg, root: Path, payload: bytes = b"int8-engine-bytes") -> None:
    make_engine(root, cfg, INT8, payload)
    registry.promote(cfg, INT8, register(cfg, INT8, root).version, root)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs (needs root); skipped where mounting is not allowed."""
    d = tmp_path / "full"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def _fill(d: Path, leave: int) -> None:
    """Fill filesystem `d` up to `leave` free bytes."""
    st = os.statvfs(d)
    (d / "filler").write_bytes(b"\0" * max(st.f_bavail * st.f_frsize - leave, 0))


def test_full_disk_under_release_out(cfg, root, keys, tmp_path, tiny_fs):  # noqa: F811
    """[release half-states] A real full filesystem (ENOSPC) as `--out`: one `kiln: error:` line naming it, no .tmp
    left there, no scratch folder (main: a traceback and a .tmp)."""
    _production(cfg, root)
    scratch = tmp_path / "scratch"
    env = _release_env(root, scratch)
    _fill(tiny_fs, 4096)
    r = kiln(root, "release", INT8, "production", "--key", str(keys[0]), "--out", str(tiny_fs), env=env)
    clean_error(r, 2, "No space left on device", str(tiny_fs))
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["filler"] and list(scratch.iterdir()) == []


def test_file_size_limit_under_release(cfg, root, keys, tmp_path):  # noqa: F811
    """[release half-states] `ulimit -f` just above the engine's size (EFBIG; Python ignores SIGXFSZ): the download
    fits, the archive staged in TMPDIR does not: one line naming where, nothing left behind (main: a traceback)."""
    import resource

    payload = os.urandom(1 << 20)                     # incompressible: the archive is larger than any file before it
    _production(cfg, root, payload)
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    env = _env(_release_env(root, scratch))

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(payload) + 4096, len(payload) + 4096))

    r = subprocess.run([PY, "-m", "pipeline.cli", "release", INT8, "production", "--key", str(keys[0]), "--out",
                        str(out)], cwd=root, env=env, capture_output=True, text=True, preexec_fn=limit)
    clean_error(r, 2, f"cannot write in the temporary folder {scratch}: File too large")
    assert list(scratch.iterdir()) == [], list(scratch.iterdir())
    assert not out.exists() or list(out.iterdir()) == [], list(out.iterdir())


# fault injection: the real CLI, with one function wrapped so that its Nth call SIGTERMs the process itself
SIGTERM_AT = """
import importlib, os, signal, sys
module, attr, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
target, calls = importlib.import_module(module), []
real = getattr(target, attr)
def hooked(*a, **k):
    calls.append(1)
    if len(calls) == nth:
        os.kill(os.getpid(), signal.SIGTERM)         # a real SIGTERM, delivered inside the command
    return real(*a, **k)
setattr(target, attr, hooked)
from pipeline import cli
sys.exit(cli.main(sys.argv[4:]))
"""


def test_sigterm_anywhere_in_release_leaves_no_scratch(cfg, root, keys, tmp_path):  # noqa: F811
    """[release half-states] SIGTERM while downloading, signing, writing the archive into --out and recording it:
    exit 143, the private TMPDIR empty, no .tmp in --out; an archive there is whole and verifies."""
    _production(cfg, root)
    for i, (module, attr, nth) in enumerate([("pipeline.registry.aliases", "download_verified", 1),
                                             ("pipeline.release.signing", "sign_tree", 1),
                                             ("os", "fsync", 2),        # place_archive's copy is written, not renamed
                                             ("pipeline.release.engine", "record_release", 1)]):
        scratch, out = tmp_path / f"scratch{i}", tmp_path / f"out{i}"
        env = _env(_release_env(root, scratch))
        r = subprocess.run([PY, "-c", SIGTERM_AT, module, attr, str(nth), "release", INT8, "production", "--key",
                            str(keys[0]), "--out", str(out)], cwd=root, env=env, capture_output=True, text=True)
        assert r.returncode == 143 and "terminated (SIGTERM)" in r.stderr, (attr, r.returncode, r.stderr[-2000:])
        assert list(scratch.iterdir()) == [], (attr, list(scratch.iterdir()))
        left = sorted(p.name for p in out.iterdir()) if out.exists() else []
        assert left in ([], [f"kiln-{INT8}-v1.tar.gz"]), (attr, left)
        if left:
            assert attr == "record_release" and release.verify(out / left[0], keys[1])


# ---------------------------------------------------------------------------------------------- [keygen links]
def test_keygen_never_writes_through_a_link_or_under_a_file(tmp_path):
    """[keygen links] A dangling `.pub` link pointing into the repository (main wrote the public key there), a
    dangling private-key link, a key folder that is a link into the repository, a path under a file: one line
    each, nothing written."""
    inside = REPO / f".kiln-test-{uuid.uuid4().hex}.pub"
    (tmp_path / "k.pem.pub").symlink_to(inside)
    try:
        clean_error(kiln(tmp_path, "keygen", "--out", str(tmp_path / "k.pem")), 2, "a link")
        assert not inside.exists() and not (tmp_path / "k.pem").exists()
    finally:
        inside.unlink(missing_ok=True)
    (tmp_path / "p.pem").symlink_to(tmp_path / "elsewhere.pem")
    clean_error(kiln(tmp_path, "keygen", "--out", str(tmp_path / "p.pem")), 2, "a link")
    assert not (tmp_path / "elsewhere.pem").exists() and not (tmp_path / "p.pem.pub").exists()
    (tmp_path / "repo").symlink_to(REPO / "tests", target_is_directory=True)
    clean_error(kiln(tmp_path, "keygen", "--out", str(tmp_path / "repo" / "k.pem")), 2, "inside the repository")
    (tmp_path / "file").write_text("x")
    clean_error(kiln(tmp_path, "keygen", "--out", str(tmp_path / "file" / "k.pem")), 2, "cannot write the key")
    private, public = signing.keygen(tmp_path / "ok" / "k.pem")
    assert oct(private.stat().st_mode & 0o777) == "0o600" and public.read_bytes().startswith(b"-----BEGIN PUBLIC")


# ---------------------------------------------------------------------------------------------- [one line]
def test_nested_json_and_bad_signature_fields_are_one_line(cfg, root, keys, tmp_path, capsys):  # noqa: F811
    """[one line] A signed release.json nested 100k deep (main: RecursionError traceback) or naming a megabyte-long
    model (main echoed it); a signature whose field has the wrong type (main: pydantic's 4-line message)."""
    r = released(cfg, root, keys)
    tree, sig = _extracted(r.archive, tmp_path / "x")
    doc = json.loads((tree / "release.json").read_text())
    (tree / "release.json").write_text(json.dumps(doc)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    signing.sign_tree(tree, sig, keys[0])
    deep = tmp_path / "deep.tar.gz"
    release.write_archive(deep, tree.parent, [tree.name, sig.name])
    clean_error(kiln(tmp_path, "verify-release", str(deep), "--key", str(keys[1])), 1, "nested too deeply")
    (tree / "release.json").write_text(json.dumps({**doc, "registered_model": "x" * 1_000_000}))
    signing.sign_tree(tree, sig, keys[0])                                 # a megabyte-long name, signed
    release.write_archive(deep, tree.parent, [tree.name, sig.name])
    rc, err = _verify_cli(deep, keys[1], capsys)
    assert len(_one_line(rc, err, 1)) < 800, err[:1000]

    def bad_field(name: str, data: bytes) -> bytes:
        if not name.endswith(".sig"):
            return data
        bundle = json.loads(data)
        bundle["verificationMaterial"]["publicKey"]["hint"] = [1, 2]
        return json.dumps(bundle).encode()

    rc, err = _verify_cli(repack(r.archive, tmp_path / "field.tar.gz", bad_field), keys[1], capsys)
    assert "verificationMaterial.publicKey.hint: Input should be a valid string" in _one_line(rc, err, 1)


def test_an_rsa_key_is_refused_at_sign_time(cfg, root, tmp_path):  # noqa: F811
    """[one line] An RSA key given to `kiln release` (main: AttributeError inside model-signing): a user error
    saying which keys Kiln signs with; nothing written."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    _production(cfg, root)
    key = tmp_path / "rsa.pem"
    key.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(KilnError, match="a RSA key; kiln signs with EC P-256 keys") as e:
        release.build(cfg, INT8, "production", root, key=key, out_dir=tmp_path / "out")
    assert not isinstance(e.value, GateFailed) and "kiln keygen" in e.value.hint
    assert not (tmp_path / "out").exists()


def test_all_production_says_what_was_released_and_what_was_not(cfg, root, keys, tmp_path, monkeypatch,  # noqa: F811
                                                                 capsys):
    """[one line] Three models in production, the second no longer matching its workspace: the first archive is
    printed, then one line naming what was not released; exit non-zero (main printed nothing about the first)."""
    size = cfg.matching.gallery_sizes[0]
    for engine, payload in ((FP32, b"fp32"), (INT8, b"int8")):
        make_engine(root, cfg, engine, payload)
        registry.promote(cfg, engine, register(cfg, engine, root).version, root)
    from pipeline.stages import register_index

    make_index(root, size, b"faiss-bytes")
    receipt = register_index.run(cfg, size, root)
    registry.promote(cfg, receipt.name, receipt.version, root)
    make_engine(root, cfg, INT8, b"rebuilt")                          # the workspace now holds another build
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    monkeypatch.chdir(root)
    rc = cli.main(["release", "--all-production", "--key", str(keys[0]), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith(f"kiln-{FP32} v1 → {tmp_path / 'out' / f'kiln-{FP32}-v1.tar.gz'}"), out
    line = _one_line(rc, err, rc)
    assert rc in (1, 2) and f"not released: kiln-{INT8}, kiln-gallery-{size}; released 1 of 3" in line, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"kiln-{FP32}-v1.tar.gz"]
