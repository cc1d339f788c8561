"""Matching: synthetic-but-realistic galleries (gallery.py) and FAISS index build, search and recall (index.py)."""
