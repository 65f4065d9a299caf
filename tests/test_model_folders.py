"""Model folders (plain, with exit heads or a static cell, a query encoder, a query/document pair) are read through the
one confined reader (confined.ConfinedFolder, issue 52, items 2 and 6): its links and every name its files give
(modules.json, router_config.json, matryoshka2d.json records) are checked before anything is opened; a Hugging Face
cache snapshot is a model folder; a pair folder is checked as one model; a static cell is never carried over to
weights it was not aligned to; exit heads holding NaN, inf or integers are refused; and the model folder's writes go
through the one writer (matryoshka2d.outputs).

The opens are watched with a Python audit hook (event "open"), which records while `watching_opens` is active.
Files that Rust code opens (safetensors, tokenizers) raise no audit event; they are covered by the link check that
runs before anything is opened, and by the refusal's words, which are the same whatever lies outside.
"""

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers.audit import opens, recording, writes
from helpers.models import set_heads_record
from matryoshka2d.cli import main
from matryoshka2d.models.backbones import BackboneError
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads import HEADS_FILE, HeadsError
from matryoshka2d.outputs import is_writer_temporary

pytestmark = pytest.mark.usefixtures("one_thread")


TEXTS = ["a red cat", "the old dog sleeps in the sun"]


@contextlib.contextmanager
def watching_opens():
    """Every file opened through Python while the block runs: (absolute path, mode, flags) (tests/helpers/audit.py)."""
    with recording() as events:
        opened: list = []
        yield opened
    opened += opens(events)


def opened_inside(opened, place: Path) -> list[str]:
    """The opened paths that, links followed, lie in `place`."""
    place = place.resolve()
    return [path for path, _, _ in opened if Path(path).resolve().is_relative_to(place)]


@pytest.fixture(scope="module")
def st_model(tiny_dir, tmp_path_factory):
    """The tiny model saved as a sentence-transformers folder."""
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    return encoder.save(tmp_path_factory.mktemp("confined") / "model")


@pytest.fixture(scope="module")
def pair(tiny_dir, tmp_path_factory):
    """A query/document pair of the tiny model (`export --query-cell 2x16`)."""
    out = tmp_path_factory.mktemp("confined-pair") / "pair"
    assert (
        main(["export", "--pooling", "mean", "--model", str(tiny_dir), "--query-cell", "2x16", "--output", str(out)])
        == 0
    )
    return out


def outside_model(pair: Path, where: Path, state: str) -> None:
    """What lies outside a tampered folder: a whole model (the pair's document transformer: config, weights,
    tokenizer), an empty folder, or nothing."""
    if where.exists():
        shutil.rmtree(where)
    if state == "model":
        shutil.copytree(pair / "document_0_Transformer", where)
    elif state == "empty":
        where.mkdir()


def route_to(folder: Path, route: str, target: str) -> None:
    config_file = folder / "router_config.json"
    config = json.loads(config_file.read_text())
    old = config["structure"][route][0]
    config["structure"][route][0] = target
    config["types"][target] = config["types"].pop(old)
    config_file.write_text(json.dumps(config))


def refused(model: str, capsys, monkeypatch) -> tuple[str, str, str]:
    """(ElasticEncoder's error, `encode`'s and `serve`'s stderr) for a folder that must be refused at load."""
    from matryoshka2d.serve import process

    with pytest.raises(ValueError) as library:
        ElasticEncoder(model, device="cpu")
    capsys.readouterr()
    texts = Path(model).parent / "texts.txt"
    texts.write_text("a red cat\n")
    assert main(["encode", "--model", model, "--input", str(texts), "--output", str(texts) + ".npy"]) == 2
    encode = capsys.readouterr().err
    monkeypatch.setattr(process, "serve_app", lambda *a, **k: pytest.fail("a refused model was served"))
    assert main(["serve", "--model", model, "--port", "0"]) == 2
    serve = capsys.readouterr().err
    return str(library.value), encode, serve


