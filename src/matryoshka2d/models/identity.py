"""What identifies a model's weights: one checksum, computed the same way wherever two artefacts meet (an index
and the model its queries are encoded with, result files and the model `pick` times).

The checksum covers every tensor of the module's state_dict (names and values, as float32 on the CPU, in name
order), so it does not depend on the device or on the dtype the weights were loaded in, and it changes with any
weight, the pooler head included. Index manifests have recorded it as `weights_sha256` since the first index
format; this is the same computation, moved here so that every caller agrees.
"""

from __future__ import annotations

import hashlib

import torch


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 of the module's named tensors (float32 bytes, sorted by name)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def short(checksum: str | None) -> str:
    """The first 12 hex digits, enough to tell two models apart in a message."""
    return checksum[:12] if checksum else "not recorded"
