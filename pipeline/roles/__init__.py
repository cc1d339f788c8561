"""Model roles: what a graph is for (embedder, MTCNN nets, single-shot detector, aligner), one module each behind
the protocol in pipeline/roles/base.py."""
