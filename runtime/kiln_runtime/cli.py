"""`kiln-run`: a released face system on a deployment host — no checkout, no torch, DVC, MLflow or onnx.

    kiln-run verify   ARCHIVE --key K.pub              verify offline: signature, then every content check
    kiln-run identify ARCHIVE --key K.pub PHOTO…       who is in each photo (as `kiln identify --release` prints it)
    kiln-run bench    ARCHIVE --key K.pub PHOTO…       the sustained-load sweep on this host, in process and
                                                       (--http) through `serve` over loopback, side by side
    kiln-run serve    ARCHIVE --key K.pub --port N     the HTTP service (kiln_runtime/serve.py)
    kiln-run pull     REF --key K.pub --out DIR        fetch a release from an OCI registry by tag or digest, check
                                                       every digest, verify it, and only then place it in DIR
    kiln-run gallery  COMMAND STORE …                  the live gallery: init, enrol, list, delete, erase, verify,
                                                       audit, snapshot, restore (kiln_runtime/gallery_cli.py)
    kiln-run shadow-report LOG                         what a shadow candidate (serve --shadow) agreed on, and its
                                                       p99 beside production's (kiln_runtime/shadow_cli.py)

Each command that takes ARCHIVE takes an OCI reference too (HOST[:PORT]/PATH/NAME:TAG or …@sha256:DIGEST): pulled and
verified into a private temporary folder first (kiln_runtime/oci.py).

Loading an engine runs native code (ONNX Runtime / OpenVINO kernels named by the graph): every command verifies the
archive against the publisher's key first, and every engine's files again as it loads. Errors are one
`kiln-run: error:` line and a hint (exit 2; a failed verification exits 1), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from kiln_runtime.errors import GateFailed, KilnError
from kiln_runtime.files import write_json

if TYPE_CHECKING:
    import numpy as np

    from kiln_runtime.system import System

PROG = "kiln-run"
MAX_MESSAGE = 4000                    # characters of one error line


class Terminated(KeyboardInterrupt):
    """SIGTERM outside `serve`'s drain: unwinds like Ctrl-C, so the extracted release is removed."""


def _terminated(signum, frame) -> None:       # noqa: ARG001 — the signal handler's signature
    raise Terminated()


# ---------------------------------------------------------------------------------------------- printing
def print_identities(system: System, rgbs: list[tuple[str, np.ndarray]], out: Callable[..., None] = print) -> int:
    """Each photo's faces: box, score, identity (or `unknown`), nearest and distance; 1 if a photo has none. The
    build's `kiln identify` prints with this too."""
    from kiln_runtime.images import MAX_SIDE
    from kiln_runtime.text import shown

    out("engines: " + ", ".join(f"{m}={shown(e)}" for m, e in system.engines.items()))
    spec = system.spec
    rule = f"cosine ≥ {spec.threshold:g}" if spec.metric == "cosine" else f"L2 < {spec.threshold:g}"
    missing = 0
    for path, rgb in rgbs:
        matches = system.identify(rgb)
        note = f" (downscaled to {rgb.shape[1]}×{rgb.shape[0]})" if max(rgb.shape[:2]) == MAX_SIDE else ""
        name = shown(path, 1000)                                                   # a user's file name
        if not matches:
            out(f"{name}: no face found{note}")
            missing += 1
            continue
        out(f"{name}: {len(matches)} face{'s' if len(matches) > 1 else ''}{note}")
        for i, m in enumerate(matches):
            box = ", ".join(f"{v:.0f}" for v in m.box)
            near = f"nearest {shown(m.nearest, 64)}, {m.metric} {m.distance:.3f}" if m.nearest else "gallery empty"
            out(f"  face {i + 1}: box [{box}] score {m.score:.3f} → {shown(m.identity, 64)} "     # a file's labels
                f"({near}; same person when {rule})")
    return 1 if missing else 0


