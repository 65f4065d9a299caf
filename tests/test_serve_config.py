"""What a server is asked to be (serve/config.py ServerConfig, and `serve`'s arguments parsed into one): every
value checked once, where it is made, with a message naming the option a user types; what needs the model checked
when it loads, before anything is built or listened on. No request is served here."""

import pytest

from helpers.cli import error_line, exit_code
from helpers.server import FakeBackend, app_of
from matryoshka2d.cells import Cell
from matryoshka2d.cli import build_parser, main
from matryoshka2d.serve import ServerConfig
from matryoshka2d.serve.admission import DEFAULT_DEADLINE_MS
from matryoshka2d.serve.batching import DEFAULT_TARGET_MS


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_batch": 0}, "--max-batch 0: must be at least 1"),
        ({"max_queued_texts": -3}, "--max-queued-texts -3: must be at least 1"),
        ({"workers": 0}, "--workers 0: must be at least 1"),
        ({"port": 70000}, "--port 70000: must be 0..65535"),
        ({"max_length": 2}, "--max-length 2: must be at least 3"),
        ({"default_dimensions": 1.5}, "--default-dimensions 1.5: not a whole number"),
        ({"max_wait_ms": float("nan")}, "--max-wait-ms nan: must be a finite number"),
        ({"max_queue_ms": 0.0}, "--max-queue-ms 0.0: must be a positive finite number"),
        ({"drain_seconds": -1.0}, "--drain-seconds -1.0: must be a positive finite number"),
        ({"backend": "tpu"}, "--backend tpu: choose one of torch, onnx"),
        ({"quantize": "int8"}, "--quantize apply to --backend onnx"),
        ({"onnx_cache": "graphs"}, "--onnx-cache apply to --backend onnx"),
        ({"backend": "onnx", "device": "cuda"}, "--backend onnx runs on the CPU"),
        ({"layers": []}, "--layers is empty"),
        ({"layers": [2, -1]}, "--layers: -1 is not a layer"),
        ({"layers": [2, 4], "default_layer": 3}, "--default-layer 3: this server runs layers 2, 4"),
        ({"query_cell": Cell(2, 16), "default_dimensions": 24}, "--default-dimensions 24: queries and documents"),
        ({"min_layer": 2}, "--min-layer set how --adaptive-depth sheds depth; add --adaptive-depth"),
        ({"target_ms": 0.0}, "--target-ms 0.0: must be a positive finite number"),
        ({"log_level": "loud"}, "--log-level loud: choose one of"),
        ({"api_key": " k3y"}, "--api-key: the API key has whitespace around it"),
        ({"query_models": {"q": ""}}, "--query-model q=: give a name and a folder"),
    ],
)
def test_a_config_is_checked_once_when_made_naming_the_option(fields, message):
    with pytest.raises(ValueError) as refused:
        ServerConfig(**fields)
    assert message in str(refused.value)


def test_the_latency_objective_and_the_deadline_are_the_servers_own_settings(tokenizer):
    """--target-ms is the server's latency objective (its calls, and the ladder when on), no longer adaptive
    depth's alone; --max-queue-ms, the deadline, has a default: both reach the batchers and the admission."""
    assert (ServerConfig().target_ms, ServerConfig().max_queue_ms) == (DEFAULT_TARGET_MS, DEFAULT_DEADLINE_MS)
    args = build_parser().parse_args(["serve", "--model", "m", "--target-ms", "40", "--max-queue-ms", "700"])
    assert (args.target_ms, args.max_queue_ms, args.adaptive_depth) == (40.0, 700.0, False)
    engine = app_of(FakeBackend(tokenizer), target_ms=40.0, max_queue_ms=700.0).state.engine
    assert engine.main.batcher.target_ms == 40.0 and engine.admission.max_queue_ms == 700.0


