"""Exit heads (matryoshka2d.models.heads) in a model folder: written, and read back only after every check.

- `exit_heads.safetensors`: `layer{l}.linear.weight` (out x in), `layer{l}.linear.bias`, and for MLP heads
  `layer{l}.up.weight`, `layer{l}.up.bias`, `layer{l}.down.weight`;
- `matryoshka2d.json` key `exit_heads`: kind, layers, sizes, the file's sha256, the sha256 of the backbone the
  heads were fitted or trained on, and how they were made. A head file that does not match its record, or a
  record whose backbone checksum is not the folder's backbone, is refused when the folder is loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.files import file_sha256
from matryoshka2d.models.heads import HEADS_FILE, INPUTS, RECORD_KEY, ExitHeads, HeadsError
from matryoshka2d.models.identity import backbone_sha256, confined_folder, folder_record, short
from matryoshka2d.outputs import writing


def save_heads(heads: ExitHeads, folder: str | Path, backbone: str) -> dict:
    """Write the heads' weights into `folder`; returns the record that goes into matryoshka2d.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {
        f"layer{n}.{name}": tensor.detach().to(torch.float32).cpu().contiguous()
        for n in heads.layers
        for name, tensor in heads.heads[str(n)].state_dict().items()
    }
    with writing(folder / HEADS_FILE) as tmp:
        save_file(tensors, str(tmp))
    return {
        "file": HEADS_FILE,
        "sha256": file_sha256(folder / HEADS_FILE),
        "kind": heads.kind,
        "layers": heads.layers,
        "dim_in": heads.dim_in,
        "dim_out": heads.dim_out,
        "hidden": heads.hidden,
        "inputs": heads.inputs,
        "backbone_sha256": backbone,
        **({"made": heads.record} if heads.record else {}),
    }


def read_record(folder: str | Path | ConfinedFolder) -> dict | None:
    """The `exit_heads` record of a model folder's matryoshka2d.json, or None if the folder has no heads."""
    return folder_record(folder, RECORD_KEY, HeadsError)


def load_heads(folder: str | Path | ConfinedFolder, record: dict, encoder) -> ExitHeads:
    """The heads a folder's record describes, checked against the file and against `encoder`'s backbone. The file
    the record names is resolved inside the folder (confined.ConfinedFolder: its links checked first)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    confined = confined_folder(folder)
    folder = confined.folder
    where = f"{folder / 'matryoshka2d.json'} ({RECORD_KEY})"
    try:
        kind, layers = record["kind"], [int(n) for n in record["layers"]]
        dim_in, dim_out = int(record["dim_in"]), int(record["dim_out"])
        inputs = record.get("inputs", "exit")  # records written before stacked heads read the exit's layer
        name, expected_sha, backbone = record["file"], record["sha256"], record["backbone_sha256"]
    except (KeyError, TypeError, ValueError) as exc:
        raise HeadsError(f"{where}: the record is incomplete or malformed ({exc!r})") from None
    try:
        path = confined.path(name, folder / "matryoshka2d.json", f"{RECORD_KEY}.file")  # before it is opened or hashed
    except ValueError as exc:
        raise HeadsError(str(exc)) from None
    if not path.is_file():
        raise HeadsError(f"{where} names {path.name}, which is missing from {folder}")
    if file_sha256(path) != expected_sha:
        raise HeadsError(f"{path}: the file is damaged or was changed (its sha256 is not the one recorded in {where})")
    if dim_in != encoder.transformer_size or dim_out != encoder.hidden_size:
        raise HeadsError(
            f"{path}: heads map {dim_in} -> {dim_out} numbers, but {encoder.name} pools {encoder.transformer_size} "
            f"and outputs {encoder.hidden_size}: they were fitted on another backbone"
        )
    if bad := [n for n in layers if not 1 <= n < encoder.num_layers]:
        raise HeadsError(f"{path}: heads at layers {bad}; {encoder.name} has exits 1..{encoder.num_layers - 1}")
    actual = backbone_sha256(encoder)
    if actual != backbone:
        raise HeadsError(
            f"{path}: these heads were fitted on another backbone (backbone sha256 {short(backbone)}..., this "
            f"model's is {short(actual)}...); fit them again with `matryoshka2d heads fit`, or load with heads off "
            "(heads=False, --no-heads)"
        )
    if inputs not in INPUTS:
        raise HeadsError(f"{where}: heads with inputs '{inputs}' are not known; this version reads {', '.join(INPUTS)}")
    try:
        heads = ExitHeads(layers, dim_in, dim_out, kind, record.get("hidden"), inputs)
    except (TypeError, ValueError) as exc:  # a kind or hidden width of another kind: the record is named
        raise HeadsError(f"{where}: {exc}") from None
    try:
        tensors = load_file(str(path))
        for key, tensor in tensors.items():  # a cast would hide an integer file; NaN would reach every vector
            what = "not a float tensor" if not tensor.is_floating_point() else "NaN or inf"
            if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                raise HeadsError(f"{path}: {key} holds {what}; fit the heads again with `matryoshka2d heads fit`")
        state = {
            f"{n}.{name}": tensors.pop(f"layer{n}.{name}") for n in layers for name in heads.heads[str(n)].state_dict()
        }
        heads.heads.load_state_dict(state)
    except (SafetensorError, KeyError, RuntimeError, OSError) as exc:
        raise HeadsError(f"{path}: cannot read the heads ({str(exc).splitlines()[0]})") from None
    heads.record = dict(made) if isinstance(made := record.get("made"), dict) else {}  # what made them: told only
    return heads