def _photos(paths: list[str]):
    from kiln_runtime.images import load_rgb

    return [(p, load_rgb(Path(p))) for p in paths]


# ---------------------------------------------------------------------------------------------- commands
def _source(args):
    """ARCHIVE as a local file: the file itself, or a registry reference pulled and verified into a temporary
    folder (removed when the command ends)."""
    from kiln_runtime import oci

    return oci.local(args.archive, Path(args.key), args.plain_http,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))


def cmd_verify(args) -> int:
    from kiln_runtime import release

    with _source(args) as archive, \
            release.verified(archive, Path(args.key), allow_drift=args.allow_runtime_drift) as (_, checked):
        for line in checked:
            print(f"ok  {line}")
    print(f"verified: {args.archive}")
    return 0


def cmd_identify(args) -> int:
    from kiln_runtime import release
    from kiln_runtime.serve import answer
    from kiln_runtime.text import shown

    rgbs = _photos(args.photos)                       # a bad photo is refused before anything is extracted
    with _source(args) as archive, \
            release.verified(archive, Path(args.key), allow_drift=args.allow_runtime_drift) as (tree, checked):
        d = release.load(tree, checked)
        if args.gallery:                                # the live gallery's people, not the release's
            from kiln_runtime.gallery import binding_of
            from kiln_runtime.gallery_cache import Live

            live = Live(Path(args.gallery), binding_of(tree))
            d.system.gallery = live.gallery()
            live.store.close()
        if args.json:                                  # JSON escapes every control character itself
            for path, rgb in rgbs:
                print(json.dumps({"photo": path, **answer(d.system.identify(rgb), d.name, d.version, rgb.shape[:2])},
                                 sort_keys=True))
            return 0
        print(f"release: {shown(args.archive, 1000)} verified offline ({d.name} v{d.version}: {len(checked)} checks, "
              f"signature by {shown(Path(args.key).name, 200)})")
        return print_identities(d.system, rgbs)


def cmd_serve(args) -> int:
    from kiln_runtime.connections import Bounds
    from kiln_runtime.serve import Settings, check_host, serve

    check_host(args.host)                                   # before a registry is asked for anything
    cores = _cores()
    if args.workers > cores:
        raise KilnError(f"--workers {args.workers} on a host with {cores} core(s): each worker runs the whole system "
                        "with its own engines, so more workers than cores only queue for the CPU and memory",
                        f"pass --workers {cores} or fewer (0: one per core)")
    token = _token(args.token_file) if args.gallery else None
    if args.auth_reads and token is None:
        raise KilnError("--auth-reads needs a token to check reads against",
                        "pass --token-file FILE (or set KILN_GALLERY_TOKEN) with --gallery STORE")
    from contextlib import nullcontext

    from kiln_runtime import oci
    from kiln_runtime.shadow_cli import shadow_settings

    shadow = shadow_settings(args)
    settings = Settings(args.host, args.port, args.workers or cores, args.max_batch, args.queue, args.max_bytes,
                        args.max_pixels, args.request_timeout, Bounds(args.header_timeout, args.body_timeout,
                                                                      args.max_connections, args.keep_alive),
                        args.drain_delay, args.graceful_timeout, Path(args.gallery) if args.gallery else None, token,
                        args.auth_reads, args.allow_runtime_drift, shadow)
    say = lambda m: print(m, file=sys.stderr, flush=True)      # noqa: E731
    with _source(args) as archive, (nullcontext(None) if shadow is None else
                                    oci.local(args.shadow, shadow.key, args.plain_http, progress=say)) as cand:
        if shadow is not None:
            from dataclasses import replace

            settings = replace(settings, shadow=replace(shadow, archive=cand))
        return serve(archive, Path(args.key), settings)


TOKEN_ENV = "KILN_GALLERY_TOKEN"


