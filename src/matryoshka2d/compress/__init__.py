"""Compression beyond the first k numbers: two-step pooler training, SMAE pre-training, post-hoc reducers."""
