"""Model roles: what a graph is for (embedder, MTCNN nets, single-shot detector, RetinaFace, aligner), one module
each behind the protocol in base.py; registry.py maps params' `samples` value to its module without importing it;
inputs.py holds what the roles share to make their feeds (image sets of chips, the reference MTCNN detector, the
photos)."""