def _token(path: str | None) -> bytes | None:
    """The bearer token gallery writes need: the first line of --token-file (a regular file of at most 4 KiB), else
    $KILN_GALLERY_TOKEN; None when neither is given (writes are then refused). Never printed."""
    from kiln_runtime.files import open_regular

    if path:
        with open_regular(Path(path), "pass a file holding the token on its first line") as f:
            raw = f.read(4097)
        if len(raw) > 4096:
            raise KilnError(f"{path}: more than 4 KiB; a token file holds one line", "put the token alone in it")
        text = raw.decode("utf-8", "replace").splitlines()[0].strip() if raw.strip() else ""
    else:
        text = os.environ.get(TOKEN_ENV, "").strip()
        if not text:
            return None
    if len(text) < 16:
        raise KilnError(f"the gallery token ({'--token-file' if path else TOKEN_ENV}) is shorter than 16 characters",
                        "use a long random one, e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return text.encode()


def cmd_pull(args) -> int:
    from kiln_runtime import oci

    ref = oci.parse_ref(args.ref)
    got = oci.pull(ref, Path(args.key), Path(args.out), args.plain_http, args.max_bytes,
                   progress=lambda m: print(m, flush=True))
    for line in (*got.checked, *got.notes):
        print(f"ok  {line}")
    print(f"ok  reference: {ref} names system {got.system}" + (f" v{got.version}" if ref.tag and
                                                              oci.VERSION_TAG.fullmatch(ref.tag) else ""))
    where = "→" if got.placed else "already there, the same bytes:"
    print(f"verified: {got.system} v{got.version}, manifest {got.digest} {where} {got.archive}")
    return 0


def cmd_bench(args) -> int:
    from kiln_runtime import frames, loadtest, release

    from kiln_runtime.images import decode_bytes

    # the frames as a camera sends them (JPEG): the service decodes each request's bytes, the in-process sweep runs
    # the same decoded pixels, so both see the same faces and only serving's own cost differs
    bodies = [loadtest.jpeg(f) for f in frames.frames([rgb for _, rgb in _photos(args.photos)],
                                                      (args.width, args.height))]
    feed = [decode_bytes(b, "frame") for b in bodies]
    if args.json:
        _writable(Path(args.json))
    workers = args.workers or _cores()
    plan = loadtest.Plan(tuple(args.streams), args.fps, args.seconds, args.budget_ms, args.max_batch, workers,
                         max(1, _cores() // workers))
    from kiln_runtime.host import host_class

    host = host_class()
    with _source(args) as archive, \
            release.verified(archive, Path(args.key), allow_drift=args.allow_runtime_drift) as (tree, checked):
        d = release.layout(tree)                  # the workers load the engines; this process only names the release
        label = f"{d.name} v{d.version}"
        inproc = loadtest.sweep(plan, label, "kiln_runtime.release:release_system", {"tree": str(tree)}, feed,
                                progress=lambda m: print(m, file=sys.stderr, flush=True))
        report = {"system": d.name, "version": d.version, "host_class": host, "frames": {
            "distinct": len(feed), "resolution": [args.width, args.height], "fps": args.fps,
            "sha256": frames.digest(feed), "encoding": "JPEG q95 (decoded for the in-process sweep)"},
            "budget": {"p99_ms": args.budget_ms}, "in_process": inproc}
        if args.http:
            report["http"], report["serve_start_s"] = _bench_http(args, archive, plan, bodies, label)
    _print_sweep("in process", inproc, args)
    if args.http:
        _print_sweep("over HTTP (kiln-run serve, loopback)", report["http"], args)
        a, b = inproc["streams_at_budget"], report["http"]["streams_at_budget"]
        print(f"serve holds {b} of the {a} stream(s) held in process ({b / a:.0%})" if a else
              f"serve holds {b} stream(s); none held in process", f"— start → ready {report['serve_start_s']:.2f} s")
    print(f"host class {host}; {plan.workers} worker(s) × {plan.threads} thread(s) per engine; "
          f"p99 budget {args.budget_ms:g} ms at {args.fps:g} fps {args.width}×{args.height}")
    if args.json:
        write_json(Path(args.json), report)
        print(f"→ {args.json}")
    return 0


def _bench_http(args, archive: Path, plan, bodies: list[bytes], label: str) -> tuple[dict, float]:
    """Start `kiln-run serve` on a free loopback port (a child process, as a deployment runs it), wait for /readyz,
    sweep it over HTTP, SIGTERM it; (the sweep, start → ready seconds)."""
    import signal
    import subprocess
    import urllib.request

    from kiln_runtime import loadtest
    from kiln_runtime.serve import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", "kiln_runtime.cli", "serve", str(archive), "--key",
                              str(args.key), "--port", str(port), "--workers", str(plan.workers), "--max-batch",
                              str(plan.max_batch), "--drain-delay", "0"], stdout=subprocess.DEVNULL)
    try:
        while True:
            if child.poll() is not None:
                raise KilnError(f"kiln-run serve exited ({child.returncode}) before it was ready", "run it alone to "
                                "see why: kiln-run serve ARCHIVE --key K.pub --port N")
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 120:
                raise KilnError("kiln-run serve was not ready within 120 s", "run it alone to see why")
            time.sleep(0.02)
        ready = time.monotonic() - t0
        sweep = loadtest.sweep_http(plan, url, bodies, progress=lambda m: print(m, file=sys.stderr, flush=True),
                                    label=label)
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=40)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return sweep, ready


