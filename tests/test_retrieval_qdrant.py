"""The Qdrant backend: cells as named vectors of one collection, the cascade as one query with a prefetch.

qdrant-client's local mode (`--path`) runs every command here; it is the client's own Python search, not the
server's engine. The same prefetch-then-rescore query is also run on qdrant-edge-py, Qdrant's Rust shard engine
in-process, over the same vectors, and must give the same answers.
"""

import json

import numpy as np
import pytest
import torch

from helpers.data import DOCS, write_corpus
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.retrieval.index import IndexBuildError, build_index
from matryoshka2d.retrieval.shards import cell_name, load_shards

pytest.importorskip("qdrant_client", reason="qdrant-client (the [qdrant] extra, in dev) is not installed")

QUERIES = ["document number 3 talks about guitars", "rain and snow", "tea or code", "music of bikes"]


@pytest.fixture(scope="module")
def built(tiny_dir, tmp_path_factory):
    """The tiny corpus built twice from one model: faiss files and a local-mode Qdrant collection."""
    root = tmp_path_factory.mktemp("qdrant")
    corpus = write_corpus(root / "corpus.jsonl")
    queries = root / "queries.txt"
    queries.write_text("\n".join(QUERIES) + "\n", encoding="utf-8")
    common = ["--model", str(tiny_dir), "--pooling", "mean"]
    build = ["index", "build", *common, "--corpus", str(corpus), "--cells", "1:8,4:32", "--shard-size", "7"]
    assert main([*build, "--output", str(root / "faiss")]) == 0
    # Local mode searches exactly whatever the quantisation; a server would search the small cell's int8 copy.
    qdrant = [*build, "--output", str(root / "q"), "--backend", "qdrant", "--path", str(root / "local")]
    qdrant += ["--quantization", "scalar"]
    assert main([*qdrant, "--keep-shards"]) == 0
    return root, common, queries


def search(root, common, queries, index, *extra):
    out = root / "hits.jsonl"
    assert (
        main(["search", "--index", str(root / index), *common, "--queries", str(queries), "--output", str(out), *extra])
        == 0
    )
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize(
    "extra",
    [
        ["--cascade", "1:8,4:32", "--shortlist", "10", "--top-k", "5"],
        ["--cascade", "1:8,4:32", "--shortlist", "10", "--top-k", "5", "--query-layer", "1"],
        ["--top-k", "5"],
        ["--cell", "1:8", "--top-k", "5"],
    ],
)
def test_qdrant_answers_as_faiss_does(built, extra, capsys):
    root, common, queries = built
    faiss_hits = search(root, common, queries, "faiss", *extra)
    qdrant_hits = search(root, common, queries, "q", *extra)
    for mine, theirs in zip(qdrant_hits, faiss_hits, strict=True):
        assert mine["ids"] == theirs["ids"]
        np.testing.assert_allclose(mine["scores"], theirs["scores"], atol=1e-5)
    assert "qdrant" in capsys.readouterr().err


def test_the_collection_records_the_build_and_keeps_the_full_cell_on_disk_without_a_graph(built):
    from qdrant_client import QdrantClient

    root, _, _ = built
    client = QdrantClient(path=str(root / "local"))
    try:
        info = client.get_collection("q")
        vectors = info.config.params.vectors
        assert vectors["cell-4x32"].on_disk and vectors["cell-4x32"].hnsw_config.m == 0
        assert vectors["cell-1x8"].size == 8 and not vectors["cell-1x8"].on_disk
        assert (
            vectors["cell-1x8"].quantization_config.scalar.type == "int8"
            and not vectors["cell-4x32"].quantization_config
        )
        recorded = info.config.metadata["matryoshka2d"]
        assert recorded["complete"] and recorded["cells"] == [[1, 8], [4, 32]] and recorded["model"]["weights_sha256"]
        point = client.retrieve("q", [3], with_payload=True)[0]
        assert point.payload == {"doc_id": "d3", "text": "Title 3 document number 3 talks about guitars"}
        assert client.count("q").count == len(DOCS)
    finally:
        client.close()


