"""Calibration and quantization: preprocessing, activation ranges, QDQ graphs (shared by calibrate, quantize,
debug-precision and the mixed-precision search)."""
