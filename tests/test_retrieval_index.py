"""Index build (one pass, resumable), flat / cascade / asymmetric search, on a tiny random model."""

import json

import numpy as np
import pytest

from helpers.cli import exit_code
from helpers.data import DOCS, write_corpus
from matryoshka2d.cells import unit_rows
from matryoshka2d.cli import main
from matryoshka2d.files import DataFormatError
from matryoshka2d.retrieval.faiss_indexes import ScaledQueryIndex, factory_string, hnsw_graph, make_index, searchable
from matryoshka2d.retrieval.index import IndexBuildError, build_index
from matryoshka2d.retrieval.search import CellIndex, cascade_search, flat_search, stored_vectors


def test_build_stores_each_cell_from_one_pass(tiny_bert, tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.jsonl.gz", gz=True)
    calls = []
    original = tiny_bert.pooled_states

    def counting(texts, layers, *a, **k):
        calls.append(sorted(layers))
        return original(texts, layers, *a, **k)

    monkeypatch.setattr(tiny_bert, "pooled_states", counting)
    manifest = build_index(tiny_bert, corpus, [(1, 8), (4, 32)], tmp_path / "idx", shard_size=7, log=lambda m: None)
    assert calls == [[1, 4]] * 5  # one pass per shard of 7 documents, both layers pooled on the way
    assert manifest["complete"] and manifest["documents"] == 30
    assert manifest["model"]["weights_sha256"]
    index = CellIndex(tmp_path / "idx")
    assert index.ids == [d["_id"] for d in DOCS]
    monkeypatch.undo()
    texts = [f"{d['title']} {d['text']}" for d in DOCS]
    expected = unit_rows(tiny_bert.encode(texts, layer=1, dim=8))
    stored = index.index((1, 8)).reconstruct_n(0, 30)
    np.testing.assert_allclose(stored, expected, atol=1e-5)


def test_killed_build_resumes_without_reencoding(tiny_bert, tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    original = tiny_bert.pooled_states
    seen = []

    def dies_on_third(texts, layers, *a, **k):
        seen.append(len(texts))
        if len(seen) == 3:
            raise KeyboardInterrupt
        return original(texts, layers, *a, **k)

    monkeypatch.setattr(tiny_bert, "pooled_states", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)
    partial = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert partial["documents"] == 16 and not partial["complete"]
    # A build killed while writing leaves a temporary file, or a shard the manifest does not name yet: both are
    # redone, never read.
    (tmp_path / "idx" / "shards" / "shard-00002.npz").write_bytes(b"PK\x03\x04 half a shard")
    (tmp_path / "idx" / "shards" / "shard-00003.tmp.npz").write_bytes(b"PK\x03\x04")
    with pytest.raises(IndexBuildError, match="not finished"):
        CellIndex(tmp_path / "idx")
    seen.clear()

    def counting(texts, layers, *a, **k):
        seen.append(len(texts))
        return original(texts, layers, *a, **k)

    monkeypatch.setattr(tiny_bert, "pooled_states", counting)
    manifest = build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", shard_size=8, log=lambda m: None)
    assert seen == [8, 6]  # only the documents not yet in a finished shard
    assert manifest["documents"] == 30
    assert CellIndex(tmp_path / "idx").ids == [d["_id"] for d in DOCS]
    texts = [f"{d['title']} {d['text']}" for d in DOCS]
    stored = CellIndex(tmp_path / "idx").index((2, 16)).reconstruct_n(0, 30)
    np.testing.assert_allclose(stored, unit_rows(original(texts, [2])[2][:, :16]), atol=1e-5)
    assert not list((tmp_path / "idx" / "shards").iterdir())


def test_different_settings_in_the_same_directory_are_refused(tiny_bert, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", log=lambda m: None)
    with pytest.raises(IndexBuildError, match=r"different cells.*--overwrite"):
        build_index(tiny_bert, corpus, [(3, 16)], tmp_path / "idx", log=lambda m: None)
    build_index(tiny_bert, corpus, [(3, 16)], tmp_path / "idx", overwrite=True, log=lambda m: None)
    assert CellIndex(tmp_path / "idx").cells == [(3, 16)]


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
@pytest.mark.parametrize("storage", ["float32", "float16", "int8"])
def test_index_kinds_and_storage_find_the_exact_neighbours(kind, storage):
    rng = np.random.default_rng(0)
    vectors = unit_rows(rng.normal(size=(400, 16)))
    index = make_index(vectors, kind, storage)
    if kind == "ivf":
        import faiss

        faiss.extract_index_ivf(index).nprobe = 64
    ids, _ = flat_search(index, vectors[:20], 1)
    assert (ids[:, 0] == np.arange(20)).mean() >= 0.95
    assert np.abs(index.reconstruct_batch(np.arange(5)) - vectors[:5]).max() < (0.05 if storage == "int8" else 1e-2)
    assert factory_string(kind, storage, 400).startswith({"flat": "", "hnsw": "HNSW", "ivf": "IVF"}[kind])


@pytest.mark.parametrize("storage", ["float32", "int8", "int8-direct", "binary"])
def test_hnsw_graphs_are_built_with_the_wider_construction_search(tmp_path, storage):
    """faiss builds HNSW links with efConstruction 40 unless told; ours use HNSW_EF_CONSTRUCTION, which is
    written into the index file with the graph, and the build's manifest says so."""
    import faiss

    from matryoshka2d.retrieval.faiss_indexes import HNSW_EF_CONSTRUCTION

    index = make_index(unit_rows(np.random.default_rng(3).normal(size=(300, 16))), "hnsw", storage)
    path = str(tmp_path / "cell.faiss")
    if storage == "binary":
        faiss.write_index_binary(index, path)
        graph = faiss.read_index_binary(path).hnsw
    else:
        faiss.write_index(index, path)
        loaded = faiss.read_index(path)  # owns the graph that hnsw_graph returns a view of
        graph = hnsw_graph(loaded)
    assert graph.efConstruction == HNSW_EF_CONSTRUCTION == 200


def test_an_hnsw_build_records_its_construction_search(tiny_bert, tmp_path):
    from matryoshka2d.retrieval.faiss_indexes import HNSW_EF_CONSTRUCTION

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "idx", kind="hnsw", log=lambda m: None)
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["hnsw_ef_construction"] == HNSW_EF_CONSTRUCTION
    build_index(tiny_bert, corpus, [(2, 16)], tmp_path / "flat", log=lambda m: None)
    assert "hnsw_ef_construction" not in json.loads((tmp_path / "flat" / "manifest.json").read_text())


def test_cascade_with_full_shortlist_equals_flat_and_excludes_ids():
    rng = np.random.default_rng(1)
    docs = unit_rows(rng.normal(size=(200, 32)))
    queries = unit_rows(rng.normal(size=(10, 32)))
    small, full = make_index(unit_rows(docs[:, :8]), "flat", "float32"), make_index(docs, "flat", "float32")
    flat_ids, flat_scores = flat_search(full, queries, 5)
    ids, scores = cascade_search(small, full, unit_rows(queries[:, :8]), queries, shortlist=200, k=5)
    np.testing.assert_array_equal(ids, flat_ids)
    np.testing.assert_allclose(scores, flat_scores, rtol=1e-5)
    exclude = flat_ids[:, 0].copy()
    ids, _ = cascade_search(small, full, unit_rows(queries[:, :8]), queries, shortlist=200, k=5, exclude=exclude)
    np.testing.assert_array_equal(ids, flat_search(full, queries, 5, exclude)[0])
    assert not (ids == exclude[:, None]).any()
    with pytest.raises(ValueError, match="--shortlist 3 is smaller than --top-k 5"):
        cascade_search(small, full, queries[:, :8], queries, shortlist=3, k=5)


def test_float16_rerank_rows_widen_exactly(tmp_path):
    """The rerank reads float16 rows (a memory-mapped file) and widens them with torch: the same float32 numbers
    numpy gives, and a cascade over them ranks as one over the float32 vectors would."""
    rng = np.random.default_rng(2)
    docs = unit_rows(rng.normal(size=(300, 48))).astype(np.float16)
    np.save(tmp_path / "rerank.f16.npy", docs)
    mapped = np.load(tmp_path / "rerank.f16.npy", mmap_mode="r")
    ids = np.array([5, 299, 0, 5, 17])
    got = stored_vectors(mapped, ids)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, docs[ids].astype(np.float32))
    queries = unit_rows(rng.normal(size=(4, 48)))
    small = make_index(unit_rows(docs[:, :8].astype(np.float32)), "flat", "float32")
    ids, scores = cascade_search(small, mapped, unit_rows(queries[:, :8]), queries, shortlist=300, k=5)
    expected_ids, expected_scores = flat_search(make_index(docs.astype(np.float32), "flat", "float32"), queries, 5)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-5)


