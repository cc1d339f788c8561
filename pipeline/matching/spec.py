"""Index spec strings (params.yaml `matching.sweep`), parsed without FAISS so params validation stays light.

    flat                                  exact IndexFlatL2
    sq8                                   IndexScalarQuantizer QT_8bit
    hnsw:M=32,ef=64                       IndexHNSWFlat, efSearch
    ivf-flat:nlist=256,nprobe=16          IndexIVFFlat
    ivf-pq:nlist=256,m=16,nbits=8,nprobe=16
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import KilnError

KINDS = {"flat": (), "sq8": (), "hnsw": ("M", "ef"), "ivf-flat": ("nlist", "nprobe"),
         "ivf-pq": ("nlist", "m", "nbits", "nprobe")}
DEFAULTS = {"hnsw": {"M": 32, "ef": 64}, "ivf-flat": {"nlist": 256, "nprobe": 16},
            "ivf-pq": {"nlist": 256, "m": 16, "nbits": 8, "nprobe": 16}}
SEARCH_KEYS = {"hnsw": ("ef",), "ivf-flat": ("nprobe",), "ivf-pq": ("nprobe",)}   # set at search time


@dataclass(frozen=True)
class IndexSpec:
    kind: str
    params: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, text: str) -> "IndexSpec":
        kind, _, rest = text.strip().lower().partition(":")
        if kind not in KINDS:
            raise KilnError(f"unknown index kind {kind!r} in {text!r}", hint=f"use one of {', '.join(KINDS)}")
        params = dict(DEFAULTS.get(kind, {}))
        for item in filter(None, (p.strip() for p in rest.split(","))):
            k, eq, v = item.partition("=")
            key = next((n for n in KINDS[kind] if n.lower() == k.strip().lower()), None)
            if not eq or key is None:
                raise KilnError(f"bad index parameter {item!r} in {text!r}",
                                hint=f"{kind} takes {', '.join(KINDS[kind]) or 'no parameters'} as key=int")
            try:
                params[key] = int(v)
            except ValueError:
                raise KilnError(f"index parameter {item!r} in {text!r} is not an integer",
                                hint="e.g. ivf-flat:nlist=256,nprobe=16") from None
            if params[key] <= 0:
                raise KilnError(f"index parameter {item!r} in {text!r} must be positive", hint="e.g. nprobe=16")
        return cls(kind, tuple((k, params[k]) for k in KINDS[kind]))

    @property
    def p(self) -> dict[str, int]:
        return dict(self.params)

    @property
    def name(self) -> str:
        return self.kind + (":" + ",".join(f"{k}={v}" for k, v in self.params) if self.params else "")

    @property
    def build_key(self) -> tuple:
        """Specs that differ only in search-time knobs (nprobe, ef) share one build."""
        skip = SEARCH_KEYS.get(self.kind, ())
        return (self.kind, tuple((k, v) for k, v in self.params if k not in skip))

    def __str__(self) -> str:
        return self.name


def spec(s: "str | IndexSpec") -> IndexSpec:
    return s if isinstance(s, IndexSpec) else IndexSpec.parse(s)
