"""mteb tasks read from local files, and the one place a task name given to `eval mteb --tasks` is resolved.

mteb 2.x defines a task as a subclass of an `AbsTask*` with a `TaskMetadata` (mteb/abstasks/task_metadata.py) and a
`load_data` that fills `self.dataset` (mteb/abstasks/abstask.py: the base loads it from the Hugging Face hub with
`datasets.load_dataset(**metadata.dataset)`). The tasks here are the same subclasses whose `load_data` reads our
files through the readers `eval sts|retrieval|classification` use, so both see the same rows:

- `LocalSTS` (AbsTaskSTS): a `sentence1, sentence2, score` TSV (evaluate.sts.load_pairs), the dataset
  `{"test": Dataset(sentence1, sentence2, score)}` as mteb's STS tasks hold it (mteb/mocks/mock_tasks/sts.py).
- `LocalRetrieval` (AbsTaskRetrieval): a BEIR folder (beir.load_beir: `title + " " + text`, judged
  queries only, relevance > 0), as `RetrievalSplitData` under subset "default" (mteb/abstasks/retrieval.py). The
  text already joins the title, so the title given to mteb is empty and mteb's own join (`_corpus_to_dict` in
  mteb/_create_dataloaders.py: `(title + " " + text).strip()`) leaves it as it is. `ignore_identical_ids` is on, as
  BEIR and `eval retrieval` exclude a document whose id is the query's.
- `LocalClassification` (AbsTaskClassification): `<name>_train.tsv` and `<name>_test.tsv` with `sentence, label`
  (evaluate.classification.load_split), scored as mteb scores classification: logistic regression on
  `samples_per_label` examples per label drawn from train, n_experiments times (mteb/abstasks/classification.py).

A local task named like one of mteb's (STSBenchmark, STS12-16, SICK-R, SciFact) takes that task's metadata (type,
main score, description, citation), with its dataset replaced by the local file and its sha256 as the revision: the
scores are mteb's own metric on our copy of the data, and the result files say which copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict
from mteb.abstasks.classification import AbsTaskClassification
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.sts import AbsTaskSTS
from mteb.abstasks.task_metadata import TaskMetadata

from matryoshka2d.beir import corpus_file, load_beir, qrels_split
from matryoshka2d.evaluate.classification import discover, load_split
from matryoshka2d.evaluate.sts import STS_SETS, load_pairs
from matryoshka2d.files import DataFormatError, file_sha256

# mteb's name of each STS set of the shared data (DATA/sts/raw/<file>_test.tsv): the same test sets
STS_NAMES = dict(zip(("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICK-R"), STS_SETS, strict=True))
RETRIEVAL_NAMES = {"SciFact": "scifact"}  # mteb's name of each BEIR folder of DATA/retrieval
# mteb's English classification tasks draw 8 to 128 training examples per label (mteb/abstasks/classification.py
# default 8; tasks/classification/eng/*: 16 for toxic conversations, 32 for tweet sentiment and Yahoo answers)
SAMPLES_PER_LABEL = 32
LANGUAGE = "eng-Latn"  # mteb needs the language of a task it did not define: the shared data is English


class TaskNotFoundError(ValueError):
    """A task name no local data and no mteb task answers to, or local files that are not a task."""


def _revision(paths: Sequence[Path]) -> str:
    """The local data's version: sha256 over its files' sha256, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()


def _metadata(name: str, kind: str, main_score: str, paths: Sequence[Path], split: str, source: Path) -> TaskMetadata:
    """mteb's metadata of the task of that name when there is one (mteb.get_task), else a task's own; the dataset
    is the local data (`path` names it, `revision` is its sha256)."""
    import mteb

    dataset = {"path": f"local/{source.name}", "revision": _revision(paths)}
    note = f" Read from the local files at {source} (matryoshka2d eval mteb)."
    try:
        known = mteb.get_task(name).metadata
    except KeyError:
        known = None
    if known is not None and known.type == kind:
        # superseded_by: mteb's advice to use a newer copy of its hub dataset, which is not the data read here
        update = {"dataset": dataset, "eval_splits": [split], "description": known.description + note}
        return known.model_copy(update={**update, "superseded_by": None})
    return TaskMetadata(
        name=name,
        description=f"A local {kind} task." + note,
        type=kind,
        category="t2t",
        modalities=["text"],
        eval_splits=[split],
        eval_langs=[LANGUAGE],
        main_score=main_score,
        dataset=dataset,
    )


class _LocalData:
    """A task whose metadata is its instance's own (it names the local files), kept when its data is unloaded: mteb's
    `unload_data` also drops an instance's metadata to go back to the class's published one (mteb/abstasks/
    abstask.py, AbsTask.unload_data), which a local task does not have."""

    def unload_data(self) -> None:
        self.dataset = None
        self.data_loaded = False


