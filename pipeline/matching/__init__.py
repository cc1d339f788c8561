"""Matching: synthetic-but-realistic galleries (gallery.py), FAISS index build, search and recall (index.py), and
the index sweep measured in one process with its choice and identity gate (sweep.py)."""
