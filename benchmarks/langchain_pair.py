"""Issue 42's LangChain line: an exported query/document pair searched by LangChain's `QdrantVectorStore` (documents
through the pair's document route, queries through its query route, `HuggingFaceEmbeddings` with no glue of ours)
returns the same top 10 as `matryoshka2d search --query-model STUDENT` on an index the teacher built, for >= 99%
of SciFact half B's queries.

    python benchmarks/scifact_halves.py --output HALVES
    matryoshka2d export --model minilm-l6 --query-model STUDENT --output PAIR
    python benchmarks/langchain_pair.py --model minilm-l6 --query-model STUDENT --pair PAIR \
        --dataset-dir HALVES [--split half_b] --output OUT

Ours: `index build --model MODEL --cells LAST:WIDTH` (flat faiss, exact) and `search --query-model STUDENT --top-k 10
--output` over the split's queries, both run through the CLI's own entry point here. LangChain's: the corpus's
texts (title and text, as `index build` reads them) into `QdrantVectorStore.from_texts` (qdrant-client's local
mode, exact, cosine), each query through `similarity_search(query, k=10)`. Prints the share of queries whose top 10
are the same set, the same list in order, and the mean overlap. The index build is skipped when OUT/index is there.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

from common import header
from matryoshka2d.beir import read_beir_file
from matryoshka2d.cli import main as cli


def split_queries(dataset: Path, split: str) -> list[tuple[str, str]]:
    """(id, text) of the queries that the split's qrels name, in queries.jsonl's order."""
    with (dataset / "qrels" / f"{split}.tsv").open(encoding="utf-8") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(rows)
        wanted = {r[0] for r in rows}
    return [(key, text) for _, key, text in read_beir_file(dataset / "queries.jsonl", titles=False) if key in wanted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6", help="the documents' model (the teacher)")
    parser.add_argument("--query-model", required=True, help="the student (`distill --mode query`)")
    parser.add_argument("--pair", required=True, help="`export --model MODEL --query-model STUDENT` of the two")
    parser.add_argument("--dataset-dir", type=Path, required=True, help="BEIR folder (benchmarks/scifact_halves.py)")
    parser.add_argument("--split", default="half_b")
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    print(header())
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_qdrant import QdrantVectorStore
    from qdrant_client.models import Distance

    from matryoshka2d.models.encoder import ElasticEncoder

    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    corpus = next(args.dataset_dir / n for n in ("corpus.jsonl.gz", "corpus.jsonl") if (args.dataset_dir / n).exists())
    queries = split_queries(args.dataset_dir, args.split)
    teacher = ElasticEncoder(args.model, device="cpu")
    cell = f"{teacher.num_layers}:{teacher.hidden_size}"
    del teacher
    started = time.perf_counter()
    if not (out / "index" / "manifest.json").is_file():
        build = ["index", "build", "--model", args.model, "--corpus", str(corpus), "--cells", cell]
        assert cli([*build, "--output", str(out / "index")]) == 0
    (out / "queries.txt").write_text("".join(text + "\n" for _, text in queries), encoding="utf-8")
    search = ["search", "--index", str(out / "index"), "--query-model", args.query_model, "--cell", cell]
    search += ["--queries", str(out / "queries.txt"), "--top-k", str(args.top_k), "--output", str(out / "ours.jsonl")]
    (out / "ours.jsonl").unlink(missing_ok=True)
    assert cli(search) == 0
    ours = [json.loads(line)["ids"] for line in (out / "ours.jsonl").read_text(encoding="utf-8").splitlines()]
    ours_seconds = time.perf_counter() - started

    started = time.perf_counter()
    documents = [(key, text) for _, key, text in read_beir_file(corpus, titles=True)]
    embeddings = HuggingFaceEmbeddings(
        model_name=args.pair, encode_kwargs={"task": "document"}, query_encode_kwargs={"task": "query"}
    )
    store = QdrantVectorStore.from_texts(
        [text for _, text in documents],
        embeddings,
        metadatas=[{"doc_id": key} for key, _ in documents],
        location=":memory:",
        collection_name="pair",
        distance=Distance.COSINE,
    )
    theirs = [[hit.metadata["doc_id"] for hit in store.similarity_search(text, k=args.top_k)] for _, text in queries]
    langchain_seconds = time.perf_counter() - started

    assert len(ours) == len(theirs) == len(queries), (len(ours), len(theirs), len(queries))
    same_set = sum(set(a) == set(b) for a, b in zip(ours, theirs, strict=True))
    same_list = sum(a == b for a, b in zip(ours, theirs, strict=True))
    overlap = sum(len(set(a) & set(b)) for a, b in zip(ours, theirs, strict=True)) / (args.top_k * len(queries))
    n = len(queries)
    lines = [
        f"{n} {args.split} queries, {len(documents)} documents; top {args.top_k}",
        f"ours: index build {cell} + search --query-model ({ours_seconds:.0f} s); LangChain: QdrantVectorStore "
        f"(local mode) over HuggingFaceEmbeddings of the pair ({langchain_seconds:.0f} s)",
        f"same top-{args.top_k} set: {same_set}/{n} = {100 * same_set / n:.1f}% (line: 99%)",
        f"same top-{args.top_k} list, in order: {same_list}/{n} = {100 * same_list / n:.1f}%",
        f"mean overlap of the top {args.top_k}: {100 * overlap:.2f}%",
    ]
    print("\n".join(lines))
    (out / "langchain_pair.md").write_text(header() + "\n" + "\n".join(lines) + "\n", encoding="utf-8")
    differing = [(key, a, b) for (key, _), a, b in zip(queries, ours, theirs, strict=True) if set(a) != set(b)]
    (out / "differing.json").write_text(json.dumps(differing, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