class LocalSTS(_LocalData, AbsTaskSTS):
    """An STS file (sentence1, sentence2, score) as an mteb STS task, its test split the whole file."""

    def __init__(self, path: str | Path, name: str | None = None, **kwargs: Any):
        self.path = Path(path)
        if not self.path.is_file():
            raise TaskNotFoundError(f"{self.path}: no such STS file (sentence1, sentence2, score)")
        self.metadata = _metadata(name or self.path.stem, "STS", "cosine_spearman", [self.path], "test", self.path)
        super().__init__(**kwargs)

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        if self.data_loaded:
            return
        pairs = load_pairs(self.path, self.metadata.name)
        # mteb normalises the gold scores to 0..1 with these bounds (AbsTaskSTS._normalize); a correlation does not
        # change under it, and the file's own range fits any scale (SICK-R 1-5, STS 0-5)
        self.min_score, self.max_score = float(pairs.gold.min()), float(pairs.gold.max())
        rows = {"sentence1": pairs.sentences1, "sentence2": pairs.sentences2, "score": pairs.gold.tolist()}
        self.dataset = DatasetDict({"test": Dataset.from_dict(rows)})
        self.data_loaded = True


def beir_split(directory: Path, split: str | None = None) -> str:
    """`split`, else 'test' when the folder has qrels/test.tsv, else its only qrels file (as `eval retrieval`)."""
    try:
        return qrels_split(directory, split)
    except ValueError as exc:
        raise TaskNotFoundError(str(exc)) from None


class LocalRetrieval(_LocalData, AbsTaskRetrieval):
    """A BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/<split>.tsv) as an mteb retrieval task."""

    ignore_identical_ids = True  # BEIR's and evaluate.retrieval's: a query never retrieves a document of its own id

    def __init__(self, directory: str | Path, name: str | None = None, split: str | None = None, **kwargs: Any):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise TaskNotFoundError(f"{self.directory}: no such BEIR folder (corpus.jsonl, queries.jsonl, qrels/)")
        self.split = beir_split(self.directory, split)
        try:
            files = [corpus_file(self.directory), self.directory / "queries.jsonl"]
        except DataFormatError as exc:
            raise TaskNotFoundError(str(exc)) from None
        files.append(self.directory / "qrels" / f"{self.split}.tsv")
        if missing := [str(f) for f in files if not f.is_file()]:
            raise TaskNotFoundError(f"{self.directory}: not a BEIR folder ({', '.join(missing)} missing)")
        title = name or self.directory.name
        self.metadata = _metadata(title, "Retrieval", "ndcg_at_10", files, self.split, self.directory)
        super().__init__(**kwargs)

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        if self.data_loaded:
            return
        beir = load_beir(self.directory, self.split)
        corpus = Dataset.from_dict({"id": beir.doc_ids, "title": [""] * len(beir.doc_ids), "text": beir.doc_texts})
        queries = Dataset.from_dict({"id": beir.query_ids, "text": beir.query_texts})
        relevant = {
            qid: {beir.doc_ids[doc]: score for doc, score in judged.items()}
            for qid, judged in zip(beir.query_ids, beir.qrels, strict=True)
        }
        split = {"corpus": corpus, "queries": queries, "relevant_docs": relevant, "top_ranked": None}
        self.dataset = {"default": {self.split: split}}
        self.data_loaded = True


class LocalClassification(_LocalData, AbsTaskClassification):
    """`<name>_train.tsv` and `<name>_test.tsv` (sentence, label) as an mteb classification task."""

    samples_per_label = SAMPLES_PER_LABEL

    def __init__(self, files: dict[str, Path], name: str, **kwargs: Any):
        if not {"train", "test"} <= set(files):
            have = ", ".join(p.name for p in files.values())
            raise TaskNotFoundError(f"classification set {name}: needs <name>_train.tsv and <name>_test.tsv ({have})")
        self.files = files
        source = files["test"].parent / f"{name}_{{train,test}}.tsv"
        paths = [files["train"], files["test"]]
        self.metadata = _metadata(name, "Classification", "accuracy", paths, "test", source)
        super().__init__(**kwargs)

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        if self.data_loaded:
            return
        rows = {split: load_split(self.files[split]) for split in ("train", "test")}
        for split in rows.values():
            if split.texts2 is not None:
                raise TaskNotFoundError(
                    f"{split.path}: sentence pairs (sentence1, sentence2); a classification task here reads one "
                    "'sentence' column (`eval classification` scores pair sets)"
                )
        if len(set(rows["train"].labels)) < 2:  # scikit-learn's classifier would refuse it in its own words
            raise TaskNotFoundError(
                f"task {self.metadata.name}: {rows['train'].path} has one label ({rows['train'].labels[0]!r}); a "
                "classification task needs two or more among its training rows"
            )
        # mteb's labels are whole numbers (AbsTaskClassification: "label: int"): each label's place among them all
        self.label_names = sorted({label for split in rows.values() for label in split.labels})
        number = {label: i for i, label in enumerate(self.label_names)}
        self.dataset = DatasetDict(
            {
                name: Dataset.from_dict({"text": split.texts, "label": [number[label] for label in split.labels]})
                for name, split in rows.items()
            }
        )
        self.data_loaded = True


# ---- names to tasks ---------------------------------------------------------------------------------------------


