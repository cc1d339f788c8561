"""Kiln: reproducible build pipeline for face-recognition deployment artifacts."""

__version__ = "0.1.0"