@pytest.mark.parametrize("way", ["..", "absolute", "link"])
def test_a_pair_route_out_of_the_folder_is_refused_before_anything_outside_is_opened(
    pair, tmp_path, capsys, monkeypatch, way
):
    """Was: the route's config, weights and tokenizer were opened and loaded before the refusal, whose words differed
    with what exists outside (a content oracle). Now one message, whatever lies outside, and nothing opened there."""
    folder, outside = tmp_path / "pair", tmp_path / "outside"
    shutil.copytree(pair, folder)
    if way == "link":
        (folder / "elsewhere").symlink_to(outside, target_is_directory=True)
    route_to(folder, "document", {"..": "../outside", "absolute": str(outside), "link": "elsewhere"}[way])
    messages = set()
    for state in ("model", "empty", "missing"):
        outside_model(pair, outside, state)
        with watching_opens() as opened:
            library, encode, serve = refused(str(folder), capsys, monkeypatch)
        assert not opened_inside(opened, outside), f"{state}: opened outside the pair"
        assert "router_config.json" in library and "structure.document[0]" in library and "leaves" in library
        assert library in encode and library in serve  # `encode`, `serve --model` and the library alike
        messages.add(library)
    assert len(messages) == 1, messages  # the same words whatever exists outside: no content oracle


@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors", "matryoshka2d.json", "1_Pooling/config.json"])
def test_a_file_linked_out_of_a_model_folder_is_refused_before_anything_is_opened(st_model, tmp_path, capsys, name):
    """Was: a tokenizer.json or model.safetensors linked to a file anywhere was read by transformers (their names
    are fixed, so no record names them), and a matryoshka2d.json link was read for a query encoder's record."""
    from matryoshka2d.models.query_record import query_encoder_record_at

    folder, outside = tmp_path / "model", tmp_path / "outside"
    shutil.copytree(st_model, folder)
    outside.mkdir()
    if not (folder / name).exists():
        (folder / name).write_text(json.dumps({"distill": {"mode": "query"}}))
    shutil.copy(folder / name, outside / Path(name).name)
    (folder / name).unlink()
    (folder / name).symlink_to(outside / Path(name).name)
    with watching_opens() as opened:
        with pytest.raises(ValueError, match="leaves") as library:
            ElasticEncoder(str(folder), device="cpu")
        with pytest.raises(ValueError, match="leaves"):
            query_encoder_record_at(folder)  # what serve --query-model reads before it loads the folder
        assert main(["info", str(folder)]) == 2
    assert not opened_inside(opened, outside)
    assert str(folder / name) in str(library.value)
    assert "leaves" in capsys.readouterr().err


def test_a_symbolic_link_loop_in_a_model_folder_is_one_line_naming_the_folder(st_model, tmp_path, capsys):
    """Was: pathlib's RuntimeError ("Symlink loop") as a traceback."""
    folder = tmp_path / "model"
    shutil.copytree(st_model, folder)
    (folder / "a").symlink_to(folder / "b")
    (folder / "b").symlink_to(folder / "a")
    with pytest.raises(BackboneError, match="loops"):
        ElasticEncoder(str(folder), device="cpu")
    assert main(["info", str(folder)]) == 2
    assert str(folder) in capsys.readouterr().err


def test_every_file_a_pair_opens_through_python_is_inside_it(pair):
    with watching_opens() as opened:
        loaded = ElasticEncoder(str(pair), device="cpu")
    assert loaded.query_encoder is not None
    mine = [p for p, _, _ in opened if Path(p).resolve().is_relative_to(pair.parent.parent.resolve())]
    assert mine and all(Path(p).resolve().is_relative_to(pair.resolve()) for p in mine)


def as_hub_snapshot(folder: Path, cache: Path) -> Path:
    """`folder` laid out as the Hugging Face cache leaves it: models--ORG--NAME/snapshots/REV/ whose files are
    relative links into ../../blobs (by content hash)."""
    import hashlib

    repo = cache / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    blobs.mkdir(parents=True)
    for file in sorted(folder.rglob("*")):
        if not file.is_file():
            continue
        blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def test_a_hugging_face_cache_snapshot_loads_with_its_exit_heads_and_static_cell(st_model, tmp_path):
    """Was: refused as "outside the folder" (its files link into ../../blobs); the static cell's files were checked
    against the static/ folder alone, so even a snapshot accepted elsewhere could not hold one."""
    from matryoshka2d.models.heads import ExitHeads

    model = with_static_cell(st_model)
    model.set_exit_heads(ExitHeads.identity([1, 2], model.transformer_size, model.hidden_size))
    saved = model.save(tmp_path / "saved")
    snapshot = as_hub_snapshot(saved, tmp_path / "hub")
    assert (snapshot / "model.safetensors").is_symlink()
    with watching_opens() as opened:
        loaded = ElasticEncoder(str(snapshot), device="cpu")
    assert loaded.static_cell is not None and loaded.exit_heads is not None
    assert not [p for p, _, _ in opened if Path(p).resolve().is_relative_to(saved.resolve())]
    torch.testing.assert_close(
        torch.from_numpy(loaded.encode(TEXTS, layer=0)), torch.from_numpy(model.encode(TEXTS, layer=0))
    )
    torch.testing.assert_close(
        torch.from_numpy(loaded.encode(TEXTS, layer=2)), torch.from_numpy(model.encode(TEXTS, layer=2))
    )
    # a link from the snapshot anywhere else is still refused
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(saved / "tokenizer.json")
    with pytest.raises(BackboneError, match="leaves"):
        ElasticEncoder(str(snapshot), device="cpu")


