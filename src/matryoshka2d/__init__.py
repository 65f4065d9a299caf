"""matryoshka2d: sentence embeddings elastic in depth and width.

One trained model serves any (layer, dim) cell, and a small cell really runs fewer layers.
"""

from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.encoder import ElasticEncoder

__all__ = ["BackboneError", "ElasticEncoder"]
__version__ = "0.1.0"
