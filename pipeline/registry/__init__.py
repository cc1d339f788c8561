"""Kiln's edge to the MLflow model registry, one job per module:

    client.py     where the registry is, bounded waits, one-line redacted errors, safe SQLite first use, locks
    registration.py   log + register an engine or an index once per content digest (immutable digests as run params)
    aliases.py    verified download, promote / rollback under the model's lock, alias history
    receipts.py   the receipt register@ / register-index@ write and print
    sync.py       `kiln registry sync`: every built, validated artifact registered
"""

from pipeline.registry.client import Registry, redact, registered_name
from pipeline.registry.registration import Receipt, Registrable, engine_registrable, index_registrable, register
from pipeline.registry.aliases import (CANDIDATE, PRODUCTION, AliasMove, check_version, fetch_release, history,
                                       promote, rollback)

__all__ = ["AliasMove", "CANDIDATE", "PRODUCTION", "Receipt", "Registrable", "Registry", "check_version",
           "engine_registrable", "fetch_release", "history", "index_registrable", "promote", "redact", "register",
           "registered_name", "rollback"]
