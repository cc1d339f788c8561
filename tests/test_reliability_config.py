"""Reliability, issue 37: what a user's params.yaml, profiles and artifact folders really contain. Classes covered:
4 (limits: a YAML alias chain, an unbounded value echoed into an error), 6 (what Kiln checks can miss what it uses:
duplicate keys, a symlinked artifact folder, `kiln verify` from a subdirectory) and 9 (YAML errors other than
YAMLError: one line, never a traceback). Each case is tagged [limits], [checks miss] or [one line]. None needs the
built project: params.yaml errors stop before any stage work, and the artifacts verified are small real manifests.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO
from reliability import clean_error, kiln
from pipeline import config
from pipeline.errors import KilnError
from pipeline.manifest import build_manifest, input_ref, write_manifest

PARAMS = (REPO / "params.yaml").read_text()
LINE = next(i for i, ln in enumerate(PARAMS.splitlines(), 1) if ln.startswith("  cosine_min: "))   # validate.


def _with(tmp: Path, text: str | bytes, name: str = "params.yaml") -> Path:
    p = tmp / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def _set(key: str, value: str, text: str = PARAMS) -> str:
    """params.yaml with the first `  key: …` line's value replaced by raw YAML text."""
    head, sep, tail = text.partition(f"\n  {key}: ")
    assert sep, key
    return f"{head}{sep}{value}\n{tail.partition(chr(10))[2]}"