def test_the_key_is_read_from_the_environment_as_the_command_does_and_kept_out_of_the_repr(monkeypatch):
    monkeypatch.setenv("MATRYOSHKA2D_API_KEY", "k3y-from-env")
    config = ServerConfig()
    assert config.api_key == "k3y-from-env" and "k3y" not in repr(config)
    monkeypatch.setenv("MATRYOSHKA2D_API_KEY", "")
    with pytest.raises(ValueError, match="MATRYOSHKA2D_API_KEY: the API key is empty"):
        ServerConfig()


def test_a_config_reads_back_from_its_json_as_a_worker_gets_it():
    config = ServerConfig(model="m", layers=[4, 2, 2], query_cell=Cell(2, 16), query_models={"q": "runs/q"})
    again = ServerConfig.from_json(config.to_json())
    assert again == config and again.layers == [2, 4] and again.query_cell == Cell(2, 16)


def test_serve_parses_its_command_line_into_the_config_with_the_same_defaults():
    from matryoshka2d.cli.serve import config_of

    args = build_parser().parse_args(["serve", "--model", "runs/st-ese", "--layers", "2-4", "--query-cell", "3x16"])
    config = config_of(args)
    assert config == ServerConfig(model="runs/st-ese", layers=[2, 3, 4], query_cell=Cell(3, 16))
    assert config.name == "st-ese" and config.layers == [2, 3, 4]
    args = build_parser().parse_args(["serve", "--query-model", "q=runs/q", "--query-model", "runs/static"])
    assert config_of(args).query_models == {"q": "runs/q", "static": "runs/static"}


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-batch", "0", "must be at least 1, got 0"),
        ("--max-queued-texts", "-3", "must be at least 1, got -3"),
        ("--max-wait-ms", "nan", "must be a finite number, got 'nan'"),  # started the server before
        ("--max-wait-ms", "-1", "must be at least 0, got -1"),
        ("--port", "99999", "must be 0..65535 (0: any free port), got 99999"),
        ("--default-dimensions", "1e3", "'1e3' is not a whole number"),
        ("--min-layer", "-1", "must be at least 0, got -1"),
        ("--layers", "1,x", "'x' is not a whole number or a range like 1-6"),  # as `eval --layers` reads it
        ("--layers", "4-2", "'4-2' is a reversed range"),
        ("--layers", "", "'' holds an empty item"),
        ("--query-cell", "3by16", "'3by16' is not a cell"),
    ],
)
def test_serve_refuses_bad_limits_where_they_are_parsed(option, value, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--model", "minilm-l6", option, value])
    assert stopped.value.code == 2
    assert f"argument {option}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quantize", "int8"], "--quantize apply to --backend onnx"),
        (["--onnx-cache", "graphs"], "--onnx-cache apply to --backend onnx"),
        (["--backend", "onnx", "--device", "cuda"], "--backend onnx runs on the CPU"),
    ],
)
def test_serve_refuses_backend_flags_that_do_not_fit(capsys, flags, message):
    assert main(["serve", "--model", "minilm-l6", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_serve_refuses_layers_the_model_does_not_have(capsys, tiny_dir, backend, monkeypatch):
    from matryoshka2d.serve import backends

    monkeypatch.setattr(backends, "build_graph", lambda *a, **k: pytest.fail("a graph was built"))
    command = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--backend", backend, "--port", "0"]
    assert main([*command, "--layers", "2,5"]) == 2
    assert "--layers: 5 is out of range" in capsys.readouterr().err
    assert main([*command, "--layers", "0,2"]) == 2  # layer 0 is a model's static cell: this one has none
    assert "--layers 0: " in capsys.readouterr().err


def test_serve_refuses_a_default_cell_out_of_range(capsys, tiny_dir):
    command = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--device", "cpu", "--port", "0"]
    assert main([*command, "--default-layer", "5"]) == 2
    assert "--default-layer 5: layer 5 is out of range" in capsys.readouterr().err
    assert main([*command, "--default-dimensions", "64"]) == 2
    assert "--default-dimensions 64: dim 64 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("k3y-for-guards\n", "whitespace around it"),
        ("  k3y-for-guards", "whitespace around it"),
        ("", "is empty"),
        ("k3y\x1bx", "U+001B at character 3"),
        ("k\u00e9y-for-guards", "U+00E9 at character 1"),
    ],
)
def test_an_api_key_no_client_can_send_is_refused_at_start_naming_where_it_came_from(
    tiny_dir, key, why, monkeypatch, capsys
):
    from matryoshka2d.serve import loading

    monkeypatch.setattr(loading, "load_models", lambda *a, **kw: pytest.fail("the model was loaded"))
    command = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0"]
    assert main([*command, "--api-key", key]) == 2
    err = capsys.readouterr().err
    assert "matryoshka2d serve: error: --api-key: the API key" in err and why in err and err.count("\n") == 1
    assert not key.strip() or key.strip() not in err  # the key itself is never printed
    monkeypatch.setenv("MATRYOSHKA2D_API_KEY", key)
    assert main(command) == 2
    assert "MATRYOSHKA2D_API_KEY: the API key" in capsys.readouterr().err


