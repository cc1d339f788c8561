"""The release's trust boundary in the runtime: kiln_runtime/signature.py verifies what pipeline/release/signing.py
signs with `cryptography` alone, and kiln_runtime/archive.py reads the archive; the build re-exports both, so a
deployment host and `kiln verify-release` check a release with one implementation.

Every case is also put to model-signing's own verifier (the one the build used before, configured as sign_tree
hashes): the two accept and refuse the same trees, except where the runtime is deliberately stricter (said so).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln_runtime import archive as rt_archive
from kiln_runtime import signature as rt
from kiln_runtime import text as rt_text
from pipeline import tables
from pipeline.release import archive, signing
from pipeline.errors import GateFailed, KilnError

HINT = "do not use this release; get the archive and the publisher's key again"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    private, public = signing.keygen(d / "publisher.pem")
    _, other = signing.keygen(d / "other.pem")
    return {"private": private, "public": public, "other": other}


@pytest.fixture
def signed(tmp_path, keys) -> tuple[Path, Path]:
    """A small release-like tree, signed by pipeline.release.signing.sign_tree: (tree, signature)."""
    tree = tmp_path / "kiln-demo-v1"
    (tree / "engine" / "kiln").mkdir(parents=True)
    (tree / "release.json").write_text('{"registered_model": "kiln-demo"}')
    (tree / "engine" / "model.onnx").write_bytes(bytes(range(256)) * 64)
    (tree / "engine" / "kiln" / "bench.json").write_text("{}")
    (tree / ".hidden").write_bytes(b"dotfiles are signed too")
    sig = tmp_path / "kiln-demo-v1.sig"
    signing.sign_tree(tree, sig, keys["private"])
    return tree, sig


def model_signing_accepts(tree: Path, sig: Path, public: Path) -> bool:
    from model_signing import verifying

    try:
        verifying.Config().use_elliptic_key_verifier(public_key=public).set_hashing_config(signing._hashing()) \
            .verify(tree, sig)
    except Exception:  # noqa: BLE001 — model-signing raises ValueError, InvalidSignature, pydantic errors
        return False
    return True


def runtime_refuses(tree: Path, sig: Path, public: Path) -> str:
    with pytest.raises(GateFailed) as e:
        rt.verify_tree(tree, sig, public)
    assert e.value.hint == HINT and "\n" not in e.value.message, e.value
    return e.value.message


def bundle(sig: Path) -> dict:
    return json.loads(sig.read_text())


def statement(sig: Path) -> dict:
    return json.loads(base64.b64decode(bundle(sig)["dsseEnvelope"]["payload"]))


def resign(sig: Path, private: Path, edit) -> None:
    """Rewrite the statement with `edit(statement)` and sign it again with `private`, exactly as sign_tree signs (a
    valid signature over a statement Kiln would not write)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    b = bundle(sig)
    st = statement(sig)
    edit(st)
    raw = json.dumps(st, sort_keys=True, indent=2).encode()
    key = serialization.load_pem_private_key(private.read_bytes(), None)
    b["dsseEnvelope"]["payload"] = base64.b64encode(raw).decode()
    b["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(key.sign(rt.pae(raw), ec.ECDSA(hashes.SHA256()))) \
        .decode()
    sig.write_text(json.dumps(b))


# ---------------------------------------------------------------------------------------------- one implementation
def test_the_build_reads_and_verifies_with_the_runtime():
    assert archive.safe_extract is rt_archive.safe_extract and archive.MAX_MEMBERS is rt_archive.MAX_MEMBERS
    assert signing.verify_tree is rt.verify_tree and signing.signed_name is rt.signed_name
    assert signing.load_public_key is rt.load_public_key and signing.one_line is rt.one_line
    assert tables.shown is rt_text.shown and tables.first_hidden is rt_text.first_hidden
    assert GateFailed.__module__ == "kiln_runtime.errors"


BLOCKED = ("pipeline", "torch", "dvc", "mlflow", "onnx", "model_signing", "sigstore", "sigstore_models", "pydantic",
           "google", "in_toto_attestation")

WITHOUT_THE_BUILD = """
import importlib.abc, sys
from pathlib import Path
blocked = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"the runtime imported {name}")
sys.meta_path.insert(0, Block())
from kiln_runtime import archive, signature
out = Path(sys.argv[2])
archive.safe_extract(Path(sys.argv[3]), out)
signature.verify_tree(out / "kiln-demo-v1", out / "kiln-demo-v1.sig", Path(sys.argv[4]))
print(signature.signed_name(out / "kiln-demo-v1.sig"))
print(sorted(m for m in sys.modules if m.split(".")[0] in blocked))
"""


def test_a_host_without_the_build_stack_extracts_and_verifies(signed, keys, tmp_path):
    """The runtime's reader and verifier in a process where importing pipeline, torch, model-signing, sigstore,
    pydantic (and the rest of the build) fails: the archive extracts, the signature holds."""
    tree, sig = signed
    tgz = tmp_path / "kiln-demo-v1.tar.gz"
    archive.write_archive(tgz, tree.parent, [tree.name, sig.name])
    (tmp_path / "out").mkdir()
    r = subprocess.run([sys.executable, "-c", WITHOUT_THE_BUILD, ",".join(BLOCKED), str(tmp_path / "out"), str(tgz),
                        str(keys["public"])], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["kiln-demo-v1", "[]"], r.stdout


# ---------------------------------------------------------------------------------------------- accept
def test_what_sign_tree_writes_verifies_with_both(signed, keys):
    tree, sig = signed
    assert rt.verify_tree(tree, sig, keys["public"]) is None
    assert model_signing_accepts(tree, sig, keys["public"])
    assert rt.signed_name(sig) == tree.name
    st = statement(sig)                      # what the runtime reads is what model-signing 1.1.1 writes
    assert st["_type"] == rt.STATEMENT_TYPE and st["predicateType"] == rt.PREDICATE_TYPE
    assert st["predicate"]["serialization"] == rt.SERIALIZATION
    assert [r["name"] for r in st["predicate"]["resources"]] == [".hidden", "engine/kiln/bench.json",
                                                                 "engine/model.onnx", "release.json"]
    assert bundle(sig)["dsseEnvelope"]["payloadType"] == rt.PAYLOAD_TYPE
    assert bundle(sig)["mediaType"] == rt.BUNDLE_MEDIA_TYPE


def test_an_empty_folder_carries_no_content_for_either(signed, keys):
    tree, sig = signed
    (tree / "empty").mkdir()                 # files are signed, folders are not (the archive reader refuses one)
    rt.verify_tree(tree, sig, keys["public"])
    assert model_signing_accepts(tree, sig, keys["public"])


# ---------------------------------------------------------------------------------------------- the tree
def test_a_changed_byte_is_named(signed, keys):
    tree, sig = signed
    data = bytearray((tree / "engine" / "model.onnx").read_bytes())
    data[1000] ^= 1
    (tree / "engine" / "model.onnx").write_bytes(bytes(data))
    assert runtime_refuses(tree, sig, keys["public"]) == \
        "signed content: engine/model.onnx: sha256 differs from the signed statement"
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_an_added_file_is_named(signed, keys):
    tree, sig = signed
    (tree / "engine" / "extra.bin").write_bytes(b"")
    assert runtime_refuses(tree, sig, keys["public"]) == \
        "signed content: Signature mismatch: Extra files found in model 'kiln-demo-v1': engine/extra.bin"
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_a_removed_file_is_named(signed, keys):
    tree, sig = signed
    (tree / ".hidden").unlink()
    assert runtime_refuses(tree, sig, keys["public"]) == \
        "signed content: Signature mismatch: Missing files in model 'kiln-demo-v1': .hidden"
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_a_changed_file_is_named_before_added_ones(signed, keys):
    tree, sig = signed
    (tree / "release.json").write_text("{}")
    (tree / "new").write_text("x")
    assert runtime_refuses(tree, sig, keys["public"]) == \
        "signed content: release.json: sha256 differs from the signed statement"


@pytest.mark.parametrize("target", ["release.json", "nowhere", "engine"])
def test_a_symlink_is_refused(signed, keys, target):
    """A link in place of a signed file (same bytes behind it), a dangling one, one to a folder."""
    tree, sig = signed
    if target == "release.json":
        os.replace(tree / "release.json", tree.parent / "elsewhere.json")
        (tree / "release.json").symlink_to(tree.parent / "elsewhere.json")
        name = "release.json"
    else:
        (tree / "engine" / "link").symlink_to(target)
        name = "engine/link"
    assert runtime_refuses(tree, sig, keys["public"]) == \
        f"signed content: {name}: a symbolic link; a signed release holds regular files and folders only"
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_a_fifo_is_refused_without_waiting_on_it(signed, keys):
    tree, sig = signed
    os.mkfifo(tree / "engine" / "pipe")
    assert "signed content: engine/pipe: not a regular file" in runtime_refuses(tree, sig, keys["public"])
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_a_tree_that_is_a_link_is_refused(signed, keys, tmp_path):
    tree, sig = signed
    (tmp_path / "alias").symlink_to(tree, target_is_directory=True)
    assert runtime_refuses(tmp_path / "alias", sig, keys["public"]).endswith("alias: not a folder")
    assert not model_signing_accepts(tmp_path / "alias", sig, keys["public"])


# ---------------------------------------------------------------------------------------------- the signature
def test_a_different_key_is_a_key_mismatch(signed, keys):
    tree, sig = signed
    assert runtime_refuses(tree, sig, keys["other"]).startswith("signature: Key mismatch: ")
    assert not model_signing_accepts(tree, sig, keys["other"])


def test_a_different_key_without_the_hint_fails_on_the_signature_itself(signed, keys):
    """The hint is only a label: with it removed (model-signing reads such bundles), the ECDSA check refuses."""
    tree, sig = signed
    b = bundle(sig)
    del b["verificationMaterial"]["publicKey"]["hint"]
    sig.write_text(json.dumps(b))
    rt.verify_tree(tree, sig, keys["public"])                           # the right key: still fine
    assert model_signing_accepts(tree, sig, keys["public"])
    assert runtime_refuses(tree, sig, keys["other"]).startswith("signature: InvalidSignature: ")
    assert not model_signing_accepts(tree, sig, keys["other"])


def test_a_corrupted_payload_fails_the_signature(signed, keys):
    """The statement edited to sign what the tree now holds (a new engine), the signature left as it was."""
    tree, sig = signed
    (tree / "engine" / "model.onnx").write_bytes(b"evil")
    b, st = bundle(sig), statement(sig)
    for r in st["predicate"]["resources"]:
        if r["name"] == "engine/model.onnx":
            r["digest"] = hashlib.sha256(b"evil").hexdigest()
    b["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    sig.write_text(json.dumps(b))
    assert runtime_refuses(tree, sig, keys["public"]).startswith("signature: InvalidSignature: the ECDSA signature "
                                                                 "over the statement does not verify")
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_a_corrupted_signature_value_fails(signed, keys):
    tree, sig = signed
    b = bundle(sig)
    raw = bytearray(base64.b64decode(b["dsseEnvelope"]["signatures"][0]["sig"]))
    raw[-1] ^= 1
    b["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(raw)).decode()
    sig.write_text(json.dumps(b))
    assert runtime_refuses(tree, sig, keys["public"]).startswith("signature: InvalidSignature: ")
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_a_wrong_payload_type_is_named(signed, keys):
    tree, sig = signed
    b = bundle(sig)
    b["dsseEnvelope"]["payloadType"] = "application/json"
    sig.write_text(json.dumps(b))
    assert runtime_refuses(tree, sig, keys["public"]) == "signature: dsseEnvelope.payloadType: application/json is " \
        "not application/vnd.in-toto+json (malformed bundle)"
    assert not model_signing_accepts(tree, sig, keys["public"])


@pytest.mark.parametrize("edit, expected", [
    (lambda b: b.__setitem__("mediaType", "application/json"), "signature: mediaType: application/json is not "),
    (lambda b: b["verificationMaterial"]["publicKey"].__setitem__("hint", [1, 2]),
     "signature: verificationMaterial.publicKey.hint: Input should be a valid string (malformed bundle)"),
    (lambda b: b.pop("dsseEnvelope"), "signature: dsseEnvelope: Field required (malformed bundle)"),
    (lambda b: b["dsseEnvelope"].__setitem__("payload", "!!!"), "signature: dsseEnvelope.payload: not base64"),
    (lambda b: b["dsseEnvelope"].__setitem__("signatures", []), "signature: dsseEnvelope.signatures: 0 entries"),
    (lambda b: b["verificationMaterial"].pop("publicKey"),
     "signature: verificationMaterial.publicKey: Field required (malformed bundle)"),
])
def test_a_malformed_bundle_names_the_field(signed, keys, edit, expected):
    tree, sig = signed
    b = bundle(sig)
    edit(b)
    sig.write_text(json.dumps(b))
    assert runtime_refuses(tree, sig, keys["public"]).startswith(expected)
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_unreadable_and_oversized_bundles_are_one_line(signed, keys):
    tree, sig = signed
    good = sig.read_bytes()
    sig.write_bytes(good[:-2])
    assert runtime_refuses(tree, sig, keys["public"]).endswith("(JSONDecodeError)")
    sig.write_bytes(b"\xff" + good)
    assert runtime_refuses(tree, sig, keys["public"]).endswith("(UnicodeDecodeError)")
    sig.write_bytes(good + b" " * rt.MAX_SIGNATURE)
    assert runtime_refuses(tree, sig, keys["public"]) == \
        f"signature: {sig.name}: more than 8 MiB; a signature bundle is far smaller (malformed bundle)"
    sig.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    assert runtime_refuses(tree, sig, keys["public"]).endswith("(RecursionError)")
    sig.unlink()
    assert runtime_refuses(tree, sig, keys["public"]) == \
        f"signature: {sig.name}: No such file or directory (FileNotFoundError)"
    os.mkfifo(sig)                                                      # never waited on
    assert "not a regular file" in runtime_refuses(tree, sig, keys["public"])


# ---------------------------------------------------------------------------------------------- the statement
def test_a_validly_signed_but_inconsistent_statement_is_refused(signed, keys):
    """The subject digest is the sha256 of the resources' digests (model-signing checks it too)."""
    tree, sig = signed
    resign(sig, keys["private"], lambda st: st["subject"][0]["digest"].__setitem__("sha256", "0" * 64))
    assert "the statement is inconsistent" in runtime_refuses(tree, sig, keys["public"])
    assert not model_signing_accepts(tree, sig, keys["public"])


def test_the_resign_helper_signs_as_sign_tree_does(signed, keys):
    tree, sig = signed
    resign(sig, keys["private"], lambda st: None)                      # the control: nothing edited, both accept
    rt.verify_tree(tree, sig, keys["public"])
    assert model_signing_accepts(tree, sig, keys["public"])


@pytest.mark.parametrize("edit, expected", [
    (lambda st: st.__setitem__("_type", "https://in-toto.io/Statement/v0.1"), "_type: "),
    (lambda st: st.__setitem__("predicateType", "https://model_signing/Digests/v0.1"), "predicateType: "),
    (lambda st: st["subject"].append(st["subject"][0]), "subject: 2 subjects"),
])
def test_statement_types_are_checked(signed, keys, edit, expected):
    tree, sig = signed
    resign(sig, keys["private"], edit)
    assert runtime_refuses(tree, sig, keys["public"]).startswith(f"signature: statement: {expected}")
    assert not model_signing_accepts(tree, sig, keys["public"])


@pytest.mark.parametrize("edit, expected", [
    (lambda st: st["predicate"]["serialization"].__setitem__("allow_symlinks", True), "predicate.serialization: "),
    (lambda st: st["predicate"]["resources"][0].__setitem__("name", "./.hidden"), "is not a plain relative path"),
    (lambda st: st["predicate"]["resources"][0].__setitem__("digest", st["predicate"]["resources"][0]["digest"]
                                                            .upper()), "not a sha256"),
])
def test_the_runtime_is_stricter_where_kiln_never_signs_otherwise(signed, keys, edit, expected):
    """Signed statements Kiln never writes (links allowed, a non-canonical name, an upper-case digest): refused by
    the runtime, though model-signing reads each of them. The subject digest is recomputed so only the edit differs."""
    tree, sig = signed

    def edited(st):
        edit(st)
        whole = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in st["predicate"]["resources"]))
        st["subject"][0]["digest"]["sha256"] = whole.hexdigest()

    resign(sig, keys["private"], edited)
    assert expected in runtime_refuses(tree, sig, keys["public"])
    assert model_signing_accepts(tree, sig, keys["public"])


# ---------------------------------------------------------------------------------------------- keys
def test_an_unusable_public_key_is_a_user_error(signed, keys, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    tree, sig = signed
    for name, key, expected in [
            ("rsa.pub", rsa.generate_private_key(public_exponent=65537, key_size=2048), "not an EC public key"),
            ("k1.pub", ec.generate_private_key(ec.SECP256K1()), "an EC key on curve secp256k1")]:
        (tmp_path / name).write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
        with pytest.raises(KilnError, match=expected) as e:
            rt.verify_tree(tree, sig, tmp_path / name)
        assert not isinstance(e.value, GateFailed)
    with pytest.raises(KilnError, match="no such public key") as e:
        rt.load_public_key(tmp_path / "missing.pub")
    assert not isinstance(e.value, GateFailed)
    with pytest.raises(KilnError, match="not a PEM public key"):
        rt.load_public_key(keys["private"])


def test_signed_name_of_an_unreadable_bundle_is_a_gate(tmp_path):
    bad = tmp_path / "x.sig"
    bad.write_text('{"mediaType": 1}')
    with pytest.raises(GateFailed, match=r"^signature: unreadable statement \(mediaType: Input should be a valid "
                                         "string\\)"):
        rt.signed_name(bad)
