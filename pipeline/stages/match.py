"""match@<size>: the FAISS gallery index of one gallery size (gallery@<size>), chosen by recall target.

match@<size>    builds every index of the sweep (params.yaml matching.sweep; one build per (kind, build params),
                nprobe / efSearch variants reuse it), measures the curve against exact search in ONE process —
                recall@1/@10, p50/p99 at batch 1 and 64, build time, bytes, and the memory bandwidth with the exact
                scan's achieved fraction of it — chooses the fastest index (batch-1 p50, then bytes) meeting both
                recall floors, gates it on the face task (golden identities' top-1 as under exact search; open-set
                decisions at the verification threshold on the distances it returns) and writes:
                  artifacts/index/gallery-<size>/   index.faiss + manifest (kind "index")         DVC-cached
                  artifacts/matching/gallery-<size>/  validation.json + manifest: the verdict  cache: false
                  artifacts/matching/gallery-<size>.curve.json        the whole curve (plot)  cache: false

Why one match@ stage per size and not index@<kind>-<size> + choose@<size>: the choice compares timings, and
timings from different processes at different moments on a shared machine are not comparable; the memory bandwidth
must be measured in the same run; every index needs the same exact baseline; and DVC would cache every candidate
index (≈ 1.2 GB at 1M) although only the chosen one ships. The cost: editing one sweep entry rebuilds that size.

Identity vs record (pipeline/manifest.py): the index bytes, its build parameters, the training-sample hash, the
thread count and the recall / gate numbers (pure functions of the inputs) are identity; every timing, the bandwidth
and the whole timed curve are the run's record (artifacts/records/, and the verdict and curve files, which are not
cached). The choice itself follows measured latency, so a rebuild on a differently loaded machine can choose
another index among near-equal ones; the manifest says which and why (README: what is not bit-reproducible).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline import paths, stage
from pipeline.config import Config
from pipeline.dvcfiles import address
from pipeline.errors import GateFailed
from pipeline.manifest import (atomic_dir, atomic_path, build_manifest, identity_digest, input_ref, manifest_path,
                               read_verified, write_json_atomic, write_manifest)
from pipeline.matching import gallery as g
from pipeline.matching import sweep as sw
from pipeline.matching.gallery import MODEL
from pipeline.matching.spec import IndexSpec

INDEX_FILE = "index.faiss"
PRECISION = {"flat": "fp32", "hnsw": "fp32", "ivf-flat": "fp32", "sq8": "int8", "ivf-pq": "pq"}
# Only the matching keys match@ reads: adding a gallery size must not change another size's identity.
PARAMS = ("seed", "queries", "threads", "targets", "nlist_per_sqrt_n", "max_size", "sweep", "latency")

STAGE = stage.Stage(
    "match", "pipeline.stages.match",
    "build the index sweep, measure recall/latency/bandwidth in one run, choose, gate on identities (exit 1)",
    keys=lambda cfg: [str(s) for s in cfg.matching.gallery_sizes],
    deps=lambda cfg, key: [paths.gallery(int(key)).as_posix()],
    params=lambda cfg, key: [*(f"matching.{k}" for k in PARAMS), f"models.{MODEL}.verify_threshold"],
    # all cached: register-index@ and `kiln registry sync` read the verdict on whichever host pulled it
    outs=lambda cfg, key: [stage.Out(paths.index(int(key)).as_posix()),
                           stage.Out(paths.matching(int(key)).as_posix()),
                           stage.Out(paths.curve(int(key)).as_posix(), kind="plots",
                                     plot={"x": "p50_ms_b1", "y": "recall@1",
                                           "title": f"gallery {key} — recall@1 vs batch-1 p50 (ms)"})],
    help="build the FAISS index sweep on a gallery, choose by recall target, gate it (exit 1 = fail)")


@dataclass(frozen=True)
class MatchResult:
    name: str
    size: int
    passed: bool
    chosen: dict | None
    curve: list[dict]
    bandwidth: dict
    failures: list[str]
    directory: Path | None


def run(cfg: Config, size: int, root: Path = Path("."), progress: Callable[[str], None] = sw.to_stderr) -> MatchResult:
    m = cfg.matching
    m.check_size(int(size))
    root = Path(root)
    name = paths.gallery_name(size)
    threshold = cfg.model(MODEL).verify_threshold
    gdir, hint = paths.gallery(size, root), f"rebuild it (dvc repro -f {address(f'gallery@{size}')})"
    gman = manifest_path(gdir, name)
    read_verified(gman, hint=hint)
    vectors, labels, dist = g.load(gdir, size, hint)
    ms = sw.measure(vectors, labels, dist, m, threshold, progress)
    curve, bandwidth, queries, built_by_key = ms.curve, ms.bandwidth, ms.queries, ms.built
    targets = cfg.section("matching", "targets")
    index_dir = paths.index(size, root)

    def verdict(chosen: dict | None, failures: list[str], manifest_file: Path | None) -> None:
        """The verdict (validation.json + manifest, binding it to the index) and the curve: written either way."""
        report = sw.verdict(name, chosen, failures, bandwidth, targets,
                            identity_digest(read_verified(manifest_file)) if manifest_file else None)
        with atomic_dir(paths.matching(size, root)) as out:
            write_json_atomic(out / paths.VALIDATION_FILE, report)
            write_manifest(out, build_manifest(
                kind="validation", name=name, model=MODEL, target="faiss-cpu", directory=out,
                files=[out / paths.VALIDATION_FILE],
                inputs=[input_ref("index", manifest_file, root) if manifest_file else input_ref("gallery", gman, root)],
                build={"gate": "recall floors + identity gate", "timings": "this run's record, not reproducible"},
                results={"verdict": report["verdict"], "failures": failures}, **STAGE.identity(cfg, str(size), root)))
        write_json_atomic(paths.curve(size, root), curve)

    try:
        chosen = sw.choose(curve, m)
    except GateFailed as e:
        verdict(None, [e.message], None)
        raise GateFailed(f"match@{size}: {e.message}", e.hint) from None
    chosen["chosen"] = True
    if failures := sw.gate(chosen, m):
        verdict(chosen, failures, None)
        raise GateFailed(f"match@{size}: identity gate: " + "; ".join(failures),
                         "the chosen index does not find the golden identities as exact search does; raise its "
                         "nprobe / ef in matching.sweep or raise the recall floors")

    sp = IndexSpec.parse(chosen["index"])
    built = built_by_key[sp.build_key]
    data = sw.serialized(built.index, sp, queries, f"match@{size}")
    deterministic = {k: chosen[k] for k in sw.DETERMINISTIC}
    with atomic_dir(index_dir) as dd:
        with atomic_path(dd / INDEX_FILE) as tmp:
            tmp.write_bytes(data)
        write_manifest(dd, build_manifest(
            kind="index", name=name, model=MODEL, target="faiss-cpu", precision=PRECISION[sp.kind], directory=dd,
            files=[dd / INDEX_FILE], inputs=[input_ref("gallery", gman, root)],
            build={"spec": sp.name, "kind": sp.kind, "params": sp.p, "metric": "L2", "threads": built.info["threads"],
                   "seed": built.info["seed"], "train_n": built.info["train_n"],
                   "train_ids_xxh3_128": built.train_ids_xxh3_128, "train_xxh3_128": built.train_xxh3_128},
            results={"chosen": sp.name, **deterministic, "targets": targets,
                     "rule": "fastest batch-1 p50 (then fewest bytes) among indexes meeting both recall floors; "
                             "then the identity gate",
                     "recall": [{k: r[k] for k in ("index", "recall@1", "recall@10", "golden_top1_agreement",
                                                   "decision_agreement")} for r in curve]},
            **STAGE.identity(cfg, str(size), root)))
    verdict(chosen, [], manifest_path(index_dir, name))
    return MatchResult(name, size, True, chosen, curve, bandwidth, [], index_dir)


def main(argv: list[str] | None = None) -> int:
    import time

    def body(args, run_) -> int:
        t0 = time.perf_counter()
        r = run(args.cfg, int(args.key))
        c = r.chosen
        run_.record.update(bandwidth=r.bandwidth, chosen_timing={k: c[k] for k in (
            "p50_ms_b1", "p99_ms_b1", "p50_ms_b64", "p99_ms_b64", "build_s")})
        print(sw.table(r.curve))
        print(sw.bandwidth_line(r.bandwidth))
        print(f"match@{args.key}: chose {c['index']} (recall@1 {c['recall@1']:.4f}, recall@10 {c['recall@10']:.4f}, "
              f"batch-1 p50 {c['p50_ms_b1']:.3f} ms, {c['bytes'] / 1e6:.1f} MB); identity gate PASS in "
              f"{time.perf_counter() - t0:.1f} s → {r.directory}")
        return 0

    return stage.main(STAGE, body, argv, key_help="gallery size from matching.gallery_sizes")


if __name__ == "__main__":
    sys.exit(main())
