"""Profiles: named overlays on params.yaml (profiles/<name>.yaml) that turn on a target and add its engines.

A profile holds only the keys it changes. `kiln profile NAME` merges it into params.yaml — mappings merge key by
key, anything else replaces — keeping params.yaml's comments, checks the result exactly as every stage would
(schema + target registry), and writes it atomically; params.yaml stays the one file DVC tracks, so the new
engines become ordinary DAG stages (`bash scripts/run.sh` derives them into dvc.yaml). Applying a profile twice
changes nothing. The toolchain a profile needs installs with `bash scripts/setup.sh --profile NAME`.
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
from pathlib import Path
from typing import Any

from pipeline import paths
from pipeline.errors import KilnError

DIR = "profiles"


def path(name: str, root: Path = Path(".")) -> Path:
    p = Path(root) / DIR / f"{paths.slug(name, 'profile')}.yaml"
    if not p.is_file():
        known = sorted(x.stem for x in (Path(root) / DIR).glob("*.yaml"))
        raise KilnError(f"{p}: no such profile", f"known profiles: {', '.join(known) or 'none'}")
    return p


def load(name: str, root: Path = Path(".")) -> dict[str, Any]:
    from pipeline import config

    p = path(name, root)
    overlay = config.read_yaml(p, "see profiles/")    # bounded, duplicate keys refused, as params.yaml
    if not isinstance(overlay, dict) or not overlay:
        raise KilnError(f"{p}: a profile is a mapping of params.yaml sections", "see profiles/rtx.yaml")
    return overlay


def merge(base: dict, overlay: dict, where: str = "") -> list[str]:
    """Merge `overlay` into `base` in place (mappings key by key, other values replace); the keys it changed."""
    changed = []
    for key, value in overlay.items():
        here = f"{where}.{key}" if where else str(key)
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            changed += merge(base[key], value, here)
        elif key not in base or base[key] != value:
            base[key] = copy.deepcopy(value)
            changed.append(here)
    return changed


def merged(raw: dict, overlay: dict) -> dict:
    """A merged copy (for tests and checks; `apply` edits the file keeping its comments)."""
    out = copy.deepcopy(raw)
    merge(out, overlay)
    return out


def _round_trip(rt, p: Path) -> Any:
    """ruamel's YAML 1.2 reading of a file PyYAML (1.1) accepted: the two rarely disagree, never a traceback."""
    from ruamel.yaml.error import YAMLError

    try:
        return rt.load(p.read_text("utf-8"))
    except (YAMLError, ValueError) as e:
        raise KilnError(f"{p}: invalid YAML: {str(e).splitlines()[0][:200]}", "fix the YAML syntax") from None


def apply(name: str, params: Path = Path("params.yaml"), root: Path = Path(".")) -> list[str]:
    """Merge profile `name` into `params` (comments kept), check it as the stages would, write it atomically.
    Returns the keys that changed (empty: it was applied already)."""
    from ruamel.yaml import YAML

    from pipeline import config, targets

    load(name, root)                 # both files checked as plain YAML first: clear errors, bounded
    config.read_yaml(params, "run kiln from the repository root, or pass --params PATH")
    rt = YAML()                      # round-trip: comments, key order, quotes and flow style survive
    rt.preserve_quotes = True
    rt.indent(mapping=2, sequence=4, offset=2)
    rt.width = 4096                  # never break a line mid-mapping (a flow mapping wrapped by hand is joined)
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    params = Path(params)
    overlay, doc = _round_trip(rt, path(name, root)), _round_trip(rt, params)
    changed = merge(doc, overlay)
    if not changed:
        return []
    buf = io.StringIO()
    rt.dump(doc, buf)
    fd, tmp = tempfile.mkstemp(prefix=f".{params.name}.", suffix=".tmp", dir=params.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(buf.getvalue())
        try:
            cfg = config.load(Path(tmp))
            targets.check(cfg)
        except KilnError as e:
            raise KilnError(f"{path(name, root)}: applied to {params}, it gives an invalid configuration: "
                            f"{e.message.replace(tmp, str(params))}", e.hint) from None
        os.replace(tmp, params)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return changed