def _print_sweep(title: str, sweep: dict, args) -> None:
    print(f"{title}:")
    print("  streams  fps     p50 ms   p99 ms   dropped  CPU s/frame  batch  in budget")
    for p in sweep["points"]:
        lat = p["latency_ms"]
        print(f"  {p['streams']:>7}  {p['achieved_fps']:>6.1f}  {_num(lat['p50']):>7}  {_num(lat['p99']):>7}  "
              f"{p['dropped']:>7}  {_num(p['cpu_s_per_frame'], 4):>11}  {_num(p['mean_batch'], 2):>5}  "
              f"{'yes' if p['within_budget'] else 'no'}")
    held = max((p for p in sweep["points"] if p["within_budget"]), key=lambda p: p["streams"], default=None)
    if held and held.get("stage_ms_per_frame"):
        total = sum(held["stage_ms_per_frame"].values()) or 1.0
        shares = sorted(held["stage_ms_per_frame"].items(), key=lambda kv: -kv[1])[:5]
        print(f"  at {held['streams']} stream(s), per frame: " + ", ".join(f"{s} {v / total:.0%}" for s, v in shares))
    print(f"  streams at p99 ≤ {args.budget_ms:g} ms: {sweep['streams_at_budget']}")


def _num(v, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _writable(path: Path) -> Path:
    """--json FILE checked before a long sweep: its folder exists and is writable."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise KilnError(f"{path}: its folder {folder} does not exist or is not writable", "pass --json in a writable "
                        "folder")
    return path


def _cores() -> int:
    from kiln_runtime.loadtest import cores

    return cores()


# ---------------------------------------------------------------------------------------------- parsing
def _streams(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of stream counts") from None
    if not vals or any(v < 1 or v > 1024 for v in vals) or vals != sorted(set(vals)):
        raise argparse.ArgumentTypeError("stream counts are 1-1024, increasing, e.g. 1,2,4,8")
    return vals


def _positive(kind: type, low: float, high: float) -> Callable[[str], float]:
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{text} is outside {low:g}-{high:g}")
        return v
    return parse


def drift_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-runtime-drift", action="store_true", help="run engines whose runtime on this host is "
                   "outside the release's requirement (another version, another host class) — each only after its "
                   "golden check passes here, on the samples the release carries")


def build_parser() -> argparse.ArgumentParser:
    from kiln_runtime.images import WIRE_MAX_PIXELS

    parser = argparse.ArgumentParser(prog=PROG, description="Run a released Kiln face system: pull it from an OCI "
                                     "registry, verify it, identify faces, benchmark it on this host, serve it over "
                                     "HTTP.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def release_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("archive", help="the system release archive (kiln-system-NAME-vN.tar.gz), or an OCI reference "
                       "HOST[:PORT]/PATH/NAME:TAG or …@sha256:DIGEST (pulled and verified first)")
        key_args(p)
        drift_arg(p)

    def key_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--key", required=True, help="the publisher's public key (KEY.pub, from kiln keygen)")
        p.add_argument("--plain-http", action="store_true", help="a registry reference over plain HTTP, not TLS "
                       "(credentials: KILN_OCI_USERNAME / KILN_OCI_PASSWORD or the docker config file)")

    p = sub.add_parser("verify", help="verify a release offline: signature, every content check, and that this "
                       "host's runtime may run its engines")
    release_args(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("identify", help="who is in each photo")
    release_args(p)
    p.add_argument("photos", nargs="+", metavar="PHOTO", help="image files (JPEG, PNG, BMP, WebP)")
    p.add_argument("--json", action="store_true", help="one JSON answer per photo (as POST /v1/identify gives it)")
    p.add_argument("--gallery", metavar="STORE", help="identify against a live gallery store (bound to this "
                   "release's embedder) instead of the release's own gallery")
    p.set_defaults(func=cmd_identify)

    p = sub.add_parser("bench", help="the sustained-load sweep on this host against the release itself")
    release_args(p)
    p.add_argument("photos", nargs="+", metavar="PHOTO", help="photos the frames are made of: the scenes your cameras "
                   "see, one or two faces each")
    p.add_argument("--streams", type=_streams, default=[1, 2, 4, 6, 8], help="stream counts to sweep (1,2,4,6,8)")
    p.add_argument("--fps", type=_positive(float, 0.1, 240), default=10.0, help="frames per second per stream (10)")
    p.add_argument("--seconds", type=_positive(float, 0.5, 600), default=5.0, help="measured seconds per point (5)")
    p.add_argument("--budget-ms", type=_positive(float, 1, 60000), default=100.0, help="p99 latency budget (100)")
    p.add_argument("--width", type=_positive(int, 64, 4096), default=640, help="frame width (640)")
    p.add_argument("--height", type=_positive(int, 64, 4096), default=480, help="frame height (480)")
    p.add_argument("--max-batch", type=_positive(int, 1, 256), default=8, help="frames a worker takes at once (8)")
    p.add_argument("--workers", type=_positive(int, 0, 256), default=0, help="worker processes (0: one per core)")
    p.add_argument("--http", action="store_true", help="also sweep `kiln-run serve` over loopback HTTP and print "
                   "the ratio")
    p.add_argument("--json", metavar="FILE", help="write the whole report as JSON")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("serve", help="serve the release over HTTP (POST /v1/identify, /healthz, /readyz, /metrics)")
    release_args(p)
    p.add_argument("--port", type=_positive(int, 1, 65535), required=True, help="TCP port")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--workers", type=_positive(int, 0, 256), default=0, help="worker processes, each with its own "
                   "copy of the system (0: one per core; at most one per core)")
    p.add_argument("--max-batch", type=_positive(int, 1, 256), default=8, help="frames a worker takes at once (8)")
    p.add_argument("--queue", type=_positive(int, 1, 100000), default=64, help="frames the service holds at once, "
                   "queued or being run, before it answers 503 (64)")
    p.add_argument("--max-bytes", type=_positive(int, 1024, 1 << 30), default=20 << 20,
                   help="largest request body in bytes (20 MiB)")
    p.add_argument("--max-pixels", type=_positive(int, 4096, 100_000_000), default=WIRE_MAX_PIXELS,
                   help="largest image in pixels, refused from its header before decoding (4096×4096 = 16.8 MP; a 4K "
                   "camera frame is 8.3 MP)")
    p.add_argument("--request-timeout", type=_positive(float, 0.1, 3600), default=15.0, metavar="S",
                   help="longest a request waits for its answer (504 after); a worker running a batch this long is "
                   "replaced (15)")
    p.add_argument("--header-timeout", type=_positive(float, 0.1, 600), default=10.0, metavar="S",
                   help="a request's head must arrive within S seconds (408 after) (10)")
    p.add_argument("--body-timeout", type=_positive(float, 0.1, 3600), default=30.0, metavar="S",
                   help="its body within S seconds of the head (408 after) (30)")
    p.add_argument("--keep-alive", type=_positive(float, 0.1, 600), default=5.0, metavar="S",
                   help="an idle keep-alive connection is closed after S seconds (5)")
    p.add_argument("--max-connections", type=_positive(int, 8, 1_000_000), default=1000,
                   help="open connections; past it the oldest one holding no answer is closed (1000)")
    p.add_argument("--drain-delay", type=_positive(float, 0, 600), default=5.0, metavar="S",
                   help="after SIGTERM, /readyz answers 503 and everything else is still served for S seconds before "
                   "the port closes (5; Kubernetes: keep it under terminationGracePeriodSeconds minus "
                   "--graceful-timeout minus 10)")
    p.add_argument("--graceful-timeout", type=_positive(float, 0, 3600), default=30.0, metavar="S",
                   help="then requests in flight get at most S seconds to finish (30)")
    p.add_argument("--gallery", metavar="STORE", help="a live gallery store (SQLite; made from the release's own "
                   "gallery if missing): enrol, erase, verify over /v1/subjects, identify against it")
    p.add_argument("--token-file", metavar="FILE", help=f"the bearer token gallery writes need (else ${TOKEN_ENV}; "
                   "with neither, writes are refused)")
    p.add_argument("--auth-reads", action="store_true", help="gallery reads and identify need the token too")
    from kiln_runtime import shadow_cli

    shadow_cli.serve_args(p)
    p.set_defaults(func=cmd_serve)

    from kiln_runtime.gallery_cli import add_parser

    add_parser(sub)
    shadow_cli.add_parser(sub)

    p = sub.add_parser("pull", help="fetch a release from an OCI registry, check every digest, verify it, place it")
    p.add_argument("ref", metavar="REF", help="HOST[:PORT]/PATH/NAME:TAG or HOST[:PORT]/PATH/NAME@sha256:DIGEST (NAME "
                   "is the system's name; a tag is a hint, the digest and the signature decide)")
    key_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="the folder the verified archive is placed in "
                   "(created if missing; a failed pull places nothing)")
    from kiln_runtime.oci import MAX_BLOB

    p.add_argument("--max-bytes", type=_positive(int, 1, 1 << 40), default=MAX_BLOB, help="largest release archive "
                   f"accepted, before fetching it ({MAX_BLOB >> 30} GiB)")
    p.set_defaults(func=cmd_pull)
    return parser


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    for stream in (sys.stdout, sys.stderr):       # an ASCII locale escapes `→`, `×` instead of raising
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower().replace("-", "") != "utf8":
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return args.func(args)
    except KilnError as e:            # a message may quote a path or a value a user chose: shown, never interpreted
        from kiln_runtime.text import shown

        failed = isinstance(e, GateFailed)
        print(f"{PROG}: error: {'verification failed: ' if failed else ''}{shown(e.message, MAX_MESSAGE)}",
              file=sys.stderr)
        if e.hint:
            print(f"hint: {shown(e.hint, MAX_MESSAGE)}", file=sys.stderr)
        return 1 if failed else 2
    except KeyboardInterrupt as e:
        print(f"{PROG}: {'terminated (SIGTERM)' if isinstance(e, Terminated) else 'interrupted'}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except MemoryError:
        print(f"{PROG}: error: out of memory", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
