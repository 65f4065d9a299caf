"""The model card (README.md) of a saved folder: what the model is, how it was trained, its grid, how to pick a cell.

Everything on the card is read from what the run and the folder know: the trainer's metadata (what goes to
matryoshka2d.json: the method's settings, the loss, the data, and the run's last evaluation), and the
results.json files of `matryoshka2d eval` that are already in the folder when it is saved. The trainer saves
into a fresh folder, so a trained model's card shows that last evaluation; its grid comes from `matryoshka2d
eval` afterwards. A field nobody recorded is left out rather than guessed.

Results of `eval mteb` in the folder also go into the card's YAML front matter as a `model-index`, the Hub's format
for evaluation results (huggingface_hub.repocard_data: `model_index_to_eval_results` reads it): one result per
(task, cell), the cell named in the dataset's config ("default, matryoshka2d cell 6x384") because the Hub tells
results apart by task type, dataset type, config, split and revision (EvalResult.unique_identifier), and the value
the task's mteb main score x 100, as the Hub shows MTEB. `eval mteb --output MODEL/mteb` refreshes the model-index of
MODEL's card (`refresh_model_index`) and leaves the rest of the card as it is: its other fields, its body, and every
model-index result that is not one of ours (a result whose dataset config names no matryoshka2d cell). Where two
result files in the folder score the same task at the same cell, the newer file's score is the card's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.files import utf8_problem
from matryoshka2d.outputs import write_text
from matryoshka2d.result_files import read_result_record

CARD_RESULTS_DEPTH = 3  # how deep under the model folder to look for results.json files of `matryoshka2d eval`


def find_results(folder: Path, newest_last: bool = False) -> list[dict]:
    """results.json files of `eval` already inside the model folder, read by the one reader of result files
    (result_files.read_result_record), in path order, or oldest file first with `newest_last`; one it cannot read
    is left off the card with a line naming the file and field."""
    found = []
    paths = sorted(folder.rglob("results.json"))
    if newest_last:
        paths.sort(key=lambda path: path.stat().st_mtime_ns)
    for path in paths:
        if len(path.relative_to(folder).parts) > CARD_RESULTS_DEPTH:
            continue
        try:
            found.append(read_result_record(path, kinds=("grid",))[2])
        except (OSError, ValueError) as exc:
            print(f"model card: {exc}; that result is left off the card", file=sys.stderr)
    return found


OURS = "matryoshka2d cell "  # in the dataset config of every model-index result this module writes


def model_index(model_name: str, results: list[dict]) -> list[dict]:
    """The Hub's model-index of every `eval mteb` result among `results` (records of find_results, oldest first):
    one entry, the model, with a result per (task, split, subset, cell), a later record's replacing an earlier one's;
    [] when there are none. A task's type, dataset and main score come from the record's settings
    (evaluate.mteb_run.task_record); its value is the row's score under the task's main score (under the record's
    metric in a record of one metric for every task)."""
    entries: dict[tuple, dict] = {}
    for result in results:
        if result.get("task") != "mteb":
            continue
        tasks = (result.get("settings") or {}).get("tasks") or {}
        for row in result.get("scores") or []:
            task = tasks.get(row.get("dataset"))
            if not isinstance(task, dict):
                continue
            value = row.get(task.get("main_score"), row.get(result["metric"]))
            if value is None:
                continue
            cell = f"{OURS}{row['layer']}x{row['dim']}"
            for split in task.get("splits") or ["test"]:
                for subset in task.get("subsets") or ["default"]:
                    entries[(row["dataset"], cell, split, subset)] = {
                        "task": {"type": task.get("type"), "name": f"{row['dataset']} ({cell})"},
                        "dataset": {
                            "type": task.get("dataset"),
                            "name": f"MTEB {row['dataset']} ({cell})",
                            "config": f"{subset}, {cell}",
                            "split": split,
                            "revision": task.get("revision"),
                        },
                        "metrics": [{"type": task.get("main_score"), "value": round(float(value), 4)}],
                    }
    return [{"name": model_name, "results": list(entries.values())}] if entries else []


def _front_matter(fields: dict, results: list[dict], model_name: str) -> list[str]:
    """The card's YAML front matter: `fields`, and the model-index of the mteb results among `results`."""
    index = model_index(model_name, results)
    data = {**fields, **({"model-index": index} if index else {})}
    return ["---", yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n"), "---"]


class CardError(ValueError):
    """A model card whose front matter cannot be read or kept; the message names the file."""


def _split_card(path: Path, text: str) -> tuple[dict, str]:
    """(front matter fields, body) of a card's text; a front matter that is not a YAML mapping, or a model-index that
    is not a list of entries, is refused naming the file: rewriting it would drop what the user wrote."""
    if not (text.startswith("---\n") and "\n---" in text[4:]):
        return {}, text
    head, _, body = text[4:].partition("\n---")
    body = body[1:] if body.startswith("\n") else body
    try:
        fields = yaml.safe_load(head)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 2})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise CardError(f"{path}{where}: the card's front matter is not valid YAML: {problem}") from None
    fields = {} if fields is None else fields
    if not isinstance(fields, dict):
        raise CardError(f"{path}: the card's front matter is a YAML {type(fields).__name__}, not a mapping of fields")
    index = fields.get("model-index", [])
    if not isinstance(index, list) or not all(isinstance(entry, dict) for entry in index):
        raise CardError(f"{path}: the card's model-index is not a list of entries (name, results), as the Hub reads it")
    return fields, body


