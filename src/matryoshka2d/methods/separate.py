"""separate: the baseline of the Starbucks and ESE papers, one small model trained on its own.

The backbone is cut to its first n layers and trained at (n, d) alone; the saved model keeps only those n
layers. Because the trainer computes only the layers a view needs, training the (n, d) view of the full
backbone is exactly training the cut model: layers above n never run and never change.
"""

from __future__ import annotations

from matryoshka2d.methods.base import Method, Plan, View


class Separate(Method):
    name = "separate"
    summary = "cut the backbone to n layers and train (n, d) alone (the separately-trained baseline)"
    settings = "layer dim"

    def __init__(self, num_layers: int, hidden_size: int, layer: int | None = None, dim: int | None = None):
        super().__init__(num_layers, hidden_size)
        # None means the full size; 0 is a mistake, not "the default" (issue 22: it trained the full model).
        self.layer = num_layers if layer is None else layer
        self.dim = hidden_size if dim is None else dim
        if not (1 <= self.layer <= num_layers and 1 <= self.dim <= hidden_size):
            raise ValueError(
                f"separate: the cell ({self.layer},{self.dim}) is outside the model's {num_layers} layers x "
                f"{hidden_size} dims; --layer must be 1..{num_layers} and --dim 1..{hidden_size}"
            )

    @property
    def keep_layers(self) -> int:
        """How many layers the saved model keeps."""
        return self.layer

    def plan(self, rng) -> Plan:
        return Plan([View(self.layer, self.dim)])
