"""Evaluation of every (layer, dim) cell: STS, classification, retrieval; tables and heatmaps."""