def test_index_build_and_search_commands(tiny_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "idx"
    common = ["--model", str(tiny_dir), "--pooling", "mean"]
    assert main(["index", "build", *common, "--corpus", str(corpus), "--cells", "1:8,4:32", "--output", str(out)]) == 0
    assert "index of 30 documents" in capsys.readouterr().out
    search = ["search", "--index", str(out), *common, "--query", "document number 3 talks about guitars"]
    assert main([*search, "--top-k", "3"]) == 0
    flat = capsys.readouterr()
    assert "flat (4,32)" in flat.err and flat.out.count("\n") == 4
    assert main([*search, "--top-k", "3", "--cascade", "1:8,4:32", "--shortlist", "30"]) == 0
    cascade = capsys.readouterr()
    assert cascade.out == flat.out  # a shortlist of the whole corpus reranks to the flat answer
    assert "cascade (1,8) shortlist 30 -> (4,32)" in cascade.err
    assert main([*search, "--query-layer", "2", "--top-k", "2"]) == 0
    assert "queries at layer 2" in capsys.readouterr().err
    queries = tmp_path / "q.txt"
    queries.write_text("cats\n\ndogs\n")
    assert (
        main(["search", "--index", str(out), *common, "--queries", str(queries), "--output", str(tmp_path / "r.jsonl")])
        == 0
    )
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["query"] for r in rows] == ["cats", "dogs"] and len(rows[0]["ids"]) == 10
    assert [r["query_id"] for r in rows] == ["1", "3"]  # line numbers of a text file (issue 32, case 16)
    beir = tmp_path / "q.jsonl"
    beir.write_text('{"_id": "q7", "text": "cats"}\n{"_id": "q9", "text": "dogs"}\n')
    assert (
        main(["search", "--index", str(out), *common, "--queries", str(beir), "--output", str(tmp_path / "b.jsonl")])
        == 0
    )
    assert [json.loads(x)["query_id"] for x in (tmp_path / "b.jsonl").read_text().splitlines()] == ["q7", "q9"]