def read_card(folder: Path) -> tuple[Path, dict, str] | None:
    """(path, front matter fields, body) of the card (README.md) of `folder`, read through the folder's confined
    reader; None when the folder has no card. A card that is not UTF-8 text or whose front matter cannot be kept is
    refused (CardError) naming the file."""
    confined = ConfinedFolder(folder, "model")
    path = confined.path("README.md")
    if not path.is_file():
        return None
    try:
        text = confined.read_text("README.md")
    except UnicodeDecodeError:
        with path.open("rb") as lines:
            raise CardError(utf8_problem(lines, path, what="model card")) from None
    return (path, *_split_card(path, text))


def check_card(folder: Path) -> None:
    """Refuse, before any work, a card of `folder` that `refresh_model_index` could not rewrite."""
    read_card(folder)


def _kept_entries(index: list[dict], model_name: str) -> tuple[list[dict], list[dict]]:
    """An existing model-index without our results: (this model's other results, the entries of other models)."""
    own, others = [], []
    for entry in index:
        results = [r for r in entry.get("results") or [] if OURS not in str((r.get("dataset") or {}).get("config"))]
        if entry.get("name") == model_name:
            own += results
        elif results:
            others.append({**entry, "results": results})
    return own, others


def refresh_model_index(folder: Path, model_name: str) -> Path | None:
    """Put the model-index of the mteb results in `folder` into the front matter of its card, replacing the results
    an earlier refresh wrote and keeping every other field, every result of the user's and the body; None when the
    folder has no card."""
    card = read_card(Path(folder))
    if card is None:
        return None
    path, fields, body = card
    own, others = _kept_entries(fields.pop("model-index", []), model_name)
    ours = model_index(model_name, find_results(Path(folder), newest_last=True))
    results = own + (ours[0]["results"] if ours else [])
    index = ([{"name": model_name, "results": results}] if results else []) + others
    data = {**fields, **({"model-index": index} if index else {})}
    front = yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n")
    write_text(path, "\n".join(["---", front, "---"]) + "\n" + body)
    return path


def _grid_table(result: dict) -> list[str]:
    metric = result["metric"]
    values = {(r["layer"], r["dim"]): r[metric] for r in result["average"] if metric in r}
    if not values:
        return []
    layers = sorted({cell[0] for cell in values})
    dims = sorted({cell[1] for cell in values})
    lines = [f"| layer \\ dim | {' | '.join(str(d) for d in dims)} |", "|---" * (len(dims) + 1) + "|"]
    for layer in layers:
        row = [f"{values[(layer, d)]:.2f}" if (layer, d) in values else "" for d in dims]
        lines.append(f"| {layer} | {' | '.join(row)} |")
    title = result.get("task", result.get("kind", "evaluation"))
    return [f"### {title}: {metric} (average over datasets)", "", *lines, ""]


def _last_evaluation(final: dict) -> str:
    """The trainer's evaluation at the end of the run (Trainer.evaluate: file@(layer,dim) and Spearman x 100)."""
    if final.get("spearman") is None:
        return f"- not evaluated at the end of training ({final.get('note', 'no evaluation file')})"
    return (
        f"- at the end of training (step {final.get('step')}): Spearman x 100 of cosine vs gold "
        f"{final['spearman']:.2f} on {final.get('eval')} (file@(layer,dim)); every cell: `matryoshka2d eval sts "
        "--model THIS_FOLDER`"
    )


