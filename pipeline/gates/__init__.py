"""Gates: face-task metrics, the golden reference, export parity, the evaluation a stage gates on and the verdict it
writes, and the side-by-side timings bench@ gates on (the speed gate and its per-engine verdict files)."""
