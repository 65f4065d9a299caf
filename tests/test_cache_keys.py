"""Issue 52, items 3 and 4 (c), and issue 61, item 5: one cache key (matryoshka2d.cache_keys) names every cached
artefact, over everything that changes what it holds, and each cache refuses or misses what was made under other
settings, or edited since:

- `cache_key`: every parameter of its signature (enumerated, so one added later is covered) changes the key;
- `texts_sha256`: texts are hashed with their lengths, so no text (a NUL, an empty one) makes two lists one;
- what a key reads from a model: every field of its configuration and every setting of its tokenizer (enumerated
  from the model, so one added later is covered) changes the key, or is shown to change no vector;
- distill's teacher targets: made with another --max-length, pooling, tokenizer (its truncation side included),
  configuration (its layer_norm_eps included) or texts are refused by name; rows or a record edited by hand, their
  checksum recorded again, are refused by their signature;
- the retrieval document cache (`eval retrieval --doc-cache`): a file of other settings, or one edited, is a miss;
- the ONNX graph cache: a graph under another key (pooling, recipe) is rebuilt; the tokenizer and the max length
  are not in a graph (the backend tokenizes before it), which serves them exactly;
- the one writer (matryoshka2d.outputs): a run whose `teacher-targets/` is a link to another run's is refused, the
  other run byte for byte intact.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.models import distill_config
from matryoshka2d.cache_keys import (
    CONFIG_NAMES,
    cache_key,
    config_sha256,
    encoder_config_sha256,
    texts_sha256,
    tokenizer_settings,
    tokenizer_sha256,
)
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.outputs import OutputError, command_scope
from matryoshka2d.training.distill import DistillTrainer
from matryoshka2d.training.targets import TargetsError, TargetsKey, TeacherTargets

pytestmark = pytest.mark.usefixtures("one_thread")

# ---- the key itself ---------------------------------------------------------------------------------------------

KNOWN = {
    "kind": "teacher-targets",
    "weights_sha256": "a" * 64,
    "config_sha256": "d" * 64,
    "tokenizer_sha256": "b" * 64,
    "max_length": 128,
    "pooling": "mean",
    "widths": [64, 128],
    "texts_sha256": "c" * 64,
}


def _base_arguments() -> dict:
    """A value for every parameter of cache_key's signature (one added later gets a value of its own)."""
    return {
        name: KNOWN.get(name, f"value of {name}")
        for name, p in inspect.signature(cache_key).parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }


def _other_values(value) -> list:
    """Values other than `value` of the same kind, and None ("does not apply")."""
    if isinstance(value, bool):
        return [not value, None]
    if isinstance(value, int):
        return [value + 1, value - 1, None]
    if isinstance(value, list):
        return [[*value, 256], value[:-1], list(reversed(value)), None]
    return [f"{value}x", str(value)[:-1], None]


def _key(arguments: dict) -> str:
    arguments = dict(arguments)
    kind = arguments.pop("kind")
    return cache_key(kind, **arguments)


def test_every_parameter_of_cache_key_changes_the_key():
    """Enumerated from the signature: a parameter added to cache_key later is covered without listing it here."""
    base = _base_arguments()
    assert set(KNOWN) <= set(base), "a parameter the key was built on is gone from cache_key"
    reference = _key(base)
    seen = {reference}
    for name, value in base.items():
        for other in _other_values(value):
            if name == "kind" and other is None:
                continue  # a kind is always named
            key = _key({**base, name: other})
            assert key != reference, f"changing {name} from {value!r} to {other!r} does not change the key"
            assert key not in seen, f"{name}={other!r} gives the key of another change"
            seen.add(key)
    assert _key(dict(base)) == reference  # and the same arguments give the same key