def _laughs(levels: int) -> str:
    """One flow value holding a YAML alias chain: 10 ** levels values from a few hundred bytes."""
    chain = ["&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    chain += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return f"[{', '.join(chain)}]"


# ---------------------------------------------------------------------------------------------- [limits]
def test_an_alias_chain_in_a_params_value_is_refused_before_it_expands(tmp_path):
    """[limits] A million values behind one alias used to reach pydantic whole and come back as a multi-megabyte
    error line (longer chains: a MemoryError traceback). Refused at the anchor, in one short line."""
    p = _with(tmp_path, _set("cosine_min", _laughs(6)))
    r = kiln(tmp_path, "--params", str(p), "targets")
    clean_error(r, 2, f"params.yaml: line {LINE}: this value, aliases expanded, holds more than", "aliases (*)")
    assert len(r.stderr) < 1000, len(r.stderr)


def test_an_unbounded_value_is_never_echoed_whole(tmp_path):
    """[limits] A 300 kB string where a number goes: the error quotes a few dozen characters of it, not all."""
    p = _with(tmp_path, _set("cosine_min", "x" * 300_000))
    r = kiln(tmp_path, "--params", str(p), "targets")
    clean_error(r, 2, "validate.cosine_min")
    assert len(r.stderr) < 1000, len(r.stderr)


def test_anchors_and_merge_keys_within_bounds_still_load(tmp_path):
    """[limits] The bounds refuse expansion, not YAML: anchors, aliases and `<<` merges of a normal size load as
    before (an override after a merge is not a duplicate)."""
    text = _set("cosine_mean", "*floor", _set("cosine_min", "&floor 0.99"))
    text += "scratch:\n  base: &b {x: 1, y: 2}\n  derived: {<<: *b, x: 3}\n"
    raw = config.read_yaml(_with(tmp_path, text), "")
    assert raw["validate"]["cosine_mean"] == raw["validate"]["cosine_min"] == 0.99
    assert raw["scratch"]["derived"] == {"x": 3, "y": 2}


# ---------------------------------------------------------------------------------------------- [checks miss]
def test_a_duplicate_key_in_params_is_refused_with_its_line(tmp_path):
    """[checks miss] A second `cosine_min: -1.0` used to win silently (the gate off, exit 0) while DVC refuses the
    same file. Refused at any depth, naming the key and both lines."""
    text = _set("cosine_min", "0.99\n  cosine_min: -1.0")
    line = text.splitlines().index("  cosine_min: -1.0") + 1
    p = _with(tmp_path, text)
    clean_error(kiln(tmp_path, "--params", str(p), "targets"), 2,
                f"params.yaml: line {line}: duplicate key `cosine_min` (first on line {line - 1})")
    p = _with(tmp_path, PARAMS + "\nregister:\n  experiment: other\n")           # a whole section, top level
    with pytest.raises(KilnError, match="duplicate key `register`"):
        config.load(p)


def _artifact(d: Path, name: str, payload: bytes, inputs=()) -> Path:
    d.mkdir(parents=True)
    (d / "model.bin").write_bytes(payload)
    m = build_manifest(kind="engine", name=name, directory=d, files=[d / "model.bin"], inputs=list(inputs),
                       toolchain={"x": "1"}, build={}, code={"pipeline/x.py": "c0de"}, params={"a.b": 1})
    return write_manifest(d, m)


@pytest.fixture
def small_project(tmp_path) -> Path:
    """A project with two real artifacts: artifacts/export/up, and artifacts/engines/down (built from up) kept
    elsewhere behind a symlinked folder, as a DVC checkout or a user's disk layout may do."""
    root = tmp_path / "proj"
    up = _artifact(root / "artifacts/export/up", "up", b"exported graph")
    _artifact(tmp_path / "elsewhere/down", "down", b"engine bytes", [input_ref("source", up, root)])
    (root / "artifacts/engines").mkdir()
    os.symlink(tmp_path / "elsewhere/down", root / "artifacts/engines/down")
    os.symlink(root / "artifacts", root / "artifacts/engines/loop")      # a link loop: walked once
    (root / "docs").mkdir()
    return root


def test_verify_follows_a_symlinked_artifact_folder(small_project):
    """[checks miss] `kiln verify artifacts` used to skip a symlinked artifact folder (all ok while the engine
    behind the link had a flipped byte). It follows links, each real folder once, and catches the byte."""
    r = kiln(small_project, "verify", "artifacts")
    assert r.returncode == 0 and "verify: 2 ok, 0 mismatched" in r.stdout, r.stdout + r.stderr
    engine = small_project / "artifacts/engines/down/model.bin"
    engine.write_bytes(b"engine bytez")                                     # same size, one byte flipped
    r = kiln(small_project, "verify", "artifacts")
    assert r.returncode == 1 and "BAD artifacts/engines/down/down.manifest.json" in r.stdout, r.stdout + r.stderr
    assert "verify: 1 ok, 1 mismatched" in r.stdout and "Traceback" not in r.stderr


def test_verify_from_a_subdirectory_checks_inputs_against_the_project(small_project):
    """[checks miss] `kiln verify ../artifacts` from a subdirectory used to report every input as missing (input
    paths are relative to the project root). The project root is the one holding the artifacts folder."""
    r = kiln(small_project / "docs", "verify", "../artifacts")
    assert r.returncode == 0 and "verify: 2 ok, 0 mismatched" in r.stdout, r.stdout + r.stderr
    assert f"against the project root {small_project.resolve()}" in r.stdout
    shutil.rmtree(small_project / "artifacts/export/up")
    _artifact(small_project / "artifacts/export/up", "up", b"another graph")      # rebuilt since down was
    r = kiln(small_project / "docs", "verify", "../artifacts/engines")     # the input changed: still caught
    assert r.returncode == 1 and "input changed since down was built" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------- [one line]
BAD_YAML = [
    ("a date that is no date", _set("cosine_min", "2020-13-45"), f"line {LINE}: month must be in 1..12"),
    ("a number tag on text", _set("cosine_min", "!!int abc"), "invalid literal for int()"),
    ("nesting past any params file", _set("cosine_min", "[" * 900 + "]" * 900), "nested more than 32 levels"),
    ("nesting past libyaml's own limit", _set("cosine_min", "[" * 5000 + "]" * 5000), "maximum nesting depth"),
    ("a Python object tag, a long one", _set("cosine_min", "!!python/object:" + "x" * 100_000 + " {}"),
     "could not determine a constructor"),
    ("bytes that are not UTF-8", PARAMS.encode().replace(b"cosine_min: ", b"cosine_min: \xff\xfe", 1),
     "not UTF-8 text"),
    ("an alias into its own collection", _set("cosine_min", "&me [1, *me]"), "an alias refers to a collection"),
    ("a file over a megabyte", PARAMS + "#" * (1 << 20) + "\n", "larger than 1 MiB"),
]


@pytest.mark.parametrize("text, needle", [c[1:] for c in BAD_YAML], ids=[c[0] for c in BAD_YAML])
def test_what_yaml_itself_cannot_read_is_one_line(tmp_path, text, needle):
    """[one line] Errors raised inside PyYAML that are not YAMLError (ValueError from a date, RecursionError from
    nesting, UnicodeDecodeError, …) used to be tracebacks; every one is `kiln: error: <file>: …` and exit 2, with no
    more of the input than a few dozen characters."""
    r = kiln(tmp_path, "--params", str(_with(tmp_path, text)), "targets")
    clean_error(r, 2, "kiln: error: ", "params.yaml: ", needle)
    assert len(r.stderr) < 1000, len(r.stderr)


def test_params_that_are_not_a_file_are_one_line(tmp_path):
    """[one line] A directory or a FIFO given as params.yaml: an IsADirectoryError traceback, or a hang."""
    (tmp_path / "dir.yaml").mkdir()
    clean_error(kiln(tmp_path, "--params", "dir.yaml", "targets"), 2, "dir.yaml: not a regular file")
    os.mkfifo(tmp_path / "fifo.yaml")
    clean_error(kiln(tmp_path, "--params", "fifo.yaml", "targets", timeout=60), 2, "fifo.yaml: not a regular file")


@pytest.fixture
def profile_root(tmp_path) -> Path:
    (tmp_path / "profiles").mkdir()
    shutil.copy(REPO / "profiles/bf16.yaml", tmp_path / "profiles/bf16.yaml")
    _with(tmp_path, PARAMS)
    return tmp_path


@pytest.mark.parametrize("text, needle", [
    ("targets:\n  ort-cpu:\n    enabled: true\n    enabled: false\n", "line 4: duplicate key `enabled`"),
    ("engines:\n  x: {model: embedder, since: 2020-02-30}\n", "line 2: day is out of range for month"),
    (f"engines: {_laughs(6)}\n", "holds more than"),
], ids=["duplicate key", "bad date", "alias chain"])
def test_a_bad_profile_is_one_line(profile_root, text, needle):
    """[one line] A profile is YAML a user writes too: the same bounds and errors as params.yaml."""
    _with(profile_root / "profiles", text, "mine.yaml")
    before = (profile_root / "params.yaml").read_bytes()
    r = kiln(profile_root, "profile", "mine")
    clean_error(r, 2, "profiles/mine.yaml: ", needle)
    assert len(r.stderr) < 1000, len(r.stderr)
    assert (profile_root / "params.yaml").read_bytes() == before


def test_a_profile_onto_params_with_a_duplicate_key_is_one_line(profile_root):
    """[one line] Applying a profile used to read params.yaml with ruamel alone: a DuplicateKeyError traceback."""
    text = _set("cosine_min", "0.99\n  cosine_min: -1.0")
    _with(profile_root, text)
    clean_error(kiln(profile_root, "profile", "bf16"), 2, "params.yaml: line", "duplicate key `cosine_min`")
    assert (profile_root / "params.yaml").read_text() == text
