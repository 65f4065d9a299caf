"""Our training methods as sentence-transformers losses, for `SentenceTransformerTrainer`.

    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from matryoshka2d.st_losses import ESELoss, TaskLoss, training_dataset

    model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
    triplets = training_dataset("../shared/data/nli/train_triplets.tsv")  # the rows `train --data` reads
    loss = ESELoss(model, TaskLoss(model, "angle"))      # or ESELoss(model, MultipleNegativesRankingLoss(model))
    SentenceTransformerTrainer(model=model, train_dataset=triplets, loss=loss).train()

Each wraps a base loss as sentence-transformers' MatryoshkaLoss does and computes what `matryoshka2d train
--method ...` computes (the same `matryoshka2d.methods` objects, the same defaults, our presets by name). The
trained model is a plain sentence-transformers folder. Guide: docs/guide/train-with-sentence-transformers.md.
"""

from matryoshka2d.st_losses.data import training_dataset
from matryoshka2d.st_losses.ese import ESELoss
from matryoshka2d.st_losses.exit_heads import exit_heads_for, save_with_exit_heads
from matryoshka2d.st_losses.method_loss import MethodLoss
from matryoshka2d.st_losses.starbucks import StarbucksLoss
from matryoshka2d.st_losses.task_loss import TaskLoss
from matryoshka2d.st_losses.twodmse import TwoDMSELoss

__all__ = [
    "ESELoss",
    "MethodLoss",
    "StarbucksLoss",
    "TaskLoss",
    "TwoDMSELoss",
    "exit_heads_for",
    "save_with_exit_heads",
    "training_dataset",
]