def test_every_parameter_of_cache_key_must_be_given_and_extras_count():
    """No parameter has a default (a caller cannot forget one); a kind's own extra and its value change the key."""
    parameters = inspect.signature(cache_key).parameters.values()
    named = [p for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert all(p.default is inspect.Parameter.empty for p in named), [p.name for p in named if p.default != p.empty]
    base = _base_arguments()
    for p in named:
        if p.name == "kind":
            continue
        with pytest.raises(TypeError):
            _key({k: v for k, v in base.items() if k != p.name})
    keys = {_key(base), _key({**base, "layer": 2}), _key({**base, "layer": 3}), _key({**base, "layers": 2})}
    assert len(keys) == 4
    # the names count, not only the values: the same value under two parameters gives two keys
    assert _key({**base, "weights_sha256": "x", "tokenizer_sha256": "y"}) != _key(
        {**base, "weights_sha256": "y", "tokenizer_sha256": "x"}
    )


# ---- what a key reads from a model: every field of its configuration, every setting of its tokenizer ----------

TEXTS_TO_TOKENIZE = ["A Red Cat sleeps on the old mat while the BLUE fish swims", "dog"]


def _other(value):
    """A value of the same kind as `value` and other than it (a special token: another token of the vocabulary)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 if value else 0.5
    if isinstance(value, str):
        return {"right": "left", "left": "right"}.get(value, f"{value}-other")
    if isinstance(value, list):
        return [*value, value[-1] if value else 1]
    if isinstance(value, dict):  # one more entry, its key of the kind of the others (id2label's are numbers)
        first = next(iter(value), "other")
        return {**value, first + len(value) if isinstance(first, int) else f"{first}-other": 1}
    if hasattr(value, "content"):
        return "[unused1]"
    return True  # None: a value where there was none


def _rebuilt(encoder, **changes) -> ElasticEncoder:
    """The encoder's tensors in a transformer built from its configuration with `changes`."""
    import copy

    import transformers

    config = copy.deepcopy(encoder.model.config)
    for name, value in changes.items():
        setattr(config, name, value)
    model = transformers.AutoModel.from_config(config)
    model.load_state_dict(encoder.model.state_dict())
    return ElasticEncoder.from_modules(model.eval(), encoder.tokenizer, pooling=encoder.pooling, device="cpu")


def test_every_config_field_that_changes_the_vectors_changes_the_key(tiny_dir):
    """Enumerated from the model's own configuration (a field transformers adds later is covered): each field
    changes the key, or is one of CONFIG_NAMES (named, not computed) and leaves every vector as it was."""
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    fields, inputs = encoder.model.config.to_dict(), list(encoder._input_names)
    reference, vectors = config_sha256(fields, inputs), encoder.pooled_states(TEXTS_TO_TOKENIZE, [2, 4])
    assert "layer_norm_eps" in fields and encoder_config_sha256(encoder) == reference
    for name in sorted(set(fields) | CONFIG_NAMES):
        other = _other(fields.get(name))
        if name not in CONFIG_NAMES:
            assert config_sha256({**fields, name: other}, inputs) != reference, f"{name} is not in the key"
            continue
        assert config_sha256({**fields, name: other}, inputs) == reference
        again = _rebuilt(encoder, **{name: other}).pooled_states(TEXTS_TO_TOKENIZE, [2, 4])
        assert all(np.array_equal(again[n], vectors[n]) for n in (2, 4)), f"{name} changes the vectors"
    # what the model is fed and its pooler head's activation are in it too, and a real change reaches the key
    assert config_sha256(fields, inputs[:-1]) != reference != config_sha256(fields, inputs, "Tanh")
    changed = _rebuilt(encoder, layer_norm_eps=1e-3)
    assert not np.allclose(changed.pooled_states(TEXTS_TO_TOKENIZE, [4])[4], vectors[4])
    assert encoder_config_sha256(changed) != reference


def _tokens(tokenizer) -> dict:
    return dict(tokenizer(TEXTS_TO_TOKENIZE, truncation=True, max_length=6, padding=True))


def test_every_tokenizer_setting_that_changes_the_tokens_changes_the_key(tiny_dir):
    """Enumerated from the tokenizer's own settings (those its files give and those it holds: one added later is
    covered): loaded with any one of them changed, it tokenizes as before or has another key. The truncation side
    was in no key (issue 61); it and the padding side are among the settings the test sees change the tokens."""
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(tiny_dir)
    reference, tokens, changes_tokens = tokenizer_sha256(base), _tokens(base), []
    for name, value in sorted(tokenizer_settings(base).items()):
        try:
            changed = AutoTokenizer.from_pretrained(tiny_dir, **{name: _other(value)})
            now = _tokens(changed)
        except (ValueError, TypeError, AttributeError, KeyError):
            continue  # a value this setting cannot take: no tokenizer to compare
        if now != tokens:
            changes_tokens.append(name)
            assert tokenizer_sha256(changed) != reference, f"{name} changes the tokens but not the key"
    assert {"truncation_side", "padding_side", "do_lower_case"} <= set(changes_tokens), changes_tokens


@pytest.mark.parametrize(
    "one, other",
    [
        (["a\0b"], ["a", "b"]),
        (["ab", ""], ["a", "b"]),
        (["a", "b"], ["b", "a"]),
        (["x y\0z", "w"], ["x y", "z\0w"]),  # the same count, and "\0".join of both is the same
        ([], [""]),
        ([""], ["", ""]),
        (["a\0"], ["a", ""]),
        (["é"], ["e\u0301"]),  # what a reader sees alike is hashed as the bytes it is
    ],
)
def test_texts_are_hashed_with_their_lengths_so_no_two_lists_share_a_checksum(one, other):
    assert texts_sha256(one) != texts_sha256(other)
    assert texts_sha256(list(one)) == texts_sha256(iter(one))


# ---- distill's teacher targets ----------------------------------------------------------------------------------

# Two lists of texts that the old checksum (each text then a NUL) could not tell apart: the same count too.
NUL_TWINS = (["red cat sleeps\0old dog", "blue fish"], ["red cat sleeps", "old dog\0blue fish"])


def _files(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def tokenizer_twin(teacher_dir, tmp_path_factory):
    """The teacher's folder with another tokenizer setting (no lower-casing): the same weights, other token ids."""
    folder = tmp_path_factory.mktemp("teacher-cased") / "teacher"
    shutil.copytree(teacher_dir, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["do_lower_case"] = False
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


@pytest.fixture(scope="module")
def made(teacher_dir, tmp_path_factory):
    """Targets of NUL_TWINS[0] made by the teacher (mean pooling, its own max length), in a run folder."""
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    run = tmp_path_factory.mktemp("targets") / "run"
    from matryoshka2d.models.identity import weights_sha256

    TeacherTargets(run).compute(teacher, NUL_TWINS[0], weights_sha256(teacher), progress=False)
    return run, weights_sha256(teacher), teacher.hidden_size


def _edited(folder: Path, to: Path, config: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A copy of model folder `folder` at `to` whose config.json and tokenizer_config.json have `config` and
    `tokenizer` written over them: the same tensors and vocabulary, another setting."""
    shutil.copytree(folder, to)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        settings = json.loads((to / name).read_text())
        (to / name).write_text(json.dumps({**settings, **(changes or {})}))
    return to


# What a teacher can change with the same tensors, and how a refusal names it. The configuration and the truncation
# side were in no key (issue 61): a teacher whose layer_norm_eps was edited hit the cache of the old one.
SETTING_CHANGES = [
    ({"max_length": 16}, "--max-length"),
    ({"pooling": "cls"}, "--pooling"),
    ({"tokenizer": {"do_lower_case": False}}, "the teacher's tokenizer"),
    ({"tokenizer": {"truncation_side": "left"}}, "the teacher's tokenizer"),
    ({"config": {"layer_norm_eps": 1e-3}}, "the teacher's configuration"),
    ({"config": {"hidden_act": "relu"}}, "the teacher's configuration"),
]


@pytest.mark.parametrize("change, named", SETTING_CHANGES)
def test_targets_made_with_another_setting_of_the_teacher_are_refused_by_name(
    made, teacher_dir, tmp_path, change, named
):
    """Was: targets made with another --max-length or pooling, and then with another configuration or truncation
    side of the teacher's, were read back as the run's own."""
    run, sha, dim = made
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = _files(copy)
    folder = teacher_dir
    if "config" in change or "tokenizer" in change:
        folder = _edited(teacher_dir, tmp_path / "teacher", change.get("config"), change.get("tokenizer"))
    teacher = ElasticEncoder(
        str(folder), pooling=change.get("pooling", "mean"), max_length=change.get("max_length"), device="cpu"
    )
    assert (
        TeacherTargets(copy)
        .load(NUL_TWINS[0], sha, dim, TargetsKey.of(ElasticEncoder(str(teacher_dir), pooling="mean")))[0]
        .any()
    )
    with pytest.raises(TargetsError, match="made with other settings") as refused:
        TeacherTargets(copy).load(NUL_TWINS[0], sha, dim, TargetsKey.of(teacher))
    assert named in str(refused.value) and "targets.json" in str(refused.value) and "--overwrite" in str(refused.value)
    assert _files(copy) == before


def test_targets_of_texts_that_join_alike_with_nul_are_refused(made):
    """Was: the texts were checksummed joined by NUL, so these two lists (same count) shared targets."""
    run, sha, dim = made
    with pytest.raises(TargetsError, match="the targets are of other texts"):
        TeacherTargets(run).load(NUL_TWINS[1], sha, dim)


def test_targets_recorded_under_another_key_or_none_are_refused(made, teacher_dir, tmp_path):
    run, sha, dim = made
    settings = TargetsKey.of(ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu"))
    record = json.loads((run / "teacher-targets" / "targets.json").read_text())
    assert record["cache_key"] == settings.key(sha, dim, texts_sha256(NUL_TWINS[0]))
    assert record["max_length"] == settings.max_length and record["pooling"] == "mean"
    for name, value in (("cache_key", "0" * 64), ("cache_key", None)):
        copy = tmp_path / f"run-{value}"
        shutil.copytree(run, copy)
        edited = {**record, name: value} if value else {k: v for k, v in record.items() if k != name}
        (copy / "teacher-targets" / "targets.json").write_text(json.dumps(edited))
        match = "is not the key of this run" if value else "records no cache key"
        with pytest.raises(TargetsError, match=match):
            TeacherTargets(copy).load(NUL_TWINS[0], sha, dim, settings)


@pytest.mark.parametrize("edit", ["rows swapped", "a row negated", "the record", "no signature", "another key"])
def test_targets_edited_by_hand_are_refused_even_with_their_checksum_recorded_again(
    made, teacher_dir, tmp_path, monkeypatch, edit
):
    """Was: rows replaced by other unit vectors (they pass the unit-length check), the file's sha256 written into
    the record again as anyone can compute it, were trained on as the teacher's. The signature needs this machine's
    key: an edit of the rows or of the record, a record without one, or one made under another key is refused."""
    from matryoshka2d.files import file_sha256

    run, sha, dim = made
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    targets, settings = TeacherTargets(copy), TargetsKey.of(ElasticEncoder(str(teacher_dir), pooling="mean"))
    assert targets.load(NUL_TWINS[0], sha, dim, settings).shape == (2, dim)
    rows = np.fromfile(targets.vectors_path, dtype=np.float16).reshape(-1, dim)
    record = json.loads(targets.record_path.read_text())
    if edit == "rows swapped":
        rows = rows[::-1].copy()
    elif edit == "a row negated":
        rows[1] = -rows[1]
    elif edit == "the record":
        record["teacher"] = "a teacher of the editor's choosing"
    elif edit == "no signature":
        del record["signature"]
    else:
        monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "another-machine"))
    targets.vectors_path.write_bytes(rows.tobytes())
    record["sha256"] = file_sha256(targets.vectors_path)
    targets.record_path.write_text(json.dumps(record))
    match = "records no signature" if edit == "no signature" else "its signature does not hold"
    with pytest.raises(TargetsError, match=match) as refused:
        TeacherTargets(copy).load(NUL_TWINS[0], sha, dim, settings)
    assert "targets.json" in str(refused.value) and "--overwrite" in str(refused.value)


def _distill(teacher, text_file, sts_dev, out, **changes):
    options = {"mode": "shared", "max_texts": 24}
    return DistillTrainer(distill_config(teacher, text_file, out, sts_dev, steps=1, method_options=options, **changes))


@pytest.fixture(scope="module")
def first_run(teacher_dir, text_file, sts_dev, tmp_path_factory):
    """A finished distill run (max length 16, mean pooling) whose teacher targets the tests try to reach."""
    out = tmp_path_factory.mktemp("distill") / "first"
    _distill(teacher_dir, text_file, sts_dev, out, max_length=16).run(progress=False)
    return out


@pytest.mark.parametrize("change, named", [({"max_length": 32}, "--max-length"), ({"pooling": "cls"}, "--pooling")])
def test_a_distill_run_refuses_targets_its_folder_holds_from_another_max_length_or_pooling(
    first_run, teacher_dir, text_file, sts_dev, tmp_path, change, named
):
    """The issue's case end to end: the same texts and teacher, another --max-length (or pooling): refused by name,
    the folder untouched; --overwrite recomputes them under this run's key."""
    other = tmp_path / "other"
    shutil.copytree(first_run / "teacher-targets", other / "teacher-targets")
    before = _files(other)
    changes = {"max_length": 16, **change}
    with pytest.raises(TargetsError, match="made with other settings") as refused:
        _distill(teacher_dir, text_file, sts_dev, other, **changes).run(progress=False)
    assert named in str(refused.value) and _files(other) == before
    _distill(teacher_dir, text_file, sts_dev, other, **changes).run(progress=False, overwrite=True)
    record = json.loads((other / "teacher-targets" / "targets.json").read_text())
    assert record[next(iter(change))] == next(iter(change.values()))


# ---- the one writer: a teacher-targets folder that is a link to another run's ------------------------------------


def test_a_teacher_targets_link_to_another_runs_is_refused_and_that_run_stays_intact(
    first_run, teacher_dir, text_file, sts_dev, tmp_path
):
    """Was: a run folder whose teacher-targets/ was a link to another run's had that run's files read as its own,
    deleted (--overwrite) or replaced."""
    other_run = tmp_path / "first"
    shutil.copytree(first_run, other_run)
    before = _files(other_run)
    run = tmp_path / "second"
    run.mkdir()
    (run / "teacher-targets").symlink_to(other_run / "teacher-targets")
    with pytest.raises(TargetsError, match="leaves"):  # a new run: not read as its own
        _distill(teacher_dir, text_file, sts_dev, run, max_length=16).run(progress=False)
    with pytest.raises(OutputError, match="symbolic link"):  # --overwrite: not deleted through the link
        _distill(teacher_dir, text_file, sts_dev, run, max_length=16).run(progress=False, overwrite=True)
    assert (run / "teacher-targets").is_symlink() and _files(other_run) == before

    # a link to a folder without targets (another run's checkpoints, say): not filled through the link
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "kept.txt").write_text("another run's file")
    fresh = tmp_path / "third"
    fresh.mkdir()
    (fresh / "teacher-targets").symlink_to(victim)
    with pytest.raises(TargetsError, match="symbolic link"):  # a new run
        _distill(teacher_dir, text_file, sts_dev, fresh, max_length=16).run(progress=False)
    with pytest.raises(OutputError, match="symbolic link"):  # --overwrite
        _distill(teacher_dir, text_file, sts_dev, fresh, max_length=16).run(progress=False, overwrite=True)
    teacher = ElasticEncoder(str(teacher_dir), pooling="mean", device="cpu")
    with pytest.raises(OutputError, match="symbolic link"):  # the library's compute, called on its own
        TeacherTargets(fresh).compute(teacher, ["a red cat"], "t" * 64, progress=False)
    assert _files(victim) == {Path("kept.txt"): b"another run's file"}


def test_the_cli_refuses_overwrite_through_a_teacher_targets_link(
    first_run, teacher_dir, text_file, sts_dev, tmp_path, capsys
):
    other_run = tmp_path / "first"
    shutil.copytree(first_run, other_run)
    before = _files(other_run)
    run = tmp_path / "second"
    run.mkdir()
    (run / "teacher-targets").symlink_to(other_run / "teacher-targets")
    args = ["distill", "--teacher", str(teacher_dir), "--pooling", "mean", "--data", str(text_file), "--quiet"]
    args += ["--max-texts", "24", "--steps", "1", "--max-length", "16", "--eval-file", str(sts_dev)]
    args += ["--exit-heads", "identity"]
    assert main([*args, "--output", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "teacher-targets" in err and "symbolic link" in err and "Traceback" not in err
    assert _files(other_run) == before


# ---- the retrieval document cache (eval retrieval --doc-cache) -------------------------------------------------


@pytest.fixture
def counted(monkeypatch):
    """The number of texts of every pooled_states call (a hit encodes no document)."""
    calls = []
    real = ElasticEncoder.pooled_states
    monkeypatch.setattr(
        ElasticEncoder,
        "pooled_states",
        lambda self, texts, *a, **k: calls.append(len(texts)) or real(self, texts, *a, **k),
    )
    return calls


def _documents(encoder, texts, cache):
    from matryoshka2d.retrieval.cascade import document_states

    return document_states(encoder, texts, [2, 4], 16, False, cache)


DOCUMENT_CHANGES = [
    {"max_length": 4},
    {"pooling": "cls"},
    *(c for c, _ in SETTING_CHANGES if c.keys() & {"config", "tokenizer"}),
]


@pytest.mark.parametrize("change", [*DOCUMENT_CHANGES, "texts"], ids=str)
def test_the_document_cache_misses_what_was_made_with_other_settings(tiny_dir, tmp_path, counted, change):
    """Was: documents checksummed joined by NUL shared a cache file; a model of another configuration or truncation
    side hit the cache of the old one. The key now covers the tokenizer (every setting) and the configuration."""
    cache = tmp_path / "cache"
    texts = list(NUL_TWINS[0])
    made = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    _documents(made, texts, cache)
    _, path = _documents(made, texts, cache)
    assert counted == [len(texts)] and path.is_file()  # the same settings: a hit
    change = {} if change == "texts" else change
    folder = tiny_dir
    if change.keys() & {"config", "tokenizer"}:  # the same weights
        folder = _edited(tiny_dir, tmp_path / "model", change.get("config"), change.get("tokenizer"))
    options = {k: v for k, v in change.items() if k in ("max_length", "pooling")}
    encoder = ElasticEncoder(str(folder), **{"pooling": "mean", **options}, device="cpu")
    texts = list(NUL_TWINS[1]) if not change else texts
    counted.clear()
    got, other = _documents(encoder, texts, cache)
    assert counted == [len(texts)] and other != path  # computed, not read back
    expected = encoder.pooled_states(texts, [2, 4])
    for n in (2, 4):
        np.testing.assert_allclose(got[n], expected[n], atol=1e-5)


def test_the_tokenizer_is_keyed_as_it_tokenizes_not_by_the_bytes_a_save_leaves(tiny_dir, tokenizer_twin, tmp_path):
    """A model saved again (heads fit, a student) writes tokenizer.json with the truncation of its last call: the
    same tokenizer, so the same key (the document cache serves every model of one backbone); another lower-casing
    is another key, in both caches' digests."""
    from matryoshka2d.retrieval.cascade import tokenizer_digest
    from matryoshka2d.training.targets import encoder_tokenizer_sha256

    original = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    original.tokenizer(["a red cat"] * 2, truncation=True, max_length=7, padding="max_length")
    original.tokenizer.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "tokenizer.json").read_bytes() != (tiny_dir / "tokenizer.json").read_bytes()
    shutil.copy(tiny_dir / "config.json", tmp_path / "saved")
    shutil.copy(tiny_dir / "model.safetensors", tmp_path / "saved")
    saved = ElasticEncoder(str(tmp_path / "saved"), pooling="mean", device="cpu")
    cased = tmp_path / "cased"
    shutil.copytree(tiny_dir, cased)
    shutil.copyfile(tokenizer_twin / "tokenizer_config.json", cased / "tokenizer_config.json")
    other = ElasticEncoder(str(cased), pooling="mean", device="cpu")
    for digest in (tokenizer_digest, encoder_tokenizer_sha256):
        assert digest(saved) == digest(original) != digest(other)


def test_a_document_cache_file_under_another_name_or_damaged_or_linked_out_is_a_miss(tiny_dir, tmp_path, counted):
    """The key is recorded in the file and compared on read: a file copied under another key's name is not read."""
    cache = tmp_path / "cache"
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    _, first = _documents(encoder, NUL_TWINS[0], cache)
    _, second = _documents(encoder, NUL_TWINS[1], cache)
    expected = _documents(encoder, NUL_TWINS[1], cache)[0]
    shutil.copyfile(first, second)  # the first texts' states under the second texts' name
    counted.clear()
    got, _ = _documents(encoder, NUL_TWINS[1], cache)
    assert counted == [2] and all(np.allclose(got[n], expected[n], atol=1e-6) for n in (2, 4))
    second.write_bytes(b"not a zip")  # damaged: recomputed, not a traceback
    counted.clear()
    _documents(encoder, NUL_TWINS[1], cache)
    assert counted == [2]
    outside = tmp_path / "outside.npz"
    shutil.copyfile(second, outside)
    kept = outside.read_bytes()
    second.unlink()
    second.symlink_to(outside)  # a link out of the cache: not read, replaced by a file, what it pointed at kept
    counted.clear()
    _documents(encoder, NUL_TWINS[1], cache)
    assert counted == [2] and not second.is_symlink() and outside.read_bytes() == kept


def test_a_document_cache_file_whose_rows_were_edited_is_a_miss(tiny_dir, tmp_path, counted):
    """Was: the file's key was compared, its states were not: another document's states written into a row (the
    key kept) were read as this one's. The signature over the key and every array is compared on each read."""
    cache = tmp_path / "cache"
    encoder = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    expected, path = _documents(encoder, NUL_TWINS[0], cache)
    for edit in ("a row", "no signature"):
        with np.load(path) as stored:
            arrays = dict(stored)
        if edit == "a row":
            arrays["layer2"][0] = arrays["layer2"][1]
        else:
            del arrays["signature"]
        np.savez(path, **arrays)
        counted.clear()
        got, again = _documents(encoder, NUL_TWINS[0], cache)
        assert counted == [2] and again == path, edit  # computed again, and the file replaced by a signed one
        assert all(np.allclose(got[n], expected[n], atol=1e-6) for n in (2, 4))


# ---- the ONNX graph cache -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph_cache(tiny_dir, tmp_path_factory):
    """The fp32 graph of layer 2 of the tiny model, built once by a real export."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from matryoshka2d.serve.backends import OnnxBackend

    root = tmp_path_factory.mktemp("graph-cache") / "graphs"
    OnnxBackend(ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu"), layers=[2], cache_folder=root)
    return root


@pytest.fixture
def exports(monkeypatch, graph_cache):
    """Counts the exports; an export copies the graph built once (the tests that count it need no real one)."""
    (source,) = graph_cache.glob("weights-*/layer-2.onnx")
    calls = []

    def export(encoder, layer, path):
        calls.append(layer)
        shutil.copyfile(source, path)
        return path

    monkeypatch.setattr("matryoshka2d.serve.graph_cache.export_exit", export)
    return calls


def _serve(encoder, root):
    from matryoshka2d.serve.backends import OnnxBackend

    lines = []
    return OnnxBackend(encoder, layers=[2], cache_folder=root, log=lines.append), lines


TEXTS = ["A Red Cat sleeps on the old mat", "the BLUE fish swims", "dog " * 40]


def test_a_graph_is_keyed_by_what_it_computes_and_one_under_another_key_is_rebuilt(
    tiny_dir, graph_cache, tmp_path, exports
):
    from matryoshka2d.files import file_sha256
    from matryoshka2d.serve.graph_cache import GraphCache, graph_key, weights_digest

    root = tmp_path / "graphs"
    shutil.copytree(graph_cache, root)
    (folder,) = root.glob("weights-*")
    mean = ElasticEncoder(str(tiny_dir), pooling="mean", device="cpu")
    cls = ElasticEncoder(str(tiny_dir), pooling="cls", device="cpu")
    source = weights_digest(mean)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["graphs"]["layer-2.onnx"]["cache_key"] == graph_key(source, "mean", 2, None)
    # pooling is in the graph: another pooling is another key (and another weights folder), never this graph
    assert graph_key(source, "cls", 2, None) != graph_key(source, "mean", 2, None)
    assert GraphCache(root, source, "mean").valid(2, None) is not None
    assert GraphCache(root, weights_digest(cls), "cls").valid(2, None) is None
    assert GraphCache(root, source, "cls").valid(2, None) is None  # the key, not only the folder, says so
    for entry in ({"cache_key": graph_key(source, "cls", 2, None)}, {"cache_key": None}):
        manifest["graphs"]["layer-2.onnx"] |= {**entry, "sha256": file_sha256(folder / "layer-2.onnx")}
        (folder / "manifest.json").write_text(json.dumps(manifest))
        exports.clear()
        backend, lines = _serve(mean, root)
        assert exports == [2] and any("building" in line for line in lines), lines
        np.testing.assert_allclose(backend.pooled(TEXTS, 2), mean.pooled_states(TEXTS, [2])[2], atol=1e-4)


@pytest.mark.parametrize("change", ["max_length", "tokenizer"])
def test_a_graph_serves_another_max_length_or_tokenizer_exactly_they_are_not_in_it(
    tiny_dir, tokenizer_twin, graph_cache, tmp_path, exports, change
):
    """The graph maps token ids to vectors; the backend tokenizes with the model's tokenizer and max length before
    it runs. So neither is in the graph's key, and the cached graph answers as torch does with either."""
    root = tmp_path / "graphs"
    shutil.copytree(graph_cache, root)
    if change == "tokenizer":
        folder = tmp_path / "cased"
        shutil.copytree(tiny_dir, folder)
        shutil.copyfile(tokenizer_twin / "tokenizer_config.json", folder / "tokenizer_config.json")
        encoder = ElasticEncoder(str(folder), pooling="mean", device="cpu")
        assert (
            encoder.tokenize(TEXTS[:1])["input_ids"].tolist()
            != ElasticEncoder(str(tiny_dir), pooling="mean").tokenize(TEXTS[:1])["input_ids"].tolist()
        )
    else:
        encoder = ElasticEncoder(str(tiny_dir), pooling="mean", max_length=8, device="cpu")
    backend, lines = _serve(encoder, root)
    assert exports == [] and not any("building" in line or "rebuilt" in line for line in lines), lines
    np.testing.assert_allclose(backend.pooled(TEXTS, 2), encoder.pooled_states(TEXTS, [2])[2], atol=1e-4)


def test_the_graph_cache_in_a_model_folder_read_by_the_command_is_allowed_but_the_folder_itself_is_not(
    tiny_dir, graph_cache, tmp_path, exports
):
    """onnx-serve/ is kept by design inside the model folder, an input of eval: its files may be written there
    (outputs.allow_folder); a cache folder that is itself an input is refused, nothing written."""
    from matryoshka2d.serve.graph_cache import CACHE_FOLDER

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    before = _files(model)
    encoder = ElasticEncoder(str(model), pooling="mean", device="cpu")
    from matryoshka2d.serve.backends import OnnxBackend

    with command_scope("--output", [("--model", model)]):
        backend = OnnxBackend(encoder, layers=[2], log=lambda _: None)
    assert backend.cache.root == model / CACHE_FOLDER and exports == [2]
    assert {k: v for k, v in _files(model).items() if k.parts[0] != CACHE_FOLDER} == before
    with command_scope("--output", [("--model", model)]), pytest.raises(OutputError, match="--onnx-cache"):
        OnnxBackend(encoder, layers=[2], cache_folder=model, log=lambda _: None)
    assert not list(model.glob("weights-*"))