def test_qdrant_edge_runs_the_same_queries_on_the_real_engine(built, tiny_dir):
    """The prefetch + rescore query on Qdrant's Rust engine (qdrant-edge-py), with the collection's vector
    settings (local mode records them but ignores them: its search is always exact) and its segments built by
    optimize(), over the same shard vectors: the same top ids and scores as local mode."""
    edge = pytest.importorskip("qdrant_edge", reason="qdrant-edge-py (in dev) is not installed")
    from matryoshka2d.retrieval.qdrant_store import QdrantIndex, QdrantTarget, vector_params
    from matryoshka2d.retrieval.search import query_vectors

    root, _, _ = built
    manifest = json.loads((root / "q" / "manifest.json").read_text())
    cells = [tuple(c) for c in manifest["cells"]]
    # Unquantised: the engine's int8 copy of a small cell shortlists by int8 scores, which local mode never does
    # (benchmarks/qdrant_cascade.py measures that difference on SciFact).
    params = vector_params(cells, "none")
    config = edge.EdgeConfig(
        vectors={
            name: edge.EdgeVectorParams(
                size=p.size,
                distance=edge.Distance.Cosine,
                on_disk=bool(p.on_disk),
                hnsw_config=edge.HnswIndexConfig(m=p.hnsw_config.m, ef_construct=100, full_scan_threshold=10000)
                if p.hnsw_config
                else None,
            )
            for name, p in params.items()
        },
        # Index even this tiny shard, so that optimize() builds what the settings ask for (the engine keeps small
        # segments plain otherwise).
        optimizers=edge.EdgeOptimizersConfig(indexing_threshold=1),
    )
    shard = edge.EdgeShard.create(str(root / "edge"), config)
    try:
        position = 0
        for s in load_shards(root / "q", manifest):
            points = [
                edge.Point(position + i, {cell_name(c): s[cell_name(c)][i].tolist() for c in cells}, {"doc_id": str(d)})
                for i, d in enumerate(s["ids"])
            ]
            shard.update(edge.UpdateOperation.upsert_points(points))
            position += len(points)
        shard.flush()
        shard.optimize()
        assert shard.info().indexed_vectors_count > 0  # the engine built its indexed segment
        encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
        small, full = cells
        vectors = query_vectors(encoder, QUERIES, cells)
        local = QdrantIndex(QdrantTarget(path=str(root / "local"), collection="q"))
        try:
            hits = local.search(encoder, QUERIES, cascade=(small, full), shortlist=10, top_k=5)
        finally:
            local.close()
        for i in range(len(QUERIES)):
            answer = shard.query(
                edge.QueryRequest(
                    prefetches=[
                        edge.Prefetch(
                            query=edge.Query.Nearest(vectors[small][i].tolist(), using=cell_name(small)), limit=10
                        )
                    ],
                    query=edge.Query.Nearest(vectors[full][i].tolist(), using=cell_name(full)),
                    limit=5,
                    with_payload=True,
                )
            )
            assert [p.payload["doc_id"] for p in answer] == hits.ids[i]
            np.testing.assert_allclose([p.score for p in answer], hits.scores[i], atol=1e-5)
    finally:
        shard.close()


def test_a_killed_upload_resumes_and_completes(tiny_dir, tmp_path, monkeypatch):
    from qdrant_client import QdrantClient

    from matryoshka2d.retrieval.qdrant_store import QdrantTarget

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    target = QdrantTarget(path=str(tmp_path / "local"), collection="c")
    calls = []
    original = QdrantClient.upsert

    def dies_on_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(QdrantClient, "upsert", dies_on_third)
    build = dict(shard_size=7, log=lambda m: None, backend="qdrant", qdrant=target)
    with pytest.raises(KeyboardInterrupt):
        build_index(encoder, corpus, [(2, 16), (4, 32)], tmp_path / "out", **build)
    partial = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert partial["uploaded"] == ["shard-00000.npz", "shard-00001.npz"] and not partial["complete"]
    with pytest.raises(IndexBuildError, match="not finished"):
        main_search(tmp_path, tiny_dir)
    monkeypatch.undo()
    manifest = build_index(encoder, corpus, [(2, 16), (4, 32)], tmp_path / "out", **build)
    assert manifest["complete"] and len(manifest["uploaded"]) == 5
    client = QdrantClient(path=str(tmp_path / "local"))
    assert client.count("c").count == len(DOCS)
    client.close()
    hits = main_search(tmp_path, tiny_dir)
    assert hits.ids[0][0] == "d3"


def main_search(tmp_path, tiny_dir):
    from matryoshka2d.retrieval.qdrant_store import QdrantIndex, QdrantTarget

    index = QdrantIndex(QdrantTarget(path=str(tmp_path / "local"), collection="c"))
    try:
        encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
        return index.search(encoder, QUERIES[:1], cascade=((2, 16), (4, 32)), shortlist=30, top_k=3)
    finally:
        index.close()


