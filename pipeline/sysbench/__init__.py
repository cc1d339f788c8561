"""Face systems under sustained load (sysbench@<system>): a deterministic frame source (frames.py), N concurrent
streams run by worker processes (load.py), and where the time goes — per-stage shares, a roofline point per graph,
Amdahl headroom (roofline.py)."""
