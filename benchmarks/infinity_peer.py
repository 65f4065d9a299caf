"""The infinity peer of benchmarks/serve_load.py: model folders it can load, and its server command.

infinity (`infinity-emb` 0.0.78) has no per-request layer, so each cell's depth n is given to it as a folder cut
to n layers, in the format its sentence-transformers 3 loads: `config.json` with num_hidden_layers = n,
`model.safetensors` without the layers from n on, the tokenizer files, and modules.json with Transformer,
mean Pooling and Normalize (the modules our minilm-l6 folder has). Its `--engine optimum` needs an ONNX file at
the folder's root, exported by optimum itself (`optimum-cli export onnx --library-name transformers`, so the
graph gives `last_hidden_state`, which is what infinity reads) and quantised by `optimum-cli onnxruntime
quantize` (dynamic int8) for the CPU's instruction set; infinity prefers the quantised file on a CPU. The
workarounds that infinity 0.0.78 with optimum 2.1 needs (start from inside the folder with `--model-id .`,
`--pooling-method mean`, one HF_HOME per folder) were found while setting the peer up; the code here is ours.

    python benchmarks/infinity_peer.py --venv VENV --layers 3 6 [--out DIR]

VENV: a virtual environment with `pip install torch==2.13.0 'infinity-emb[server,optimum]==0.0.78'` (its
infinity_emb and optimum-cli are run from VENV/bin).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

DEFAULT_OUT = Path(os.environ.get("MATRYOSHKA2D_CACHE") or Path.home() / ".cache" / "matryoshka2d") / "infinity-peer"
# The layer index in a BERT-family weight name ("encoder.layer.3.attention...").
LAYER_KEY = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
PEER_ENV = {
    "DO_NOT_TRACK": "1",
    "INFINITY_ANONYMOUS_USAGE_STATS": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def cut_folder(source: Path, layers: int, out: Path) -> Path:
    """A sentence-transformers 3 folder of the first `layers` layers of a BERT-family model folder."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise ValueError(f"{source} has {total} layers; cannot keep {layers}")
    weights = load_file(str(source / "model.safetensors"))
    found = {int(m.group(1)) for k in weights if (m := LAYER_KEY.search(k))}
    if found != set(range(total)):
        raise ValueError(f"{source}: layer weights found for {sorted(found)}, expected 0..{total - 1}")
    kept = {k: v.contiguous() for k, v in weights.items() if not (m := LAYER_KEY.search(k)) or int(m.group(1)) < layers}
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(kept, str(staging / "model.safetensors"), metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, staging / name)
    # The keys sentence-transformers 3 takes (a folder that sentence-transformers 6 wrote holds others, such as
    # transformer_task, which version 3 refuses), and a length: 256 tokens, minilm-l6's, when the folder gives none.
    sentence = source / "sentence_bert_config.json"
    settings = json.loads(sentence.read_text()) if sentence.is_file() else {}
    settings = {k: settings[k] for k in ("max_seq_length", "do_lower_case") if k in settings}
    (staging / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, **settings}))
    (staging / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": int(config["hidden_size"]), "pooling_mode_mean_tokens": True}
    pooling.update(dict.fromkeys(("pooling_mode_cls_token", "pooling_mode_max_tokens"), False))
    (staging / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (staging / "2_Normalize").mkdir()
    modules = [
        ("0", "", "Transformer"),
        ("1", "1_Pooling", "Pooling"),
        ("2", "2_Normalize", "Normalize"),
    ]
    (staging / "modules.json").write_text(
        json.dumps(
            [{"idx": int(i), "name": i, "path": p, "type": f"sentence_transformers.models.{t}"} for i, p, t in modules]
        )
    )
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def quantize_target() -> str:
    """optimum's dynamic-quantization preset for this CPU (the widest integer instructions it has)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    for preset, flag in (("avx512_vnni", "avx512_vnni"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if re.search(rf"\b{flag}\b", flags):
            return preset
    raise RuntimeError("no AVX2 on this CPU: optimum has no dynamic int8 preset for it")


def onnx_folder(cut: Path, out: Path, venv: Path) -> Path:
    """The cut folder plus model.onnx (optimum's export) and model_quantized.onnx (int8) at its root."""
    env = {**os.environ, **PEER_ENV}
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(cut, staging)
    export = staging.with_name(staging.name + ".export")
    quantized = staging.with_name(staging.name + ".quantized")
    try:
        cli = str(venv / "bin" / "optimum-cli")
        subprocess.run(
            [cli, "export", "onnx", "--model", str(cut), "--task", "feature-extraction", "--library-name",
             "transformers", str(export)],
            check=True, env=env,
        )  # fmt: skip
        shutil.move(export / "model.onnx", staging / "model.onnx")
        subprocess.run(
            [cli, "onnxruntime", "quantize", "--onnx_model", str(staging), f"--{quantize_target()}",
             "-o", str(quantized)],
            check=True, env=env,
        )  # fmt: skip
        shutil.move(quantized / "model_quantized.onnx", staging / "model_quantized.onnx")
    finally:
        shutil.rmtree(export, ignore_errors=True)
        shutil.rmtree(quantized, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def prepare(source: Path, layers: list[int], venv: Path, out: Path = DEFAULT_OUT) -> dict:
    """{n: (torch folder, optimum folder)} for each depth, made once (a folder already there is reused)."""
    folders = {}
    for n in layers:
        cut, onnx = out / f"L{n}", out / f"L{n}-onnx"
        if not (cut / "modules.json").is_file():
            cut_folder(source, n, cut)
        if not (onnx / "model_quantized.onnx").is_file():
            onnx_folder(cut, onnx, venv)
        folders[n] = (cut, onnx)
    return folders


def server_command(engine: str, folder: Path, port: int, venv: Path) -> tuple[list[str], Path, dict]:
    """(command, working folder, environment) of an infinity server for one folder, on 127.0.0.1 only."""
    infinity = str(venv / "bin" / "infinity_emb")
    # Each run gets a fresh HF_HOME: infinity caches an optimised graph there under the model id ("." for
    # every optimum folder), which would otherwise be taken for another folder's.
    home = folder.with_name(folder.name + ".hf_home")
    shutil.rmtree(home, ignore_errors=True)
    env = {**os.environ, **PEER_ENV, "HF_HOME": str(home)}
    common = ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench"]
    if engine == "torch":
        return [infinity, "v2", "--model-id", str(folder), "--engine", "torch", *common], folder.parent, env
    # optimum: from inside the folder with --model-id . (optimum-onnx 0.1.0 matches the file name only), mean
    # pooling said explicitly (its default is CLS), the quantised file (preferred on a CPU by default); its
    # graph optimisation fails with optimum 2.1 and falls back to the unoptimised graph, so it is skipped.
    command = [infinity, "v2", "--model-id", ".", "--engine", "optimum", "--pooling-method", "mean"]
    return [*command, "--onnx-disable-optimize", *common], folder, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 6])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--venv",
        type=Path,
        required=True,
        help="a virtual environment with infinity-emb[server,optimum] 0.0.78 (its bin/: infinity_emb, optimum-cli)",
    )
    args = parser.parse_args()
    from matryoshka2d.models.backbones import minilm_dir

    for n, (cut, onnx) in prepare(minilm_dir(), args.layers, args.venv, args.out).items():
        print(f"layer {n}: {cut} (torch engine), {onnx} (optimum engine)")


if __name__ == "__main__":
    main()