def test_a_collection_from_another_model_is_refused_and_kept(built, tiny_dir, tmp_path, capsys):
    root, _, _ = built
    other = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    with torch.no_grad():
        other.model.embeddings.word_embeddings.weight[0] += 1.0
    other_dir = other.save(tmp_path / "other")
    before = (root / "local" / "collection" / "q" / "storage.sqlite").read_bytes()
    corpus = root / "corpus.jsonl"
    build = ["index", "build", "--model", str(other_dir), "--corpus", str(corpus), "--cells", "1:8,4:32"]
    assert main([*build, "--shard-size", "7", "--output", str(tmp_path / "o"), "--backend", "qdrant",
                 "--path", str(root / "local"), "--collection", "q", "--overwrite"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "collection 'q': was built from another model" in err and "Nothing was changed" in err
    assert not (tmp_path / "o").exists()
    assert (root / "local" / "collection" / "q" / "storage.sqlite").read_bytes() == before
    # Searching it with the other model is refused the same way.
    assert main(["search", "--index", str(root / "q"), "--model", str(other_dir), "--query", "rain"]) == 2
    assert "was built from another model" in capsys.readouterr().err


def test_bad_targets_get_clear_errors_and_change_nothing(built, tiny_dir, tmp_path, capsys):
    root, common, _ = built
    corpus = root / "corpus.jsonl"
    build = ["index", "build", *common, "--corpus", str(corpus), "--cells", "1:8,4:32", "--output", str(tmp_path / "o")]
    assert main([*build, "--backend", "qdrant", "--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--url http://127.0.0.1:1: no Qdrant server answers there" in err and "Nothing was changed" in err
    assert not (tmp_path / "o").exists()
    assert main([*build, "--backend", "qdrant"]) == 2
    assert "--url URL (a Qdrant server) or --path DIR" in capsys.readouterr().err
    assert main([*build, "--backend", "qdrant", "--path", str(tmp_path / "l"), "--storage", "int8"]) == 2
    assert "--quantization none|scalar|binary" in capsys.readouterr().err
    assert main([*build, "--url", "http://localhost:6333"]) == 2
    assert "are for --backend qdrant" in capsys.readouterr().err
    search = ["search", *common, "--query", "rain"]
    assert main([*search, "--url", "http://127.0.0.1:1", "--collection", "q"]) == 2
    assert "no Qdrant server answers there" in capsys.readouterr().err
    assert main([*search, "--path", str(root / "local"), "--collection", "missing"]) == 2
    assert "no collection 'missing'" in capsys.readouterr().err
    # The same collection through --path and --collection alone.
    assert main([*search, "--path", str(root / "local"), "--collection", "q", "--cascade", "1:8,4:32"]) == 0
    assert "qdrant cascade (1,8) prefetch 100 -> (4,32)" in capsys.readouterr().err


def test_server_search_parameters(built, capsys):
    from matryoshka2d.retrieval.qdrant_store import QdrantIndex, QdrantTarget, search_params

    assert search_params(None, None) is None
    params = search_params(128, 4.0)
    assert params.hnsw_ef == 128 and params.quantization.oversampling == 4.0 and params.quantization.rescore
    assert search_params(None, 2.0).hnsw_ef is None
    root, common, _ = built
    with pytest.raises(IndexBuildError, match="--oversampling must be at least 1, got 0.5"):
        QdrantIndex(QdrantTarget(path=str(root / "local"), collection="q"), oversampling=0.5)
    search = ["search", "--index", str(root / "faiss"), *common, "--query", "rain", "--oversampling", "2"]
    assert main(search) == 2
    assert "--oversampling are for Qdrant" in capsys.readouterr().err


@pytest.mark.parametrize("index", ["faiss", "q"])
def test_a_query_layer_deeper_than_the_documents_is_refused_by_both_backends(built, capsys, index):
    """Queries exit at most at the documents' layer, in a faiss index and a Qdrant collection alike."""
    root, common, queries = built
    args = ["search", "--index", str(root / index), *common, "--queries", str(queries)]
    assert main([*args, "--cell", "1:8", "--query-layer", "3"]) == 2
    assert "--query-layer 3 is deeper than the documents of cell 1:8" in capsys.readouterr().err