def _blobs_led_elsewhere(snapshot: Path, way: str, tmp_path: Path) -> Path:
    """Make the snapshot's `../../blobs` a link that leads out of its repository (`way`), with the model's files
    still where its links lead, so a reader that follows it reads a whole model from there; returns that folder."""
    repo = snapshot.parent.parent
    blobs = repo / "blobs"
    if way == "another folder":
        target = tmp_path / "elsewhere"
        shutil.move(blobs, target)
    elif way == "another repository":
        target = as_hub_snapshot(snapshot, tmp_path / "other-hub").parent.parent / "blobs"
        shutil.rmtree(blobs)
    else:  # "/": every link names its blob by its absolute path below the root
        target = tmp_path / "store"
        shutil.move(blobs, target)
        for link in [p for p in snapshot.rglob("*") if p.is_symlink()]:
            name = (target / Path(os.readlink(link)).name).relative_to("/")
            link.unlink()
            link.symlink_to(os.path.relpath(blobs, link.parent) + "/" + str(name))
        target = Path("/")
    blobs.symlink_to(target, target_is_directory=True)
    return target


@pytest.mark.parametrize("way", ["another folder", "another repository", "/"])
def test_a_snapshot_whose_blobs_folder_is_a_link_is_read_nowhere(st_model, tmp_path, capsys, way):
    """Was: a snapshot whose `blobs/` was a link (to another folder, another repository's blobs, `/`) was read as
    the model: the files it leads to, outside the cache, were loaded. Its links now leave the folder, refused before
    anything is opened, in words that are the same whatever lies outside."""
    snapshot = as_hub_snapshot(st_model, tmp_path / "hub")
    outside = _blobs_led_elsewhere(snapshot, way, tmp_path)
    watched = tmp_path / "store" if way == "/" else outside
    with watching_opens() as opened:
        with pytest.raises(BackboneError, match="leaves") as refused:
            ElasticEncoder(str(snapshot), device="cpu")
        assert main(["info", str(snapshot)]) == 2
    assert not [p for p, _, _ in opened if Path(p).resolve().is_relative_to(watched.resolve())]
    assert "leaves" in capsys.readouterr().err and str(watched) not in str(refused.value)
    if way == "another folder":  # nothing outside changes a word: the blobs gone from there, the same refusal
        shutil.rmtree(outside)
        outside.mkdir()
        with pytest.raises(BackboneError) as empty:
            ElasticEncoder(str(snapshot), device="cpu")
        assert str(empty.value) == str(refused.value)


def test_a_snapshot_link_to_a_folder_inside_its_blobs_is_refused(st_model, tmp_path):
    """Blobs are files: a snapshot folder that is a link into blobs/ would be read without its files' links
    being checked (one of them leading anywhere)."""
    snapshot = as_hub_snapshot(st_model, tmp_path / "hub")
    pooling = snapshot / "1_Pooling"
    hidden = snapshot.parent.parent / "blobs" / "pooling"
    hidden.mkdir()
    for link in pooling.iterdir():
        shutil.copyfile(link, hidden / link.name)
    shutil.rmtree(pooling)
    pooling.symlink_to(os.path.relpath(hidden, snapshot), target_is_directory=True)
    with pytest.raises(BackboneError, match="leaves"):
        ElasticEncoder(str(snapshot), device="cpu")


