"""`kiln validate-release NAME VERSION`: validate a registered version on this host and attach the verdict.

What a host with the runtime runs for a build-only version (a tensorrt-rtx engine built on a CPU, registered with
verdict `not-run` and alias `built`) — the GPU leg of a CI matrix:

1. download the version and prove it (files, manifest and stored verdict against the digests logged at
   registration; pipeline/registry/aliases.py), then refuse early if this host cannot run it either;
2. check that this checkout's golden reference is the one the build host used (the stored validation manifest
   names its identity digest): a verdict against other goldens would not be comparable;
3. gate it on the face task exactly as validate@ does (pipeline/gates/verdict.py `judge`: the engine files are
   verified again before they are loaded — loading an engine runs native code);
4. log the new validation.json and its manifest as a run of the experiment `kiln-validations`, with the version,
   the engine's identity digest and the validation manifest's digest as run parameters (immutable), and the host
   and its runtime as tags;
5. on a pass, move `candidate` to the version (recorded in the release history). `kiln promote` then accepts it:
   it finds this run, downloads and re-verifies it against its parameters, and reads the verdict from it.

A fail is attached too (the history shows it) and exits 1; nothing is ever overwritten.
"""

from __future__ import annotations

import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths, targets
from pipeline.dvcfiles import address
from pipeline.errors import KilnError
from pipeline.manifest import identity_digest, manifest_path, read_manifest, read_verified

if TYPE_CHECKING:
    from pipeline.config import Config


@dataclass(frozen=True)
class Revalidation:
    name: str
    version: int
    verdict: str              # pass | fail
    run_id: str
    failures: list[str]
    moved: bool               # candidate moved to this version

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def line(self) -> str:
        head = f"validate-release: {self.name} v{self.version}: {self.verdict.upper()} (attached as run {self.run_id})"
        if self.failures:
            return head + ": " + "; ".join(self.failures)
        return head + ("; candidate → v%d, promotable with kiln promote" % self.version if self.moved else "")


def _golden_check(stored_vmanifest: dict, cfg: Config, model: str, root: Path, where: str) -> None:
    stored = [r for r in stored_vmanifest.get("inputs", []) if r.get("role") == "golden"]
    local = read_verified(manifest_path(paths.golden(model, root), model), fast=True)
    if stored and stored[0].get("xxh3_128") != identity_digest(local):
        raise KilnError(f"{where}: this checkout's golden reference for {model} differs from the one the version was "
                        "validated against at build", "check out the commit that built it and rebuild the goldens "
                        f"(dvc repro {address(f'golden@{model}')})")


def run(cfg: Config, name: str, version: int, root: Path = Path(".")) -> Revalidation:
    from mlflow.entities import Param

    from pipeline.registry.client import Registry, errors, registered_name
    from pipeline.registry.aliases import (CANDIDATE, KILN_DIR, PARAM, VALIDATIONS_EXPERIMENT, AliasMove, actor_name,
                                           download_verified, move_alias, now, settle)
    from pipeline.dagtools import dag
    from pipeline.gates.verdict import judge

    name = registered_name(cfg, name)
    root = Path(root)
    reg = Registry(cfg, root)
    with errors(reg.uri), tempfile.TemporaryDirectory(prefix="kiln-revalidate-") as tmp:
        reg.require_model(name)
        v = download_verified(reg, name, version, Path(tmp) / "version")
        artifact = v.params[PARAM + "artifact"]
        m = v.manifest
        if m.get("kind") != "engine":
            raise KilnError(f"{name} v{version}: a {m.get('kind')}, not an engine", "validate-release gates engines")
        spec = cfg.engine(artifact)
        if (spec.model, spec.target, spec.precision) != (m.get("model"), m.get("target"), m.get("precision")):
            raise KilnError(f"{name} v{version}: stored {m.get('model')}/{m.get('target')}/{m.get('precision')}, but "
                            f"{cfg.source} engines.{artifact} is {spec.model}/{spec.target}/{spec.precision}",
                            "use the params (profile) the version was built with")
        ok, why = targets.get(spec.target).runnable(v.directory)
        if not ok:
            raise KilnError(f"{name} v{version}: cannot validate it on this host: {why}",
                            "run kiln validate-release on a host with the runtime (for tensorrt-rtx: an RTX GPU)")
        vm = read_manifest(manifest_path(v.directory / KILN_DIR, artifact))
        _golden_check(vm, cfg, spec.model, root, f"{name} v{version}")
        ref = {"role": "engine", "manifest": f"models:/{name}/{version}", "xxh3_128": identity_digest(m)}
        out = Path(tmp) / "validation"
        verdict = judge(cfg, artifact, v.directory, ref, out, root, declaration=dag.find("validate"))
        new_vm = read_verified(manifest_path(out, artifact))
        probe = targets.get(spec.target).probe()
        client = reg.client
        eid = reg.experiment_id(VALIDATIONS_EXPERIMENT)
        tags = {"model": name, "version": str(version), "verdict": verdict.verdict, "host": socket.gethostname(),
                "actor": actor_name(), "at": now(), **{f"runtime.{k}": str(x) for k, x in probe.rebuild_on.items()}}
        run_ = client.create_run(eid, run_name=f"validate {name} v{version}", tags=tags)
        rid = run_.info.run_id
        try:
            client.log_batch(rid, params=[Param(k, x) for k, x in sorted({
                PARAM + "registered_model": name, PARAM + "version": str(version),
                PARAM + "manifest_xxh3_128": identity_digest(m), PARAM + "sha256": v.params[PARAM + "sha256"],
                PARAM + "validation_manifest_xxh3_128": identity_digest(new_vm),
                PARAM + "verdict": verdict.verdict}.items())])
            client.log_artifacts(rid, str(out), KILN_DIR)
        except BaseException:
            client.set_terminated(rid, "FAILED")
            raise
        client.set_terminated(rid, "FINISHED")
        client.set_model_version_tag(name, str(version), "validation_attached", f"{verdict.verdict} (run {rid})")
        moved = False
        if verdict.passed:
            with reg.lock(name):
                settle(reg, name)
                previous = reg.aliases(name).get(CANDIDATE)
                if previous != version:
                    move_alias(reg, AliasMove(name, CANDIDATE, previous, version, "validate-release", actor_name(),
                                              now(), f"validation pass attached by run {rid} on "
                                                     f"{socket.gethostname()}"))
                    moved = True
    return Revalidation(name, version, verdict.verdict, rid, verdict.failures, moved)


__all__ = ["Revalidation", "run"]
