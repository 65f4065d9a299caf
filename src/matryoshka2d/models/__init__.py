"""The model: backbones, exits, pooler heads, and its folder on disk."""
