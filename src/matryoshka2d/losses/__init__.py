"""Task losses on a batch of embeddings, and the alignment terms the methods add."""

from matryoshka2d.losses.angle import AnglELoss
from matryoshka2d.losses.batch import EmbeddedBatch
from matryoshka2d.losses.cosent import CoSENTLoss
from matryoshka2d.losses.infonce import InfoNCELoss
from matryoshka2d.losses.simcse import SimCSELoss
from matryoshka2d.losses.softmax import SoftmaxLoss

TASK_LOSSES = {
    "angle": AnglELoss,
    "cosent": CoSENTLoss,
    "infonce": InfoNCELoss,
    "softmax": SoftmaxLoss,
    "simcse": SimCSELoss,
}


def make_task_loss(name: str, **kwargs):
    if name not in TASK_LOSSES:
        raise ValueError(f"Unknown loss '{name}'; choose one of {', '.join(TASK_LOSSES)}")
    return TASK_LOSSES[name](**kwargs)


__all__ = [
    "TASK_LOSSES",
    "AnglELoss",
    "CoSENTLoss",
    "EmbeddedBatch",
    "InfoNCELoss",
    "SimCSELoss",
    "SoftmaxLoss",
    "make_task_loss",
]