def test_errors_name_what_was_wrong(tiny_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    common = ["--model", str(tiny_dir), "--pooling", "mean"]
    build = ["index", "build", *common, "--corpus", str(corpus), "--output", str(tmp_path / "idx")]
    assert exit_code([*build, "--cells", "2:x"]) == 2  # refused where it is parsed
    assert "argument --cells: cannot read cell '2:x'" in capsys.readouterr().err
    assert main([*build, "--cells", "9:16"]) == 2
    assert "layer 9 is out of range" in capsys.readouterr().err
    assert main([*build[:-4], "--corpus", str(tmp_path / "none.jsonl"), "--output", "x", "--cells", "1:8"]) == 2
    assert "none.jsonl: file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"_id": "a", "text": "fine"}\n{"_id": "b"}\n')
    with pytest.raises(DataFormatError, match="bad.jsonl line 2: no 'text'"):
        list(__import__("matryoshka2d.retrieval.shards", fromlist=["read_corpus"]).read_corpus(bad))
    assert main([*build, "--cells", "1:8,2:16"]) == 0
    capsys.readouterr()
    search = ["search", "--index", str(tmp_path / "idx"), *common, "--query", "cats"]
    assert main([*search, "--cell", "3:16"]) == 2
    assert "no index for cell 3:16 (cells here: 1:8, 2:16)" in capsys.readouterr().err
    assert exit_code([*search, "--cascade", "1:8"]) == 2  # refused where it is parsed
    assert "argument --cascade: '1:8': give exactly two cells" in capsys.readouterr().err
    assert main(["search", "--index", str(tmp_path), "--query", "x"]) == 2
    assert "no manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize(("kind", "storage"), [("hnsw", "float16"), ("ivf", "int8")])
def test_approximate_indexes_build_and_search_from_the_command_line(tiny_dir, tmp_path, capsys, kind, storage):
    corpus = write_corpus(
        tmp_path / "corpus.jsonl", DOCS * 1 + [{"_id": f"x{i}", "text": f"extra {i}"} for i in range(60)]
    )
    out = tmp_path / "idx"
    common = ["--model", str(tiny_dir), "--pooling", "mean"]
    build = ["index", "build", *common, "--corpus", str(corpus), "--cells", "1:8,4:32", "--output", str(out)]
    assert main([*build, "--index", kind, "--storage", storage]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["index"] == kind and manifest["storage"] == storage and manifest["shards"] == []
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"_id": "q1", "text": "cats"}\n{"_id": "q2", "text": "tea"}\n')
    capsys.readouterr()
    assert main(["search", "--index", str(out), *common, "--queries", str(queries), "--cascade", "1:8,4:32"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("query: ") == 2 and printed.count("  10. ") == 2


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_binary_indexes_shortlist_by_hamming_distance(kind):
    from matryoshka2d.retrieval.faiss_indexes import sign_bits
    from matryoshka2d.retrieval.search import shortlist_search

    rng = np.random.default_rng(2)
    vectors = unit_rows(rng.normal(size=(400, 20)))  # 20 bits, padded to 3 bytes
    index = make_index(vectors, kind, "binary")
    assert index.d == 24 and index.ntotal == 400
    if kind == "ivf":
        index.nprobe = index.nlist
    ids = shortlist_search(index, vectors[:20], 5)
    assert (ids[:, 0] == np.arange(20)).mean() >= 0.95  # each vector's own bits are at distance 0
    np.testing.assert_array_equal(sign_bits(vectors[:1])[0], np.packbits(vectors[0] > 0))
    assert factory_string(kind, "binary", 400).startswith("B")


def test_binary_storage_builds_and_rescores_with_float16_vectors(tiny_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    common = ["--model", str(tiny_dir), "--pooling", "mean"]
    build = ["index", "build", *common, "--corpus", str(corpus), "--cells", "1:8,4:32"]
    assert main([*build, "--output", str(tmp_path / "float")]) == 0
    assert main([*build, "--output", str(tmp_path / "binary"), "--storage", "binary"]) == 0
    binary = CellIndex(tmp_path / "binary")
    rescoring = binary.rerank_vectors((4, 32))
    assert rescoring.dtype == np.float16 and rescoring.shape == (30, 32) and isinstance(rescoring, np.memmap)
    assert (tmp_path / "binary" / "cell-4x32.faiss").stat().st_size < 30 * 32  # 4 bytes of bits per vector
    capsys.readouterr()
    search = [*common, "--query", "document number 3 talks about guitars", "--top-k", "5"]
    for extra in (["--shortlist", "30"], ["--cascade", "1:8,4:32", "--shortlist", "30"]):
        assert main(["search", "--index", str(tmp_path / "float"), *search]) == 0
        exact = capsys.readouterr().out
        assert main(["search", "--index", str(tmp_path / "binary"), *search, *extra]) == 0
        got = capsys.readouterr()
        # A shortlist of the whole corpus rescored with float16 vectors: the float ranking, scores to 1e-3.
        ids = [line.split()[1] for line in got.out.splitlines()[1:]]
        assert ids == [line.split()[1] for line in exact.splitlines()[1:]]
        if extra[0] == "--shortlist":
            assert "binary (4,32): Hamming shortlist 30, float16 rescoring" in got.err


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_int8_direct_stores_whole_numbers_under_one_scale_and_ranks_like_cosine(tmp_path, kind):
    """int8-direct: faiss's direct codec reads a stored byte as the number itself, so the build hands it whole
    numbers within +-127 (it would truncate fractions and wrap larger ones around), and the file scales each
    unit query by the same factor: searched with unit vectors, the L2 order is the cosine order."""
    import faiss

    rng = np.random.default_rng(4)
    vectors = unit_rows(rng.normal(size=(400, 24)))
    vectors[0] = np.eye(24)[0]  # one number of 1.0, beyond the 1e-5 quantile: clipped, not wrapped around
    built = make_index(vectors, kind, "int8-direct")
    path = str(tmp_path / "cell.faiss")
    faiss.write_index(built, path)
    index = faiss.read_index(path)
    inner = faiss.downcast_index(index.index)
    if kind == "ivf":
        faiss.extract_index_ivf(index).nprobe = 64
    codes = inner.reconstruct_n(0, inner.ntotal)
    assert np.array_equal(codes, np.rint(codes)) and np.abs(codes).max() == 127
    assert codes[0, 0] == 127  # clipped at the top, not wrapped to -128 + something
    scale = faiss.vector_to_array(faiss.downcast_VectorTransform(index.chain.at(0)).A)[0]
    assert np.allclose(codes[1:] / scale, vectors[1:], atol=0.6 / scale)  # half a step from each number
    queries = unit_rows(rng.normal(size=(30, 24)))
    _, ids = index.search(queries, 5)
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :5]
    assert (ids[:, 0] == exact[:, 0]).mean() >= 0.9
    # searched as `search` does (the query scaled in numpy), in memory right after the build and from the file
    for fast in (searchable(built), searchable(index)):
        assert isinstance(fast, ScaledQueryIndex) and fast.scale == scale
        if kind == "ivf":
            faiss.extract_index_ivf(fast.owner).nprobe = 64
        np.testing.assert_array_equal(fast.search(queries, 5)[1], ids)
    assert factory_string(kind, "int8-direct", 400).endswith("SQ8_direct_signed")


def test_int8_direct_storage_rescores_with_float16_vectors(tiny_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    common = ["--model", str(tiny_dir), "--pooling", "mean"]
    build = ["index", "build", *common, "--corpus", str(corpus), "--cells", "1:8,4:32", "--index", "hnsw"]
    assert main([*build, "--output", str(tmp_path / "float"), "--storage", "float32"]) == 0
    assert main([*build, "--output", str(tmp_path / "int8"), "--storage", "int8-direct"]) == 0
    built = CellIndex(tmp_path / "int8")
    rescoring = built.rerank_vectors((4, 32))
    assert rescoring.dtype == np.float16 and rescoring.shape == (30, 32) and isinstance(rescoring, np.memmap)
    manifest = json.loads((tmp_path / "int8" / "manifest.json").read_text())
    assert set(manifest["files"]) >= {"cell-4x32.faiss", "cell-4x32.f16.npy", "cell-1x8.f16.npy"}
    assert manifest["factory"]["cell-4x32"] == "HNSW32_SQ8_direct_signed"
    capsys.readouterr()
    search = [*common, "--query", "document number 3 talks about guitars", "--top-k", "5", "--ef-search", "64"]
    for extra in (["--shortlist", "30"], ["--cascade", "1:8,4:32", "--shortlist", "30"]):
        assert main(["search", "--index", str(tmp_path / "float"), *search]) == 0
        exact = capsys.readouterr().out
        assert main(["search", "--index", str(tmp_path / "int8"), *search, *extra]) == 0
        got = capsys.readouterr()
        # The whole corpus shortlisted and rescored with float16: the float ranking, and scores to 1e-3.
        assert [line.split()[1] for line in got.out.splitlines()[1:]] == [
            line.split()[1] for line in exact.splitlines()[1:]
        ]
        ours = [float(line.split()[2]) for line in got.out.splitlines()[1:]]
        theirs = [float(line.split()[2]) for line in exact.splitlines()[1:]]
        assert np.allclose(ours, theirs, atol=1e-3)
        if extra[0] == "--shortlist":
            assert "int8-direct (4,32): int8 shortlist 30, float16 rescoring" in got.err


@pytest.mark.parametrize("storage", ["binary", "int8-direct"])
def test_a_damaged_float16_rescoring_file_is_named_not_read(tiny_dir, tmp_path, capsys, storage):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    common = ["--model", str(tiny_dir), "--pooling", "mean"]
    out = tmp_path / "idx"
    assert main(["index", "build", *common, "--corpus", str(corpus), "--cells", "4:32", "--output", str(out),
                 "--storage", storage]) == 0  # fmt: skip
    rescoring = out / "cell-4x32.f16.npy"
    data = bytearray(rescoring.read_bytes())
    data[-8:] = b"\x00" * 8  # same size, other numbers: only the checksum can tell
    rescoring.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["search", "--index", str(out), *common, "--query", "cats", "--shortlist", "10"]) == 2
    err = capsys.readouterr().err
    assert "cell-4x32.f16.npy: its sha256 differs" in err and "Traceback" not in err


def test_an_int8_direct_graph_is_the_float_graph_with_int8_numbers():
    """The HNSW links of an int8-direct index are those a float32 index of the same vectors gets (built the
    same way), so the walk is as good as the float graph's and only the numbers it reads are int8; the copied
    graph must rank smaller L2 distances first, as the file read back does."""
    import faiss

    vectors = unit_rows(np.random.default_rng(5).normal(size=(600, 16)))
    int8 = searchable(make_index(vectors, "hnsw", "int8-direct"))
    float_owner = make_index(vectors, "hnsw", "float32")  # a downcast is a view: the owner must outlive it
    floats = faiss.downcast_index(float_owner)
    np.testing.assert_array_equal(
        faiss.vector_to_array(int8.inner.hnsw.neighbors), faiss.vector_to_array(floats.hnsw.neighbors)
    )
    assert not int8.inner.hnsw.is_similarity and floats.hnsw.is_similarity
    int8.inner.hnsw.efSearch = floats.hnsw.efSearch = 64
    assert (int8.search(vectors[:50], 1)[1][:, 0] == np.arange(50)).mean() >= 0.95
