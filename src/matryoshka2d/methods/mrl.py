"""mrl: Matryoshka Representation Learning (Kusupati et al., 2022) at the last layer.

Views (N, d) for d in 8, 16, 32, ... up to D, all with weight 1 (the MRL paper's default, and the nested set
the 2DMSE paper uses, sec. 3.2: a geometric series with base 8 and ratio 2).
"""

from __future__ import annotations

from matryoshka2d.cells import nested_dims
from matryoshka2d.methods.base import Method, Plan, View


class MRL(Method):
    name = "mrl"
    summary = "nested widths 8, 16, 32, ... D at the last layer, every step"
    settings = "dims"

    def __init__(self, num_layers: int, hidden_size: int, dims: list[int] | None = None):
        super().__init__(num_layers, hidden_size)
        self.dims = sorted(dims or nested_dims(hidden_size))

    def plan(self, rng) -> Plan:
        return Plan([View(self.num_layers, d) for d in self.dims])
