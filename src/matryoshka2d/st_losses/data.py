"""The rows `matryoshka2d train` trains on, as a `datasets.Dataset` for sentence-transformers' trainer.

`train --data FILE` reads a TSV with no quoting (csv.QUOTE_NONE: a `"` is part of the text) through
`training.data.read_training_data`, which also checks every row and names the file and line of a bad one.
`datasets.load_dataset("csv", delimiter="\\t")` reads the same file with pandas' default quoting, where a field that
starts with `"` runs to the next `"`: on the shared NLI triplets it reads 69 of 14,344 rows differently (row 1852
loses its quotes). So the Dataset here is built from our reader's own rows.
"""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset

from matryoshka2d.training.data import KINDS, read_training_data

# The label column of each kind, under the names sentence-transformers' trainer takes as labels ("label", "score").
LABEL_COLUMNS = {"nli": "label", "scored": "score"}
# Plain sentences train as two copies of each (SimCSE): train's two columns, as anchor and positive.
SENTENCE_COLUMNS = ("anchor", "positive")


def training_dataset(*sources: str | Path) -> Dataset:
    """The rows `matryoshka2d train --data SOURCE ...` trains on, in its order, as a Dataset.

    Args:
        *sources: training files (TSV, JSONL, a `.txt` of sentences) or Hugging Face datasets, of one kind, as
            `train --data` takes them.

    Returns:
        A Dataset whose columns are the kind's text columns (triplets: anchor, positive, negative; pairs: anchor,
        positive; NLI pairs: premise, hypothesis and an integer label, 0 entailment, 1 neutral, 2 contradiction;
        scored pairs: sentence1, sentence2 and a float score; sentences: anchor and positive, the sentence twice).

    Example:
        ```python
        from matryoshka2d.st_losses import training_dataset

        triplets = training_dataset("../shared/data/nli/train_triplets.tsv")
        ```
    """
    data = read_training_data([str(source) for source in sources])
    names = SENTENCE_COLUMNS if data.kind == "sentences" else KINDS[data.kind][0]
    columns = dict(zip(names, data.columns, strict=True))
    if data.labels is not None:
        columns[LABEL_COLUMNS[data.kind]] = data.labels.tolist()
    return Dataset.from_dict(columns)
