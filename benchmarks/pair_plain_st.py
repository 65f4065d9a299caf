"""Issue 42's acceptance line for an exported query/document pair, in a virtualenv WITHOUT matryoshka2d.

    # 1. here (matryoshka2d installed): the reference vectors of 100 SciFact texts (50 claims, 50 documents)
    python benchmarks/pair_plain_st.py reference --model minilm-l6 --query-model STUDENT --output ref.npz
    python benchmarks/pair_plain_st.py reference --model minilm-l6 --query-cell 3x384 --output ref.npz
    # 2. in a clean virtualenv (python3.11 -m venv V && V/bin/pip install torch==2.13.0 sentence-transformers):
    V/bin/python benchmarks/pair_plain_st.py check --pair PAIR --reference ref.npz

`reference` computes, with matryoshka2d's ElasticEncoder, the query side's vectors (the student's, or the model's at
the query cell) and the model's (documents) of the same texts. `check` loads the pair with plain
`SentenceTransformer(PAIR)` (refusing to run where matryoshka2d can be imported) and prints the largest difference of
`encode_query` and `encode_document` (and plain `encode`) from them; the line is 1e-5.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

ATOL = 1e-5


def scifact_texts(data: Path, n: int) -> list[str]:
    """The first n/2 SciFact claims (queries.jsonl) and the first n/2 documents (title and text)."""
    folder = data / "retrieval" / "scifact"
    with open(folder / "queries.jsonl", encoding="utf-8") as f:
        claims = [json.loads(line)["text"] for _, line in zip(range(n // 2), f, strict=False)]
    with gzip.open(folder / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        docs = []
        for _, line in zip(range(n - len(claims)), f, strict=False):
            row = json.loads(line)
            docs.append(f"{row.get('title', '')} {row['text']}".strip())
    return claims + docs


def reference(args) -> None:
    from matryoshka2d.models.encoder import ElasticEncoder

    texts = scifact_texts(Path(args.data), args.texts)
    model = ElasticEncoder(args.model, device="cpu")
    norm = model.normalize_output
    if args.query_model:
        student = ElasticEncoder(args.query_model, device="cpu")
        query, dim = student.encode(texts, normalize=student.normalize_output), student.hidden_size
    else:
        layer, dim = (int(x) for x in args.query_cell.lower().split("x"))
        query = model.encode(texts, layer=layer, dim=dim, normalize=norm)
    document = model.encode(texts, dim=dim, normalize=norm)
    np.savez(args.output, texts=np.array(texts, dtype=object), query=query, document=document)
    print(f"{len(texts)} texts: query side {query.shape}, documents {document.shape} -> {args.output}")


def check(args) -> None:
    if importlib.util.find_spec("matryoshka2d") is not None:
        raise SystemExit("matryoshka2d can be imported here: run `check` in a virtualenv without it")
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    print(
        f"{platform.processor() or platform.machine()}, python {platform.python_version()}, torch {torch.__version__}, "
        f"sentence-transformers {sentence_transformers.__version__}; matryoshka2d not importable"
    )
    print("command:", " ".join(sys.argv))
    ref = np.load(args.reference, allow_pickle=True)
    texts = list(ref["texts"])
    pair = SentenceTransformer(args.pair, device="cpu")
    rows = {
        "encode_query vs the query side": (pair.encode_query(texts), ref["query"]),
        "encode_document vs the model": (pair.encode_document(texts), ref["document"]),
        "encode (default route) vs the model": (pair.encode(texts), ref["document"]),
    }
    ok = True
    for what, (got, want) in rows.items():
        diff = float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")
        ok &= diff <= ATOL
        print(f"{len(texts)} SciFact texts, {what}: shape {got.shape}, max |difference| {diff:.2e} (line {ATOL:g})")
    print("met" if ok else "NOT met")
    sys.exit(0 if ok else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("reference")
    p.add_argument("--model", default="minilm-l6")
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--query-model")
    side.add_argument("--query-cell")
    p.add_argument("--data", default=os.environ.get("MATRYOSHKA2D_DATA", "../shared/data"))
    p.add_argument("--texts", type=int, default=100)
    p.add_argument("--output", required=True)
    p = sub.add_parser("check")
    p.add_argument("--pair", required=True)
    p.add_argument("--reference", required=True)
    args = parser.parse_args()
    (reference if args.step == "reference" else check)(args)


if __name__ == "__main__":
    main()
