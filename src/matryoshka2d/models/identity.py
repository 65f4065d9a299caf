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


# ---- query encoders distilled for a teacher's index (matryoshka2d.training.distill, --mode query) -------------

DISTILL_KEY = "distill"  # the record `matryoshka2d distill` writes into the student's matryoshka2d.json


class IdentityError(ValueError):
    """A model and the vectors it is asked to meet were made by different models; the message says what differs."""


def query_encoder_record(encoder) -> dict | None:
    """The `distill` record of a query encoder's folder (a student trained with --mode query to land on its
    teacher's vectors), or None for any other model."""
    location = getattr(encoder, "location", None)
    return query_encoder_record_at(location) if location else None


def query_encoder_record_at(folder) -> dict | None:
    """query_encoder_record of a model folder, read before the model is loaded."""
    import json
    from pathlib import Path

    path = Path(folder) / "matryoshka2d.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return None
    record = meta.get(DISTILL_KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, dict) and record.get("mode") == "query" else None


def check_query_encoder(record: dict, student: str, documents: dict, where: str) -> None:
    """A query encoder may search documents of its teacher only: `documents` describes the model that encoded them
    (weights_sha256, pooling, layers, hidden_size, model), as an index manifest records it."""
    teacher = record.get("teacher_weights_sha256")
    built = documents.get("model") or "another model"
    if not teacher or teacher != documents.get("weights_sha256"):
        raise IdentityError(
            f"{where}: the documents were encoded by {built} (weights sha256 "
            f"{short(documents.get('weights_sha256'))}), "
            f"but the query encoder {student} was distilled from {record.get('teacher')} (weights sha256 "
            f"{short(teacher)}): its vectors live in its teacher's space only. Use a query encoder distilled from "
            f"{built} (`matryoshka2d distill --mode query --teacher ...`), or search with {built} itself"
        )
    if documents.get("pooling") and record.get("teacher_pooling") not in (None, documents["pooling"]):
        raise IdentityError(
            f"{where}: the documents were pooled with {documents['pooling']}, the query encoder {student}'s teacher "
            f"with {record.get('teacher_pooling')}"
        )


def check_query_cells(record: dict, student: str, cells, where: str) -> None:
    """A query encoder lands on its teacher's last-layer vectors: it can search cells at that layer only."""
    top = record.get("teacher_layers")
    if bad := [c for c in cells if top is not None and c[0] != top]:
        raise IdentityError(
            f"{where}: cells {', '.join(f'{n}:{d}' for n, d in bad)} hold documents at a shallow layer, but the query "
            f"encoder {student} was trained towards its teacher's layer {top}: search cells at layer {top}"
        )