def test_a_default_width_the_pair_cannot_give_is_refused_before_the_model_loads(tiny_dir, monkeypatch, capsys):
    from matryoshka2d.serve import loading

    monkeypatch.setattr(loading, "load_encoder", lambda *a, **kw: pytest.fail("the model was loaded"))
    command = ["serve", "--model", str(tiny_dir), "--port", "0", "--query-cell", "2x16", "--default-dimensions", "24"]
    assert main(command) == 2
    assert "--default-dimensions 24: queries and documents of this pair have 16 numbers" in capsys.readouterr().err


def test_a_query_model_named_twice_is_refused_before_the_model_loads(tiny_dir, tmp_path, monkeypatch, capsys):
    from matryoshka2d.serve import loading

    monkeypatch.setattr(loading, "load_encoder", lambda *a, **kw: pytest.fail("the model was loaded"))
    (tmp_path / "a" / "q").mkdir(parents=True)
    (tmp_path / "b" / "q").mkdir(parents=True)
    command = ["serve", "--model", str(tiny_dir), "--port", "0", "--query-model", str(tmp_path / "a" / "q")]
    assert exit_code([*command, "--query-model", str(tmp_path / "b" / "q")]) == 2
    assert "the name 'q' is taken; give another as NAME=FOLDER" in capsys.readouterr().err


def test_serve_checks_its_address_before_loading_the_model(tmp_path, capsys):
    import socket

    missing = str(tmp_path / "no-model")  # never loaded: the address is checked first
    for bad in ("70000", "-1"):
        with pytest.raises(SystemExit) as stopped:  # the range at parse time (rule 4)
            main(["serve", "--model", missing, "--port", bad])
        assert stopped.value.code == 2
        error_line(capsys, "argument --port: must be 0..65535", f"got {bad}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", missing, "--host", "127.0.0.1", "--port", str(port)]) == 2
        error_line(capsys, f"--port {port}: cannot listen there")


def test_serve_refuses_an_empty_layers_list_where_it_is_parsed(tiny_dir, capsys):
    """`--layers ""` (and `" "`) read as no layer at all; it is refused by the parser, for both backends (the
    library's ServerConfig(layers=[]) says '--layers is empty', above)."""
    for backend in ("onnx", "torch"):
        for empty in ("", " "):
            args = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--backend", backend, "--layers", empty]
            assert exit_code(args) == 2
            error_line(capsys, "argument --layers:", "holds an empty item")


def test_an_onnx_cache_that_is_a_file_is_refused_before_the_model_loads(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("matryoshka2d.serve.loading.load_encoder", lambda *a, **k: pytest.fail("the model was loaded"))
    file = tmp_path / "cache"
    file.write_text("not a folder")
    for cache in (file, file / "graphs"):
        assert main(["serve", "--model", str(tiny_dir), "--backend", "onnx", "--onnx-cache", str(cache)]) == 2
        assert f"--onnx-cache {cache}: {file} is a file, not a folder" in capsys.readouterr().err
