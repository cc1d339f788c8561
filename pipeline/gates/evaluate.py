"""The face-task evaluation a gate applies: a runner of a model (an engine, or an ONNX candidate on ORT) against the
model's golden reference — the metrics of its role, the failures against params.yaml `validate:` — and the
verdict validate@ records. Used by validate@, calibrate@ (choice of method), `kiln mixed` and `kiln rebuild-check`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.config import ValidateConfig
from pipeline.gates import facemetrics
from pipeline.roles import registry as roles

if TYPE_CHECKING:
    from pipeline.config import Config



class OnnxRunner:
    """An ONNX file on ONNX Runtime's CPU kernels, with the runner interface `evaluate_model` calls: how a candidate
    model that is not an engine yet (a calibration, a float set) is judged, as the ort-cpu engine would run it —
    or, `portable`, on the session the portable stages use (pipeline/portable.py: QDQ as float arithmetic, the same
    numbers on every x86-64 CPU)."""

    def __init__(self, path: Path, portable: bool = False) -> None:
        import onnxruntime as ort

        if portable:
            from pipeline.portable import ort_session

            self.session = ort_session(path)
            return
        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.session.get_inputs()[0].name: x})[0]

    def run_all(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, feed)


NOT_RUN = "not-run"


@dataclass(frozen=True)
class Verdict:
    engine: str
    passed: bool
    metrics: dict[str, float]
    failures: list[str]
    verdict: str = "pass"          # pass | fail | not-run
    reason: str = ""               # why not run


def gate(m: dict[str, float], v: ValidateConfig) -> list[str]:
    return facemetrics.gate(m, asdict(v))


def evaluate(cfg: Config, engine_name: str, runner, root: Path = Path(".")) -> tuple[dict, list[str], dict, dict]:
    """(metrics, failures, limits, extra) of one engine's runner on its model's face-task gate."""
    return evaluate_model(cfg, cfg.engine(engine_name).model, runner, root)


def evaluate_model(cfg: Config, model: str, runner, root: Path = Path(".")) -> tuple[dict, list[str], dict, dict]:
    """(metrics, failures, limits, extra) of a runner of `model` on its role's face-task gate (pipeline/roles/)."""
    role = roles.get(cfg.model(model).samples)
    metrics, extra = role.measure(cfg, model, runner, root)
    failures, limits = role.gate(cfg, metrics)
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not np.isfinite(v)]
    if bad:
        failures = failures + [f"{k} is not finite" for k in bad]
    return metrics, failures, limits, extra