@dataclass
class LocalCatalogue:
    """The local tasks a run can name, each a maker of the task: the user's (--task-dir) and the shared data's (by
    mteb's names where the data is one of mteb's sets). A user's task answers to its own name before any shared
    task or alias does: a --task-dir file named like a shared set is the task run under that name."""

    own: dict[str, Any]
    shared: dict[str, Any]
    aliases: dict[str, str]  # `eval sts --datasets` names of the shared data's sets (stsb, sickr) -> mteb's names

    def find(self, name: str):
        """The maker of the task of that name, any case: the user's first, then the shared data's, then the shared
        task an alias names; None when there is none."""
        for tasks in (self.own, self.shared):
            folded = {key.lower(): key for key in tasks}
            if name.lower() in folded:
                return tasks[folded[name.lower()]]
        aliases = {alias.lower(): key for alias, key in self.aliases.items() if key in self.shared}
        key = aliases.get(name.lower())
        return None if key is None else self.shared[key]

    def names(self) -> list[str]:
        return [*self.own, *(name for name in self.shared if self.find(name) is self.shared[name])]


def _task_dir_makers(task_dirs: Sequence[str | Path]) -> dict[str, Any]:
    """Each --task-dir item's tasks under its folder's or file's name; two items of one name (any case) are
    refused, naming both."""
    makers: dict[str, Any] = {}
    sources: dict[str, Path] = {}

    def add(name: str, item: Path, make) -> None:
        if (earlier := sources.get(name.lower())) is not None:
            raise TaskNotFoundError(
                f"--task-dir {earlier} and {item} are both task '{name}': a task is named after its file or folder, "
                "so rename one of them"
            )
        sources[name.lower()], makers[name] = item, make

    for item in map(Path, task_dirs):
        if item.is_file():
            add(item.stem, item, lambda item=item: LocalSTS(item))
        elif item.is_dir() and (item / "queries.jsonl").is_file():
            name = next((k for k, v in RETRIEVAL_NAMES.items() if v == item.name.lower()), item.name)
            add(name, item, lambda item=item, name=name: LocalRetrieval(item, name))
        elif item.is_dir():
            try:
                sets = discover(item)
            except DataFormatError as exc:
                raise TaskNotFoundError(
                    f"--task-dir {item}: not a BEIR folder (no queries.jsonl) and no classification files ({exc})"
                ) from None
            for name, files in sets.items():
                add(name, item, lambda files=files, name=name: LocalClassification(files, name))
        else:
            raise TaskNotFoundError(f"--task-dir {item}: no such file or folder")
    return makers


def local_catalogue(data_dir: Path | None, task_dirs: Sequence[str | Path] = ()) -> LocalCatalogue:
    """Every local task: each --task-dir item (a BEIR folder, an STS .tsv file, or a folder of <name>_train/_test.tsv
    classification files) under its folder's or file's name, and what the shared data folder holds."""
    shared: dict[str, Any] = {}
    if data_dir is not None:
        for name, stem in STS_NAMES.items():
            path = data_dir / "sts" / "raw" / f"{stem}_test.tsv"
            if path.is_file():
                shared[name] = lambda path=path, name=name: LocalSTS(path, name)
        for name, folder in RETRIEVAL_NAMES.items():
            if (data_dir / "retrieval" / folder).is_dir():
                shared[name] = lambda d=data_dir / "retrieval" / folder, name=name: LocalRetrieval(d, name)
        if (data_dir / "classification").is_dir():
            for name, files in discover(data_dir / "classification").items():
                if {"train", "test"} <= set(files) and _single_sentences(files["train"]):
                    shared[name] = lambda files=files, name=name: LocalClassification(files, name)
    aliases = {**{stem: name for name, stem in STS_NAMES.items()}, **{v: k for k, v in RETRIEVAL_NAMES.items()}}
    return LocalCatalogue(_task_dir_makers(task_dirs), shared, aliases)


def _single_sentences(path: Path) -> bool:
    """Whether a classification file holds one sentence per row (a 'sentence' column), read from its header."""
    with path.open(encoding="utf-8") as f:
        return "sentence" in f.readline().rstrip("\n").split("\t")


def resolve_tasks(names: Sequence[str], catalogue: LocalCatalogue) -> list:
    """Each name as a local task when the catalogue has it, else mteb's task of that name (mteb.get_tasks, which
    loads its data from the Hugging Face hub when it runs). A name neither knows is an error listing both."""
    import mteb

    tasks = []
    for name in names:
        make = catalogue.find(name)
        if make is not None:
            tasks.append(make())
            continue
        try:
            tasks.extend(mteb.get_tasks(tasks=[name]))
        except KeyError:
            local = ", ".join(catalogue.names()) or "none (give --task-dir or --data-dir)"
            raise TaskNotFoundError(
                f"--tasks {name}: no local task of that name (local tasks: {local}) and no mteb task of that name "
                '(`python -c "import mteb; print([t.metadata.name for t in mteb.get_tasks()])"` lists them)'
            ) from None
    return tasks
