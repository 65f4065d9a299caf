"""Retrieval with elastic cells: faiss indexes of (layer, dim) cells built in one pass over a corpus, cascade
and asymmetric search, and their evaluation against flat search."""