def _training_lines(metadata: dict) -> list[str]:
    """The card's Training section, from what the run recorded (none for a model no run of ours trained)."""
    if not metadata:
        return []
    method = metadata.get("method")  # Method.config(): {"method": name, and its settings}
    method_name = method.get("method") if isinstance(method, dict) else method
    training = metadata.get("training") if isinstance(metadata.get("training"), dict) else {}
    lines = ["## Training", ""]
    if method_name:
        lines.append(f"- method: {method_name}" + (f" (`{json.dumps(method)}`)" if isinstance(method, dict) else ""))
    if metadata.get("loss"):
        lines.append(f"- loss: {metadata['loss']}")
    data = training.get("data") or training.get("train_file") or metadata.get("data")
    if data:
        examples, kind = metadata.get("examples"), metadata.get("data_kind", "")
        lines.append(f"- data: {data}" + (f" ({examples} {kind} examples)" if examples else ""))
    if training.get("model"):
        lines.append(f"- base model: {training['model']}")
    if metadata.get("steps"):
        lines.append(f"- steps: {metadata['steps']}")
    return [*lines, "- everything the run recorded: `matryoshka2d.json`", ""]


def model_card(
    encoder,
    layers: int,
    dim: int | None,
    normalize: bool,
    metadata: dict | None,
    results: list[dict],
    widths: list[int] | None = None,
) -> str:
    metadata = metadata or {}
    width = dim or encoder.hidden_size
    fields = {
        "library_name": "sentence-transformers",
        "pipeline_tag": "sentence-similarity",
        "tags": ["sentence-transformers", "sentence-similarity", "matryoshka2d", "2d-matryoshka"],
    }
    lines = [
        *_front_matter(fields, results, Path(str(encoder.name)).name),
        "",
        f"# {Path(str(encoder.name)).name} ({layers} layers, {width} dims)",
        "",
        "A sentence embedding model made with matryoshka2d: elastic in depth "
        "and width, so the first n layers and the first k numbers of its embeddings (a (layer, dim) cell) make a "
        "smaller, faster model of their own.",
        "",
        "## This folder",
        "",
        f"- architecture: {encoder.model.config.model_type}, {layers} transformer layers kept "
        f"(of {encoder.num_layers}), width {encoder.transformer_size}",
        f"- pooling: {encoder.pooling}"
        + (f"; pooler head {encoder.head.describe()}" if encoder.head is not None else ""),
        f"- embedding size: {width}" + (f" (first {width} of {encoder.hidden_size})" if dim else ""),
        f"- normalized: {'yes, after slicing (unit length)' if normalize else 'no'}",
        f"- maximum sequence length: {encoder.max_length} tokens (longer texts are truncated)",
        "",
        "## Cells",
        "",
        f"- layers: {', '.join(str(n) for n in range(1, layers + 1))} (exit after any of them: the first n "
        "layers make a model of their own)",
        f"- widths trained: {', '.join(str(w) for w in widths or [width])} (`matryoshka_dimensions` in "
        "config.json, which vLLM and SGLang read before they accept a `dimensions` request; any width up to "
        f"{width} works with matryoshka2d)",
        "",
    ]
    lines += _training_lines(metadata)
    if isinstance(metadata.get("final_eval"), dict):
        lines += ["## Evaluation", "", _last_evaluation(metadata["final_eval"]), ""]
    tables = [line for result in results for line in _grid_table(result)]
    if tables:
        lines += ["## Grid", "", *tables]
    lines += [
        "## Use",
        "",
        "```python",
        "from sentence_transformers import SentenceTransformer",
        "",
        'model = SentenceTransformer("path/to/this/folder")',
        'vectors = model.encode(["A man is playing a guitar.", "Someone plays music."])',
        "```",
        "",
        "## Picking a cell",
        "",
        "Fewer layers run faster (about n/N of the full model's time at layer n) and fewer dims make smaller "
        "indexes; quality falls off gently along both axes. Read the grid above (or run `matryoshka2d eval sts "
        "--model THIS_FOLDER`), take the cheapest cell within your quality budget, then check it:",
        "",
        "```python",
        "from matryoshka2d import ElasticEncoder",
        "",
        'enc = ElasticEncoder("path/to/this/folder")',
        "vectors = enc.encode(texts, layer=3, dim=128, normalize=True)",
        "```",
        "",
        "and ship it on its own: `matryoshka2d export --model THIS_FOLDER --layer 3 --dim 128 --output cell/` "
        "(add `--format onnx --quantize int8` for onnxruntime), or serve every cell at once with "
        "`matryoshka2d serve --model THIS_FOLDER`.",
        "",
    ]
    return "\n".join(lines)


def write_model_card(
    folder: Path,
    encoder,
    layers: int,
    dim: int | None,
    normalize: bool,
    metadata: dict | None,
    widths: list[int] | None = None,
    results: Path | None = None,
) -> Path:
    """README.md in `folder`, through the one writer; `results`: the folder whose eval results the card lists (the
    model's own folder, when the card is written into a temporary folder that is moved there)."""
    path = Path(folder) / "README.md"
    found = find_results(Path(results or folder), newest_last=True)  # the newer of two scores of a cell is the card's
    card = model_card(encoder, layers, dim, normalize, metadata, found, widths)
    write_text(path, card)
    return path