def test_a_hub_id_is_read_only_through_a_cached_snapshot_that_stays_inside_itself(st_model, tmp_path, monkeypatch):
    """A model named by its hub id is read by transformers from the local Hugging Face cache: that snapshot is
    checked as a model folder first, so a `blobs/` link there is refused before anything is opened."""
    hub = tmp_path / "hub"
    snapshot = as_hub_snapshot(st_model, hub)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    from matryoshka2d.models.st_folder import cached_snapshot, model_folder

    assert cached_snapshot("org/tiny") == snapshot and model_folder("org/tiny") is None  # checked, and read by id
    outside = _blobs_led_elsewhere(snapshot, "another folder", tmp_path)
    with watching_opens() as opened, pytest.raises(BackboneError, match="leaves"):
        ElasticEncoder("org/tiny", device="cpu")
    assert not [p for p, _, _ in opened if Path(p).resolve().is_relative_to(outside.resolve())]


def pair_meta(folder: Path) -> dict:
    """The folder's matryoshka2d.json ({} when it has none)."""
    meta = folder / "matryoshka2d.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


def test_a_pair_whose_routes_were_swapped_is_refused(pair, tmp_path):
    folder = tmp_path / "pair"
    shutil.copytree(pair, folder)
    config = json.loads((folder / "router_config.json").read_text())
    config["structure"] = {"query": config["structure"]["document"], "document": config["structure"]["query"]}
    (folder / "router_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="swapped") as refused_swap:
        ElasticEncoder(str(folder), device="cpu")
    assert str(folder / "router_config.json") in str(refused_swap.value)
    # the routes' record swapped too (as a hand-edited folder might): the weights still say which route is which
    meta = pair_meta(folder)
    meta["pair"]["routes"] = {route: config["structure"][route] for route in ("query", "document")}
    (folder / "matryoshka2d.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="holds the query route's weights") as refused_weights:
        ElasticEncoder(str(folder), device="cpu")
    assert str(folder) in str(refused_weights.value)


def test_a_pair_whose_document_weights_were_replaced_is_refused(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "pair"
    shutil.copytree(pair, folder)
    weights = folder / "document_0_Transformer" / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(k for k in tensors if k.endswith("word_embeddings.weight"))
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="replaced or changed") as refused_weights:
        ElasticEncoder(str(folder), device="cpu")
    assert "document route" in str(refused_weights.value) and str(folder) in str(refused_weights.value)


def test_a_pair_whose_query_side_was_distilled_from_another_teacher_is_refused(pair, tmp_path):
    """The query side's `distill` record against the document side's weights, pooling and layers; with the document
    model as its teacher the same pair loads."""
    folder = tmp_path / "pair"
    shutil.copytree(pair, folder)
    meta = pair_meta(folder)
    query, document = meta["pair"]["query"], meta["pair"]["document"]
    record = {
        "mode": "query",
        "teacher": "another-model",
        "teacher_weights_sha256": "f" * 64,
        "teacher_pooling": "mean",
        "teacher_layers": document["layer"],
        "weights_sha256": query["route_sha256"],  # the query route's own weights (query_record.check_own_weights)
        "width": query["dim"],
    }
    query.update(kind="query encoder", distill=record)
    (folder / "matryoshka2d.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="distilled from another-model") as refused_teacher:
        ElasticEncoder(str(folder), device="cpu")
    assert str(folder / "matryoshka2d.json") in str(refused_teacher.value)
    record["teacher_weights_sha256"] = document["weights_sha256"]
    (folder / "matryoshka2d.json").write_text(json.dumps(meta))
    assert ElasticEncoder(str(folder), device="cpu").query_encoder.num_layers == 2
    record["teacher_pooling"] = "cls"
    (folder / "matryoshka2d.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="pooled with mean"):
        ElasticEncoder(str(folder), device="cpu")


def test_a_pair_record_without_route_checksums_is_refused_naming_the_folder(pair, tmp_path):
    folder = tmp_path / "pair"
    shutil.copytree(pair, folder)
    meta = pair_meta(folder)
    del meta["pair"]["document"]["route_sha256"]
    (folder / "matryoshka2d.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="export the pair again") as refused_old:
        ElasticEncoder(str(folder), device="cpu")
    assert str(folder) in str(refused_old.value)


def with_static_cell(model_dir: Path) -> ElasticEncoder:
    """The model with a static cell: a random table on its own tokenizer, an identity head."""
    from matryoshka2d.models.static import StaticCell

    encoder = ElasticEncoder(str(model_dir), device="cpu")
    vocabulary = encoder.tokenizer.backend_tokenizer.get_vocab_size()
    table = torch.randn(vocabulary, encoder.hidden_size, generator=torch.Generator().manual_seed(0))
    encoder.set_static_cell(StaticCell.build(encoder.tokenizer.backend_tokenizer, table, encoder.hidden_size))
    return encoder


def test_a_saved_model_whose_weights_changed_drops_its_static_cell(st_model, tmp_path):
    """Was: save_folder stamped the old cell with the new weights' checksum, so `train`, `distill` and `merge` of a
    folder with a static cell saved a stale layer 0 that loaded as this model's."""
    first = with_static_cell(st_model).save(tmp_path / "with-cell")
    loaded = ElasticEncoder(str(first), device="cpu")
    assert loaded.static_cell is not None
    kept = loaded.save(tmp_path / "kept")  # the same weights (as `heads fit` saves them): the cell stays
    again = ElasticEncoder(str(kept), device="cpu")
    assert again.static_cell is not None
    assert pair_meta(kept)["static"]["backbone_sha256"] == pair_meta(first)["static"]["backbone_sha256"]
    with torch.no_grad():
        loaded.model.embeddings.word_embeddings.weight.mul_(1.5)  # what training does to the backbone
    changed = loaded.save(tmp_path / "changed")
    assert "static" not in pair_meta(changed) and not (changed / "static").exists()
    assert ElasticEncoder(str(changed), device="cpu").static_cell is None
    # saved again into the folder that held the cell: the old static/ goes with its record
    loaded.save(first)
    assert not (first / "static").exists() and "static" not in pair_meta(first)


@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors"])
def test_a_static_cell_whose_table_or_tokenizer_was_replaced_is_refused_naming_the_file(st_model, tmp_path, name):
    saved = with_static_cell(st_model).save(tmp_path / "with-cell")
    other = with_static_cell(st_model)
    with torch.no_grad():
        other.static_cell.embedding.embedding.weight.mul_(3)
    other.static_cell.save(tmp_path / "other-static")
    shutil.copyfile(tmp_path / "other-static" / name, saved / "static" / name)
    if name == "tokenizer.json":  # another tokenizer, not only other numbers
        tokenizer = json.loads((saved / "static" / name).read_text())
        tokenizer["normalizer"] = None
        (saved / "static" / name).write_text(json.dumps(tokenizer))
    with pytest.raises(BackboneError, match="damaged or was changed") as refused_cell:
        ElasticEncoder(str(saved), device="cpu")
    assert str(saved / "static" / name) in str(refused_cell.value)


def test_a_model_save_and_a_pair_export_write_only_through_the_writers_temporary_names(st_model, tiny_dir, tmp_path):
    """Every file opened for writing while a model folder (with exit heads and a static cell) is saved, and while
    a pair is exported, has a temporary name of the one writer (moved into place when whole)."""
    from matryoshka2d.models.heads import ExitHeads

    model = with_static_cell(st_model)
    model.set_exit_heads(ExitHeads.identity([1, 2], model.transformer_size, model.hidden_size))
    with watching_opens() as opened:
        model.save(tmp_path / "saved", metadata={"which": "test"})
        assert (
            main(
                [
                    "export",
                    "--model",
                    str(tmp_path / "saved"),
                    "--query-cell",
                    "2x16",
                    "--output",
                    str(tmp_path / "pair"),
                ]
            )
            == 0
        )
    written = [p for p, mode, flags in opened if writes(mode, flags) and Path(p).is_relative_to(tmp_path)]
    assert written and not [p for p in written if not is_writer_temporary(p)], written
    assert {"README.md", "matryoshka2d.json", "config.json"} <= {p.name for p in (tmp_path / "saved").iterdir()}
    assert not [p for p in tmp_path.rglob("*") if is_writer_temporary(p)]  # nothing temporary left behind
    assert ElasticEncoder(str(tmp_path / "pair"), device="cpu").query_encoder.num_layers == 2


@pytest.mark.parametrize("kind", ["nan", "inf", "int"])
def test_heads_holding_nan_inf_or_integers_are_refused_even_with_the_checksum_rerecorded(planted, kind):
    from safetensors.torch import load_file, save_file

    from matryoshka2d.files import file_sha256

    path = planted / HEADS_FILE
    tensors = load_file(str(path))
    key = sorted(tensors)[0]
    if kind == "int":
        tensors[key] = tensors[key].round().to(torch.int32)
    else:
        tensors[key].view(-1)[0] = float("nan") if kind == "nan" else float("inf")
    save_file(tensors, str(path))
    set_heads_record(planted, sha256=file_sha256(path))
    with pytest.raises(HeadsError, match="not a float tensor" if kind == "int" else "NaN or inf"):
        ElasticEncoder(str(planted), device="cpu")
