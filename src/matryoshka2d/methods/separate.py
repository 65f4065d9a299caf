"""separate: the baseline of the Starbucks and ESE papers, one small model trained on its own.

The backbone is cut to its first n layers and trained at (n, d) alone; the saved model keeps only those n
layers. Because the trainer computes only the layers a view needs, training the (n, d) view of the full
backbone is exactly training the cut model: layers above n never run and never change.
"""

from __future__ import annotations

from matryoshka2d.methods.base import Method, Plan
from matryoshka2d.views import View


class Separate(Method):
    name = "separate"
    summary = "cut the backbone to n layers and train (n, d) alone (the separately-trained baseline)"

    def __init__(self, num_layers: int, hidden_size: int, layer: int | None = None, dim: int | None = None):
        super().__init__(num_layers, hidden_size)
        self.layer = layer or num_layers
        self.dim = dim or hidden_size
        if not (1 <= self.layer <= num_layers and 1 <= self.dim <= hidden_size):
            raise ValueError(f"separate: ({self.layer},{self.dim}) is outside the model's {num_layers} x {hidden_size}")

    @property
    def keep_layers(self) -> int:
        """How many layers the saved model keeps."""
        return self.layer

    def plan(self, rng) -> Plan:
        return Plan([View(self.layer, self.dim)])

    def config(self) -> dict:
        return {"method": self.name, "layer": self.layer, "dim": self.dim}
