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
MODEL's card (`refresh_model_index`) and leaves the rest of the card as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from matryoshka2d.files import ConfinedFolder
from matryoshka2d.outputs import write_text
from matryoshka2d.result_files import read_result_record

CARD_RESULTS_DEPTH = 3  # how deep under the model folder to look for results.json files of `matryoshka2d eval`


def find_results(folder: Path) -> list[dict]:
    """results.json files of `eval` already inside the model folder, read by the one reader of result files
    (result_files.read_result_record); one it cannot read is left off the card with a line naming the file and field."""
    found = []
    for path in sorted(folder.rglob("results.json")):
        if len(path.relative_to(folder).parts) > CARD_RESULTS_DEPTH:
            continue
        try:
            found.append(read_result_record(path, kinds=("grid",))[2])
        except (OSError, ValueError) as exc:
            print(f"model card: {exc}; that result is left off the card", file=sys.stderr)
    return found


def model_index(model_name: str, results: list[dict]) -> list[dict]:
    """The Hub's model-index of every `eval mteb` result among `results` (records of find_results): one entry, the
    model, with a result per (task, split, subset, cell); [] when there are none. A task's type, dataset and main
    score come from the record's settings (evaluate.mteb_run.task_record)."""
    entries = []
    for result in results:
        if result.get("task") != "mteb":
            continue
        tasks = (result.get("settings") or {}).get("tasks") or {}
        for row in result.get("scores") or []:
            task = tasks.get(row.get("dataset"))
            value = row.get(result["metric"])
            if not isinstance(task, dict) or value is None:
                continue
            cell = f"matryoshka2d cell {row['layer']}x{row['dim']}"
            for split in task.get("splits") or ["test"]:
                for subset in task.get("subsets") or ["default"]:
                    entries.append(
                        {
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
                    )
    return [{"name": model_name, "results": entries}] if entries else []


def _front_matter(fields: dict, results: list[dict], model_name: str) -> list[str]:
    """The card's YAML front matter: `fields`, and the model-index of the mteb results among `results`."""
    index = model_index(model_name, results)
    data = {**fields, **({"model-index": index} if index else {})}
    return ["---", yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n"), "---"]


def refresh_model_index(folder: Path, model_name: str) -> Path | None:
    """Put the model-index of the mteb results in `folder` into the front matter of its card (README.md, read
    through the folder's confined reader), replacing an earlier model-index and keeping every other field and the
    body; None when the folder has no card."""
    confined = ConfinedFolder(folder, "model")
    path = confined.path("README.md")
    if not path.is_file():
        return None
    text = confined.read_text("README.md")
    fields, body = {}, text
    if text.startswith("---\n") and "\n---" in text[4:]:
        head, _, body = text[4:].partition("\n---")
        body = body[1:] if body.startswith("\n") else body
        loaded = yaml.safe_load(head)
        fields = loaded if isinstance(loaded, dict) else {}
    fields.pop("model-index", None)
    lines = _front_matter(fields, find_results(Path(folder)), model_name)
    write_text(path, "\n".join(lines) + "\n" + body)
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
    method = metadata.get("method")  # Method.config(): {"method": name, and its settings}
    method_name = method.get("method") if isinstance(method, dict) else method
    training = metadata.get("training") if isinstance(metadata.get("training"), dict) else {}
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
        "A sentence embedding model from [matryoshka2d](https://pypi.org/project/matryoshka2d/): elastic in depth "
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
    if metadata:
        lines += ["## Training", ""]
        if method_name:
            lines.append(
                f"- method: {method_name}" + (f" (`{json.dumps(method)}`)" if isinstance(method, dict) else "")
            )
        if metadata.get("loss"):
            lines.append(f"- loss: {metadata['loss']}")
        data = training.get("data") or training.get("train_file") or metadata.get("data")
        if data:
            lines.append(
                f"- data: {data}"
                + (
                    f" ({metadata['examples']} {metadata.get('data_kind', '')} examples)"
                    if metadata.get("examples")
                    else ""
                )
            )
        if training.get("model"):
            lines.append(f"- base model: {training['model']}")
        if metadata.get("steps"):
            lines.append(f"- steps: {metadata['steps']}")
        lines.append("- everything the run recorded: `matryoshka2d.json`")
        lines.append("")
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
    card = model_card(encoder, layers, dim, normalize, metadata, find_results(Path(results or folder)), widths)
    write_text(path, card)
    return path
