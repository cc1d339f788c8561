"""kiln-runtime: runs a released Kiln face system on a deployment host — no torch, DVC, MLflow or onnx."""

__version__ = "0.1.0"
