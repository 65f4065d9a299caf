"""plain: the task loss at the full model and full width, (N, D). The baseline of every paper."""

from __future__ import annotations

from matryoshka2d.methods.base import Method, Plan, View


class Plain(Method):
    name = "plain"
    summary = "the task loss at the last layer and full width only (ordinary fine-tuning)"

    def plan(self, rng) -> Plan:
        return Plan([View(self.num_layers, self.hidden_size)])
