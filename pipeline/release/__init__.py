"""After the DAG: what leaves the build — signed, deterministic release archives and the proof that goes with them.
No stage imports this package (a change here reruns nothing).

    engine.py       `kiln release` / `kiln verify-release` of one engine version: build the archive, verify it
    system.py       the same for a whole face system (`kiln release --system`), and running one from its archive
    content.py      what verify-release checks in a release tree once its signature holds
    signing.py      keys, `sign_tree` (model-signing); verification is the runtime's (kiln_runtime.signature)
    attestation.py  what a release says about how it was built: the chain, lockfile digests, SLSA provenance
    archive.py      the deterministic tar.gz writer (the strict reader is kiln_runtime.archive)
    provenance.py   `kiln provenance`: any artifact's manifest chain down to the pinned archives, re-verified
    revalidate.py   `kiln validate-release`: validate a registered build-only version on a host that can run it

Moving a registry alias (promote, rollback) is pipeline/registry/aliases.py's; this package builds on it.
"""
