"""Distilled exits (`matryoshka2d distill`): every exit, or one query encoder, learns to land on the full model's
own last-layer vectors, from unlabelled text.

A closed-form exit head (matryoshka2d.models.heads) is a linear student of the last layer with the backbone frozen.
Here the exit's layers learn too: the student starts as a copy of the teacher (heads fitted in closed form, or the
teacher's own), and every step pulls its vectors at the trained exits towards the teacher's unit vectors of the same
texts, which are computed once (matryoshka2d.training.targets). No labels, no negatives: the recipe of LEAF
(arXiv 2509.12539), whose students are trained on their teacher's vectors alone and inherit its Matryoshka widths.

Two shapes:
- mode "shared" (one 2D model): the loss sits on every exit 1..N-1 through its head and on the last layer, which
  is tied to the teacher by the same term so that it does not drift while the layers below it change. The result is
  an ordinary model folder with exit heads.
- mode "query" (a query encoder for an existing index): only the first n layers and the head of layer n learn; the
  folder is the student cut to n layers with its head as a Dense module. Its vectors live in the teacher's space, so
  documents indexed by the teacher stay valid; the folder records the teacher's weights checksum (`distill` in
  matryoshka2d.json), which search, eval retrieval and serve check where the two meet
  (models.query_record.check_query_encoder).

The loss, per trained layer, is matryoshka2d.training.teacher.distill_term ("cos" by default: 1 - cos on nested
prefixes of the widths the cells use, 64/128/256/384 for minilm-l6; "mse"; "relational"); layers are weighted
equally. `train --distill-from T --distill-weight W` adds the same term to any method (training.teacher).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from matryoshka2d.confined import ConfinedFolder
from matryoshka2d.files import DataFormatError
from matryoshka2d.models.identity import backbone_sha256, weights_sha256
from matryoshka2d.models.query_record import QUERY_MODES
from matryoshka2d.training import preflight
from matryoshka2d.training.config import eval_cells
from matryoshka2d.training.data import TrainingData
from matryoshka2d.training.distill_options import check_eval_cells
from matryoshka2d.training.distill_recipe import PASSAGE_TOKENS, RECIPE_CHOICES, recipe
from matryoshka2d.training.packing import encode_columns, tokenize_columns
from matryoshka2d.training.rundir import RunDir
from matryoshka2d.training.targets import TargetsKey, TeacherTargets
from matryoshka2d.training.teacher import LOSSES, TEMPERATURE, default_widths, distill_term
from matryoshka2d.training.texts import read_texts
from matryoshka2d.training.throughput import autocast
from matryoshka2d.training.trainer import Trainer

MODES = ("shared", "query", "static")
RECORD_KEY = "distill"  # in matryoshka2d.json
CLOSED_FORM = "closed-form"  # --mode static: the model with the cell's closed-form start, inside the run folder


class DistillError(ValueError):
    """A distillation that cannot run as asked; the message names the option or file."""


# ---- the objective ----------------------------------------------------------------------------------------


_TRAINS = {"shared": "every exit", "static": "the static cell, layer 0"}


class DistillObjective(nn.Module):
    """Which layers learn and how their vectors are compared with the teacher's; no parameters of its own."""

    name = "distill"

    def __init__(
        self,
        num_layers: int,
        width: int,
        mode: str = "shared",
        layer: int | None = None,
        loss: str = "cos",
        widths: Iterable[int] | None = None,
        temperature: float = TEMPERATURE,
    ):
        super().__init__()
        if mode not in MODES:
            raise DistillError(f"--mode {mode}: choose one of {', '.join(MODES)}")
        if loss not in LOSSES:
            raise DistillError(f"--loss {loss}: choose one of {', '.join(LOSSES)}")
        if num_layers < 2 and mode != "static":
            raise DistillError(f"the teacher has {num_layers} layer: there is no exit below its last layer to distill")
        if mode == "query":
            if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer < num_layers:
                raise DistillError(
                    f"--mode query --layer {layer}: the query encoder keeps the teacher's first n layers, "
                    f"n in 1..{num_layers - 1} (the teacher has {num_layers})"
                )
        elif layer is not None:
            raise DistillError(f"--layer is for --mode query (--mode {mode} trains {_TRAINS[mode]})")
        widths = sorted({int(w) for w in widths}) if widths else default_widths(width)
        if bad := [w for w in widths if not 1 <= w <= width]:
            raise DistillError(f"--widths {bad}: the model's vectors have {width} numbers")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise DistillError(f"--temperature must be a number above 0, got {temperature!r}")
        self.mode, self.layer, self.loss_name = mode, 0 if mode == "static" else layer, loss
        self.widths_list, self.temperature = widths, float(temperature)
        self.layers = [layer] if mode == "query" else [0] if mode == "static" else list(range(1, num_layers + 1))
        self.keep_layers = layer if mode == "query" else None  # the trainer saves a query encoder cut to n layers

    def loss(self, vectors: dict[int, torch.Tensor], targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The mean over the trained layers of each layer's term (itself the mean over the widths)."""
        parts, total = {}, None
        for n in self.layers:
            term = distill_term(vectors[n].float(), targets, self.widths_list, self.loss_name, self.temperature)
            parts[f"layer{n}"] = term.detach()
            total = term if total is None else total + term
        return total / len(self.layers), parts

    def widths(self) -> set[int]:
        return set(self.widths_list)

    def config(self) -> dict:
        return {
            "method": self.name,
            "mode": self.mode,
            "layer": self.layer,
            "loss": self.loss_name,
            "widths": self.widths_list,
            "temperature": self.temperature,
            "trained_layers": self.layers,
        }


# ---- the run: the Trainer's loop, checkpoints and exact resume, with the teacher's targets ---------------------


class DistillTrainer(Trainer):
    """A Trainer whose data are texts and whose step compares the student's exits with the cached teacher targets.
    `config.model` is the teacher (the student starts as its copy), `config.loss` the distillation loss and
    `config.method_options` the mode, layer, widths and temperature."""

    supports_processes = False  # one process: the targets are indexed by the step's rows, not gathered
    # teacher -> engine(texts, chunk) for the targets' encoder pass elsewhere (the CLI's --engine ray); None: here
    targets_engine = None

    def build_method(self) -> DistillObjective:
        cfg = self.config
        if cfg.gradient_accumulation != 1:
            raise DistillError("distill: --gradient-accumulation is not supported; lower --batch-size for memory")
        options = dict(cfg.method_options)
        self.max_texts = options.pop("max_texts", None)  # read_data keeps the first N distinct texts
        if self.max_texts is not None and (
            isinstance(self.max_texts, bool) or not isinstance(self.max_texts, int) or self.max_texts < 1
        ):
            raise DistillError(f"--max-texts must be a whole number of at least 1, got {self.max_texts!r}")
        self.recipe_for = tuple(options.pop("recipe_for", ()))  # options the CLI was not given: the recipe's
        if bad := [name for name in self.recipe_for if name not in RECIPE_CHOICES]:
            raise DistillError(f"recipe_for {bad}: the recipe chooses {', '.join(RECIPE_CHOICES)} only")
        self.passage_tokens = options.pop("passage_tokens", None)
        if options.get("mode") in QUERY_MODES and "passage_tokens" in self.recipe_for:
            self.passage_tokens = PASSAGE_TOKENS  # both answer queries against an index of the teacher's documents
        trained = _folder_record(self.encoder).get("trained_widths")
        if "widths" not in options:  # a query encoder (or layer 0) serves an index of the teacher's full vectors
            width = self.encoder.hidden_size
            query = options.get("mode") in QUERY_MODES
            options["widths"] = [width] if query else default_widths(width, trained)
        objective = DistillObjective(self.encoder.num_layers, self.encoder.hidden_size, loss=cfg.loss, **options)
        check_eval_cells(objective.mode, objective.layer, eval_cells(cfg))  # cells of what the run makes
        self.heads_given = cfg.exit_heads  # read_data chooses keep or fit where it is None
        if objective.mode == "query":  # only the head that the query encoder keeps
            self.head_layers = [objective.layer]
        return objective

    def build_task_loss(self) -> nn.Module:
        return nn.Module()  # the objective holds the only term

    def read_data(self, first_read=None) -> TrainingData:
        """The distinct texts of --data (BEIR documents as passages of at most max_length tokens), STS test
        sentences left out unless the run says otherwise; the teacher's identity is taken here, before any
        weight changes."""
        from matryoshka2d.evaluate.sts import LeftOutSentences, sts_test_sentence_keys
        from matryoshka2d.paths import data_dir

        cfg, encoder = self.config, self.encoder
        texts: Iterable[str] = read_texts(cfg.data, encoder.tokenizer, self.passage_tokens or encoder.max_length)
        self.left_out = None
        if cfg.exclude_sts_test:
            try:
                self.left_out = LeftOutSentences(sts_test_sentence_keys(data_dir(cfg.sts_data_dir)))
            except (FileNotFoundError, DataFormatError) as exc:
                raise FileNotFoundError(
                    f"distill leaves STS test sentences out by default, but cannot read the STS test sets ({exc}); "
                    "set MATRYOSHKA2D_DATA, or pass --no-exclude-sts-test"
                ) from None
            texts = self.left_out.filter(texts)
        texts = list(itertools.islice(texts, self.max_texts))
        if not texts and self.left_out is not None and self.left_out.count:
            raise DistillError(
                f"--data {' '.join(cfg.data)}: no texts to distill on: all {self.left_out.count} of its texts are "
                "sentences of the STS test sets, which distill leaves out by default; pass --no-exclude-sts-test "
                "to keep them (the STS test scores are then of sentences the student saw)"
            )
        if not texts:
            raise DistillError(f"--data {' '.join(cfg.data)}: no texts to distill on (the files hold no text)")
        if self.left_out is not None and self.processes.main:
            print(f"distill: {len(texts)} distinct texts; {self.left_out.count} STS test sentences left out")
        chosen, self.recipe_line = recipe(
            self.method.mode,
            encoder.num_layers,
            encoder.hidden_size,
            len(texts),
            cfg.batch_size,
            self.recipe_for,
            self.method.widths_list,
        )
        cfg.lr, cfg.epochs = chosen.get("lr", cfg.lr), chosen.get("epochs", cfg.epochs)
        cfg.weight_decay = chosen.get("weight_decay", cfg.weight_decay)
        if self.recipe_line and self.processes.main:
            print(self.recipe_line)
        self.teacher_sha = weights_sha256(encoder)
        self.teacher_backbone = backbone_sha256(encoder)
        self.targets_key = TargetsKey.of(encoder)  # its tokenizer, max length and pooling: the targets' cache key
        if self.method.mode == "static":
            self.prepare_static_cell(texts)
        elif cfg.exit_heads is None:  # the teacher's own heads where it has heads the student can keep, else a fit
            own = encoder.exit_heads
            usable = own is not None and (
                self.method.mode == "shared" or (own.has(self.method.layer) and own.inputs == "exit")
            )
            cfg.exit_heads = "keep" if usable else "fit"
        return TrainingData("sentences", [texts], None, [str(d) for d in cfg.data])

    def prepare_static_cell(self, texts: list[str]) -> None:
        """--mode static: the teacher's model2vec table with an identity head put on as layer 0 (the head is fitted
        in closed form once the targets exist: prepare_run); only the cell learns, the transformer and any exit
        heads stay the teacher's. A resumed run makes the same table again and reads its weights back. A table that
        gives the texts one vector (models.static.check_texts_told_apart) is refused here, before any work."""
        cfg, encoder = self.config, self.encoder
        if cfg.exit_heads is not None:
            raise DistillError("--exit-heads is for --mode shared and query (--mode static keeps the teacher's heads)")
        from matryoshka2d.models.static import check_texts_told_apart, distill_table

        for p in encoder.parameters():
            p.requires_grad_(False)
        # the teacher's own exit heads are kept as they are (exit_heads.prepare would drop heads of a changing
        # backbone; this one does not change)
        cfg.exit_heads = "keep" if encoder.exit_heads is not None else None
        cell = distill_table(encoder, log=print if self.processes.main else None)
        check_texts_told_apart(cell, texts, f"--teacher {cfg.model}")
        encoder.set_static_cell(cell)
        for p in encoder.static_cell.parameters():
            p.requires_grad_(True)

    def prepare_run(self, resume: bool, overwrite: bool, allow_pickle: bool) -> None:
        """The Trainer's preparation, then the teacher's targets: computed on a new run (the student is still the
        teacher then), checked and read back on a resumed one. A new run into a folder that already holds targets
        (a run stopped before its first checkpoint, or a user trying another recipe on the same texts) reads them
        back too when every check holds, instead of spending the teacher's pass again (25 minutes on the 78,091
        SciFact and NLI texts here), and refuses them by name when one fails; only --overwrite recomputes them."""
        super().prepare_run(resume, overwrite, allow_pickle)
        targets, texts = TeacherTargets(self.out), self.data.columns[0]
        if overwrite:
            targets.remove()  # a link in its place (to another run's targets) is refused, never followed
        if self.step == 0 and not targets.exists():
            engine = self.targets_engine(self.config.model) if self.targets_engine is not None else None
            self.targets = targets.compute(
                self.encoder,
                texts,
                self.teacher_sha,
                log=print,
                progress=self.progress,
                engine=engine,
                settings=self.targets_key,
            )
        else:  # refused, naming what differs, unless made from these texts by this teacher with these settings
            self.targets = targets.load(texts, self.teacher_sha, self.encoder.hidden_size, self.targets_key)
            if not resume:
                print(
                    f"teacher targets: read back from {targets.vectors_path} (the same texts, teacher, tokenizer, "
                    "max length and pooling)"
                )
        self.targets_record = targets.record
        if self.method.mode == "static" and self.step == 0:  # the closed-form head (a resumed run has its own)
            from matryoshka2d.models.static import fit_head

            report = fit_head(self.encoder.static_cell, texts, self.targets)
            print(
                f"static cell: head fitted in closed form on {report['head_texts']} texts in {report['head_seconds']} s"
            )
            self.save_closed_form()

    def save_closed_form(self) -> Path:
        """--mode static: the model with its closed-form cell, before any step, in OUTPUT/closed-form (a query
        encoder for the same index as the trained one): what training adds is measured against it."""
        from matryoshka2d.training.checkpoints import save_model_atomically

        metadata = {**self.extra_metadata(), "stage": "the closed-form start of the static cell, before training"}
        out = save_model_atomically(lambda folder: self.encoder.save(folder, metadata=metadata), self.out / CLOSED_FORM)
        self.complete_saved(out)  # a query encoder of the teacher's index as the trained one is: its own checksum
        print(f"static cell: the closed-form start saved to {out}")
        return out

    def run(self, resume=False, progress=True, overwrite=False, allow_pickle=False) -> Path:
        self.progress = progress
        return super().run(resume=resume, progress=progress, overwrite=overwrite, allow_pickle=allow_pickle)

    def save_model(self, seconds: float, steps_run: int) -> Path:
        self.targets.check_intact()  # the targets the run read are still those it checked, else no model is saved
        return super().save_model(seconds, steps_run)

    def prepare_batch(self, step: int):
        rows = self.batch_indices(step)
        texts = [self.data.columns[0][i] for i in rows]
        enc = self.encoder
        if self.method.mode == "static":  # the cell's own tokens (models.static)
            targets = torch.from_numpy(np.asarray(self.targets[rows], dtype=np.float32))
            return [(enc.static_cell.embedding.preprocess(texts), targets, len(rows))]
        batch = tokenize_columns(self._tokenizer, [texts], enc.max_length, enc._input_names, self._overhead, self._pin)
        targets = torch.from_numpy(np.asarray(self.targets[rows], dtype=np.float32))
        return [(batch, targets, len(rows))]

    def compute_loss(self, step: int, micro_batch=None):
        torch.manual_seed(self.config.seed * 1_000_003 + step)  # dropout, as the Trainer seeds it
        batch, targets, _ = micro_batch if micro_batch is not None else self.prepare_batch(step)[0]
        with autocast(self.precision, self.encoder.device):
            if self.method.mode == "static":
                cell = self.encoder.static_cell
                vectors = {0: cell({k: v.to(self.encoder.device) for k, v in batch.items()})}
            else:
                vectors = encode_columns(self.encoder, batch, self.method.layers)[0]
        return self.method.loss(vectors, targets.to(self.encoder.device))

    def evaluate(self) -> list[dict]:
        """--mode static: STS-B dev at the static cell (0, full width), what trains (--eval-cell is refused)."""
        if self.method.mode != "static":
            return super().evaluate()
        from matryoshka2d.evaluate.sts import sts_dev_score

        path, width = self.eval_path(), self.encoder.hidden_size
        score = sts_dev_score(self.encoder, path, 0, width)
        return [{"step": self.step, "eval": f"{Path(path).name}@(0,{width})", "spearman": round(score, 2)}]

    def cut_options(self) -> str:
        """The options that make the run save a query encoder cut to --layer n, for the preflight's message."""
        cfg, heads = self.config, self.heads_given
        start = f"--exit-heads {heads}" if heads else f"--exit-heads {cfg.exit_heads} (the default here)"
        inputs = f" --exit-heads-inputs {cfg.exit_heads_inputs}" if cfg.exit_heads_inputs else ""
        return f"--mode query --layer {self.method.layer} with {start}{inputs}"

    def one_row_terms(self) -> list[preflight.Term]:
        """The objective's term on one row of student vectors against a teacher target (training.preflight)."""
        objective, width = self.method, self.encoder.hidden_size
        target = nn.functional.normalize(torch.ones(1, width, device=self.encoder.device), dim=-1)

        def term(vectors: list[torch.Tensor], _row: int) -> torch.Tensor:
            return objective.loss({n: vectors[0] for n in objective.layers}, target)[0]

        return [preflight.Term(f"--loss {objective.loss_name}", 1, width, term)]

    def extra_metadata(self) -> dict:
        targets = getattr(self, "targets_record", None) or {}  # the record load checked (none before prepare_run)
        return {
            RECORD_KEY: {
                "mode": self.method.mode,
                "layer": self.method.layer,
                "teacher": targets.get("teacher") or self.config.model,
                "teacher_weights_sha256": self.teacher_sha,
                "teacher_backbone_sha256": self.teacher_backbone,
                "teacher_pooling": self.encoder.pooling,
                "teacher_layers": self.encoder.num_layers,
                "loss": self.method.loss_name,
                "widths": self.method.widths_list,
                "texts": len(self.data),
                "recipe": self.recipe_line or None,
                "passage_tokens": self.passage_tokens or self.encoder.max_length,
                "targets_sha256": targets.get("sha256"),
                "targets_seconds": targets.get("seconds"),
                "sts_test_sentences_left_out": self.left_out.count if self.left_out is not None else None,
                "data": [str(Path(d).resolve()) for d in self.config.data],
            }
        }

    def complete_saved(self, folder: Path) -> None:
        """A query encoder's record gets the checksum of its own weights and the width of its vectors, read from the
        folder as saved (cut to n layers, its head a Dense module): what every command that loads it checks
        (models.query_record.check_own_weights), so that other weights under this record, or the record under other
        weights, are refused."""
        if self.method.mode not in QUERY_MODES:  # both answer queries against the teacher's documents
            return
        from matryoshka2d.models.encoder import ElasticEncoder
        from matryoshka2d.models.query_record import record_own_identity

        record_own_identity(folder, ElasticEncoder(str(folder), device="cpu"))


def _folder_record(encoder) -> dict:
    """The teacher folder's matryoshka2d.json, or {} (a short name, a folder without one, or one whose record is a
    link out of the folder: read only inside it, confined.ConfinedFolder)."""
    if not encoder.location or not (Path(encoder.location) / "matryoshka2d.json").is_file():
        return {}
    try:
        record = ConfinedFolder(encoder.location, "model", check=False).read_json("matryoshka2d.json")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def distill(
    config,
    resume: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    allow_pickle: bool = False,
    targets_engine=None,
):
    """Train the student of `config` (a TrainConfig with method "distill"); returns the saved folder.
    `targets_engine`: teacher name -> engine(texts, chunk) computing the targets elsewhere (Ray)."""
    # a taken --output, or one overlapping an input, is refused before the teacher loads
    RunDir(config.output).check(resume, overwrite, config.inputs())
    trainer = DistillTrainer(config)
    trainer.targets_engine = targets_engine
    return trainer.run(resume=resume, progress=progress, overwrite=overwrite, allow_pickle=allow_pickle)
