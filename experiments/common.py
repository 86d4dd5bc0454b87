"""What every study shares: the command-line preamble (validated arguments, presets
in `--help`, Ctrl-C), the copy-task presets and the models other studies analyse,
output (atomic JSON, figures, damaged-file messages), progress bars, timing and FLOP
counts. No study imports another; they all import this.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jax_mha.lab import distributed
from jax_mha.lab.checkpoint import load_checkpoint, save_checkpoint, saved_train_step, write_atomic
from jax_mha.lab.data import CopyTaskConfig, Task, task_from_dict, task_to_dict
from jax_mha.lab.host_memory import reuse_freed_memory
from jax_mha.lab.models import ModelConfig, model_to_dict
from jax_mha.lab.text import TextTaskConfig
from jax_mha.lab.train import TrainConfig, train_seeds

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# Whether `start_study` made glibc reuse freed memory in this process: None until a
# study's main() calls it (importing this module changes nothing process-wide).
HOST_MEMORY_REUSED: bool | None = None

# The optional packages a study may need, and the extra of pyproject.toml that installs each.
EXTRAS = {"tqdm": "studies", "matplotlib": "studies", "tensorboardX": "tensorboard"}


def missing_extra_message(modules: Sequence[str]) -> str | None:
    """The one line naming what to install when any of `modules` cannot be imported, else None."""
    missing = [m for m in modules if not _importable(m)]
    if not missing:
        return None
    extras = sorted({EXTRAS.get(m, "studies") for m in missing})
    install = " ".join(f'pip install -e ".[{e}]"' for e in extras)
    return f"error: this needs {', '.join(missing)}, which is not installed; install it with: {install}"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None  # None also where sys.modules[module] is None
    except (ImportError, ValueError):
        return False


def require(module: str) -> Any:
    """`importlib.import_module(module)`, or SystemExit with one line naming the extra."""
    problem = missing_extra_message([module.split(".")[0]])
    if problem is not None:
        raise SystemExit(problem)
    try:
        return importlib.import_module(module)
    except ImportError as e:  # installed but broken
        raise SystemExit(f"error: importing {module} failed ({e}); reinstall it: "
                         f'pip install -e ".[{EXTRAS.get(module.split(".")[0], "studies")}]"') from None


def start_study(needs: Sequence[str] = ("tqdm", "matplotlib")) -> bool:
    """What every study's main() does first: checks that the optional packages it
    `needs` are installed (SystemExit with one line naming the extra otherwise), then,
    before any JAX computation, makes glibc keep and reuse freed memory: XLA:CPU's
    per-call temporaries otherwise page-fault in anew on every call
    (jax_mha.lab.host_memory; ~10% of a copy-task training step).

    Returns whether the allocator setting took effect (recorded by `run_metadata`);
    in a process where JAX has already computed, e.g. a test calling main(), it is
    False and the allocator is left alone. Later calls return the first answer.
    """
    global HOST_MEMORY_REUSED
    problem = missing_extra_message(needs)
    if problem is not None:
        raise SystemExit(problem)
    if HOST_MEMORY_REUSED is None:
        with warnings.catch_warnings():  # once JAX has started it changes nothing and warns; the record says False
            warnings.simplefilter("ignore", RuntimeWarning)
            HOST_MEMORY_REUSED = reuse_freed_memory()
    return HOST_MEMORY_REUSED


# ----------------------------------------------------------------- Ctrl-C


class Interrupted(Exception):
    """Raised by a study on Ctrl-C, saying what is saved (`cli` prints it)."""

    def __init__(self, saved: str, resumes: bool = True):
        super().__init__(saved)
        self.saved, self.resumes = saved, resumes


def resume_command(module: str, argv: Sequence[str]) -> str:
    """The command that continues a run: the same arguments, without `--force`
    (which would throw the saved work away)."""
    return shlex.join(["python", "-m", module, *(a for a in argv if a != "--force")])


def _exit_interrupted(module: str, argv: Sequence[str], saved: str, resumes: bool) -> None:
    """Prints the one line and leaves at once: tearing down with XLA threads still
    running can crash the interpreter, so no cleanup beyond flushing."""
    verb = "resume with" if resumes else "run again with"
    print(f"\ninterrupted: {saved}; {verb}: {resume_command(module, argv)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_INTERRUPTED)


def cli(main: Callable[[list[str]], Any], module: str, argv: Sequence[str] | None = None) -> None:
    """Runs a study's `main(argv)` as a command: Ctrl-C prints one line (what is
    saved and the command that resumes) and exits 130, with no traceback; a second
    Ctrl-C while the first is still unwinding (e.g. inside a long compilation) leaves
    at once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pressed = []

    def on_sigint(signum, frame):
        if pressed:
            _exit_interrupted(module, argv, "stopped while unwinding; what was saved before stays", True)
        pressed.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        main(argv)
    except Interrupted as e:
        _exit_interrupted(module, argv, e.saved, e.resumes)
    except KeyboardInterrupt:
        _exit_interrupted(module, argv, "nothing new was saved", True)


# ----------------------------------------------------------------- argument types


def _number(kind: type, low: float, high: float, low_open: bool, high_open: bool, what: str) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (above and below):  # NaN fails both
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, 1, math.inf, False, True, "an integer >= 1")
nonnegative_int = _number(int, 0, math.inf, False, True, "an integer >= 0")
positive_float = _number(float, 0, math.inf, True, True, "a finite number > 0")
nonnegative_float = _number(float, 0, math.inf, False, True, "a finite number >= 0")
unit_interval = _number(float, 0, 1, False, False, "in [0, 1]")  # absolute accuracy drops


def existing_file(text: str) -> Path:
    """An argparse type: a path to a file that exists (checked before anything runs)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} does not exist or is not a file")
    return path


def parser(module: str, description: str, presets: dict[str, Callable] | None = None,
           lm_presets: dict[str, Callable] | None = None) -> argparse.ArgumentParser:
    """A study's parser; `--help` ends with every preset's values (copy, then `--task lm`)."""
    epilog = None
    if presets:
        epilog = "presets:\n" + "\n".join(f"  {name:<6} {describe_preset(make())}" for name, make in presets.items())
    if lm_presets:
        epilog = (epilog + "\n" if epilog else "") + "presets with --task lm:\n" + "\n".join(
            f"  {name:<6} {describe_preset(make())}" for name, make in lm_presets.items())
    return argparse.ArgumentParser(prog=f"python -m {module}", description=description, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def coordinator_address(text: str) -> str:
    """An argparse type: `HOST:PORT` (`jax_mha.lab.distributed.parse_address`)."""
    try:
        return distributed.parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """`--coordinator`, `--num-processes`, `--process-id`: one process of several
    (`jax.distributed`; docs/scaling.md). Without them the environment decides
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a SLURM / Open MPI
    job); with none of those either, the run is a plain single process."""
    g = p.add_argument_group("several processes (docs/scaling.md)")
    g.add_argument("--coordinator", type=coordinator_address, metavar="HOST:PORT",
                   help="process 0's address, the same for every process (default $JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=positive_int, metavar="P",
                   help="how many processes train together (default $JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=nonnegative_int, metavar="I",
                   help="this process, 0 … P-1; process 0 writes every file (default $JAX_PROCESS_ID)")


def start_distributed(p: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """After parsing and before any JAX computation: joins the other processes when
    `add_distributed_args`' options or the environment ask for it (a bad value ends in
    the parser's `error:` and exit 2). On every process but 0 the standard output goes
    to /dev/null, so one process prints the log; errors still reach stderr.

    Returns whether this run spans several processes.
    """
    started = build_or_exit(p, lambda: distributed.initialize_from(
        getattr(args, "coordinator", None), getattr(args, "num_processes", None), getattr(args, "process_id", None)))
    if started and not distributed.is_writer():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    return bool(started)


def is_writer() -> bool:
    """Whether this process writes files: process 0 (every single-process run)."""
    return distributed.is_writer()


def build_or_exit(p: argparse.ArgumentParser, build: Callable[[], Any]) -> Any:
    """`build()`, with a config's `ValueError`/`TypeError` turned into the parser's
    one-line `error:` and exit status 2."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        p.error(str(e))


# ----------------------------------------------------------------- presets of the copy-task models


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    """One head-count sweep: the task, the model (num_heads is swept), training, seeds.

    `analysis_heads` is the head count whose seed-`seed` model the pruning and
    attention-map studies analyse by default.
    """

    heads: tuple[int, ...]  # the head counts swept, each dividing model.d_model
    num_seeds: int  # seeds per head count, trained together in one vmapped program
    task: Task  # CopyTaskConfig or TextTaskConfig (--task lm)
    model: ModelConfig  # num_heads is replaced by each swept head count
    train: TrainConfig
    seed: int = 0  # seeds are seed, seed + 1, …, seed + num_seeds - 1
    analysis_heads: int = 8
    # (heads, peak lr) pairs overriding train.learning_rate for those head counts:
    # head sizes from 4 to 64 need not share one rate; empty: one rate for all.
    learning_rates: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if self.num_seeds < 1 or not self.heads:
            raise ValueError(f"need num_seeds >= 1 and at least one head count, got {self.num_seeds}, {self.heads}")
        for h in (*self.heads, self.analysis_heads):
            if h < 1:
                raise ValueError(f"head counts must be >= 1, got {h}")
            if self.model.head_dim is None and self.model.d_model % h:
                raise ValueError(f"d_model={self.model.d_model} is not divisible by num_heads={h}")
        if self.model.vocab_size != self.task.vocab_size or self.model.max_len < self.task.seq_len:
            raise ValueError(f"model (vocab_size={self.model.vocab_size}, max_len={self.model.max_len}) does not fit "
                             f"the task (vocab_size={self.task.vocab_size}, seq_len={self.task.seq_len})")

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed, self.seed + self.num_seeds))

    def model_for(self, heads: int) -> ModelConfig:
        return dataclasses.replace(self.model, num_heads=heads)

    def train_for(self, heads: int) -> TrainConfig:
        """`train`, with this head count's learning rate if `learning_rates` names one."""
        rate = dict(self.learning_rates).get(heads)
        return self.train if rate is None else dataclasses.replace(self.train, learning_rate=rate)

    def fingerprint(self) -> dict:
        """Everything that makes two runs comparable; the head list is not part of it,
        so a sweep can be extended with more head counts into the same folder."""
        out = {"num_seeds": self.num_seeds, "seed": self.seed, "task": task_to_dict(self.task),
               "model": model_to_dict(self.model), "train": dataclasses.asdict(self.train)}
        if self.learning_rates:  # only when set, so results saved before the field existed still match
            out["learning_rates"] = [list(pair) for pair in self.learning_rates]
        del out["model"]["num_heads"]
        return json.loads(json.dumps(out))  # tuples to lists, as read back from JSON


def _copy_preset(length: int, d_model: int, train: TrainConfig, **kw) -> AblationConfig:
    task = CopyTaskConfig(length=length, num_symbols=kw.pop("num_symbols", 10))
    model = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=d_model, d_ff=4 * d_model,
                        num_heads=kw.get("analysis_heads", 8), num_layers=kw.pop("num_layers", 2))
    return AblationConfig(task=task, model=model, train=train, **kw)


def quick() -> AblationConfig:
    """About a minute on a 2-core CPU, all five head counts; small enough that
    compilation is a good part of it."""
    return _copy_preset(8, 64, TrainConfig(batch_size=32, num_steps=600, learning_rate=3e-3, warmup_steps=50,
                                           steps_per_call=50, eval_every=100, eval_size=128),
                        heads=(1, 2, 4, 8, 16), num_seeds=2)


def full() -> AblationConfig:
    """Seed 004's E12.2 at d_model=256, 2 layers, 3 seeds, L=16; early stopping once
    every seed holds 99% exact-sequence accuracy (8-18 min on a 2-core CPU)."""
    return _copy_preset(16, 256, TrainConfig(batch_size=64, num_steps=1500, learning_rate=1e-3, warmup_steps=100,
                                             steps_per_call=50, eval_every=50, eval_size=256),
                        heads=(1, 2, 4, 8, 16), num_seeds=3)


def tiny() -> AblationConfig:
    """A smoke test in seconds (tests use it): L=3, d_model=8, one layer, 2 and 4 heads."""
    return _copy_preset(3, 8, TrainConfig(batch_size=8, num_steps=50, learning_rate=3e-3, warmup_steps=5,
                                          steps_per_call=25, eval_every=25, eval_size=16),
                        heads=(2, 4), num_seeds=2, num_symbols=5, analysis_heads=4, num_layers=1)


PRESETS: dict[str, Callable[[], AblationConfig]] = {"quick": quick, "full": full, "tiny": tiny}


# ----------------------------------------------------------------- presets of the character language model


# The quick preset's peak learning rate per head count: the best of the dev-split grid
# in docs/results/data/lm_quick_lr_grid.json (tests/studies/test_report.py checks they agree).
QUICK_RATES: tuple[tuple[int, float], ...] = ((1, 1e-2), (2, 2e-2), (4, 1e-2), (8, 2e-2), (16, 2e-2))
# The standard preset's, from its own grid (docs/results/data/lm_standard_lr_grid.json).
STANDARD_RATES: tuple[tuple[int, float], ...] = ((1, 5e-3), (2, 5e-3), (4, 5e-3), (8, 1e-2), (16, 1e-2))


def _lm_preset(seq_len: int, d_model: int, train: TrainConfig, track_induction: bool = False, **kw) -> AblationConfig:
    task = TextTaskConfig(seq_len=seq_len, track_induction=track_induction)
    model = ModelConfig(vocab_size=task.vocab_size, max_len=seq_len, d_model=d_model, d_ff=4 * d_model,
                        num_heads=kw.get("analysis_heads", 8), num_layers=kw.pop("num_layers", 2))
    return AblationConfig(task=task, model=model, train=train, **kw)


def lm_quick() -> AblationConfig:
    """Every head count, h = 1 … 16 x 3 seeds, sized for 15 minutes on a quiet 2-core
    CPU: d_model=64, 2 layers, 64-character windows, batch 64, 700 steps (2.9 M
    characters per seed), induction evidence tracked at every evaluation. Each h
    trains at its own peak rate (`QUICK_RATES`), the best of a grid that brackets it,
    chosen on the dev split (`experiments.lm_sizing`; the grid is on
    docs/results/lm_heads.md); the test split is reported. The page's run is
    `--seeds 10`, the count its power calculation set (about 46 minutes)."""
    return _lm_preset(64, 64, TrainConfig(batch_size=64, num_steps=700, learning_rate=1e-2, warmup_steps=50,
                                          steps_per_call=50, eval_every=100, eval_size=64, early_stop=False),
                      track_induction=True, heads=(1, 2, 4, 8, 16), num_seeds=3, learning_rates=QUICK_RATES)


def lm_standard() -> AblationConfig:
    """The wider preset: d_model=128, 2 layers, 128-character windows, batch 32, 800
    steps (3.3 M characters per seed), h = 1 … 16 x 3 seeds, induction evidence tracked
    at every evaluation; each h at its own peak rate (`STANDARD_RATES`), the best of a
    dev-split grid at this width that brackets it (docs/results/lm_heads.md §3)."""
    return _lm_preset(128, 128, TrainConfig(batch_size=32, num_steps=800, learning_rate=6e-3, warmup_steps=50,
                                            steps_per_call=50, eval_every=100, eval_size=64, early_stop=False),
                      track_induction=True, heads=(1, 2, 4, 8, 16), num_seeds=3, learning_rates=STANDARD_RATES)


def lm_full() -> AblationConfig:
    """d_model=128, 2 layers, 128-character windows, 2000 steps of 32 windows, 3 seeds,
    lr 2e-3 (the earlier long preset, kept so its results folders still resume)."""
    return _lm_preset(128, 128, TrainConfig(batch_size=32, num_steps=2000, learning_rate=2e-3, warmup_steps=100,
                                            steps_per_call=50, eval_every=250, eval_size=128, early_stop=False),
                      heads=(1, 2, 4, 8, 16), num_seeds=3)


def lm_tiny() -> AblationConfig:
    """A smoke test in seconds (tests use it): 16-character windows, d_model=8, one layer."""
    return _lm_preset(16, 8, TrainConfig(batch_size=4, num_steps=50, learning_rate=3e-3, warmup_steps=5,
                                         steps_per_call=25, eval_every=25, eval_size=8, early_stop=False),
                      track_induction=True, heads=(2, 4), num_seeds=2, analysis_heads=4, num_layers=1)


LM_PRESETS: dict[str, Callable[[], AblationConfig]] = {"quick": lm_quick, "standard": lm_standard, "full": lm_full,
                                                       "tiny": lm_tiny}
TASK_PRESETS = {"copy": PRESETS, "lm": LM_PRESETS}
TASK_CHOICES = tuple(TASK_PRESETS)  # --task: the delayed copy (default) or the character language model


def presets_for(task: str) -> dict[str, Callable[[], AblationConfig]]:
    """The presets of one task (`--task`)."""
    return TASK_PRESETS[task]


def preset_for(task: str, name: str) -> AblationConfig:
    """One preset of one task; ValueError naming the task's presets for a name it lacks
    (`standard` is a language-model preset only)."""
    presets = TASK_PRESETS[task]
    if name not in presets:
        raise ValueError(f"--preset {name} is not a {task} preset; {task} has {', '.join(presets)}")
    return presets[name]()


def describe_task(task) -> str:
    """One phrase naming the task and its sizes."""
    if task.name == "lm":
        source = "Python Language Reference" if task.text_file is None else f"text file {task.text_file}"
        return f"character LM on the {source} (T={task.seq_len} characters, {task.vocab_size} symbols)"
    return f"copy L={task.length}{' reversed' if task.reverse else ''} (T={task.seq_len})"


def describe_rates(cfg: AblationConfig) -> str:
    """'lr 3e-3' when every swept h trains at one peak rate, else 'lr per h: 1: 1e-2, 2: 5e-3, …'."""
    rates = {h: cfg.train_for(h).learning_rate for h in cfg.heads}
    if len(set(rates.values())) == 1:
        return f"lr {next(iter(rates.values())):g}"
    return "lr per h: " + ", ".join(f"{h}: {lr:g}" for h, lr in rates.items())


def describe_preset(cfg: AblationConfig) -> str:
    """One line with every value a preset sets."""
    t, m, tr = cfg.task, cfg.model, cfg.train
    if t.name == "lm":
        return (f"{describe_task(t)}, d_model={m.d_model}, d_ff={m.d_ff}, {m.num_layers} layer(s), heads "
                f"{' '.join(map(str, cfg.heads))} (analysed: {cfg.analysis_heads}), {cfg.num_seeds} seeds from "
                f"{cfg.seed}, batch {tr.batch_size}, {tr.num_steps} steps (no early stop), {describe_rates(cfg)}, "
                f"warmup {tr.warmup_steps}, validation bpc every {tr.eval_every} steps on {tr.eval_size} windows")
    return (f"copy L={t.length} ({t.num_symbols} symbols; sequences of {2 * t.length + 3} tokens, the model reads "
            f"T={t.seq_len}), d_model={m.d_model}, d_ff={m.d_ff}, {m.num_layers} layer(s), heads "
            f"{' '.join(map(str, cfg.heads))} (analysed: {cfg.analysis_heads}), {cfg.num_seeds} seeds from "
            f"{cfg.seed}, batch {tr.batch_size}, <= {tr.num_steps} steps, lr {tr.learning_rate:g}, warmup "
            f"{tr.warmup_steps}, eval every {tr.eval_every} steps on {tr.eval_size} sequences, early stop at "
            f"{tr.target_accuracy:g} exact-sequence accuracy")


def default_out(study: str, preset: str, task: str = "copy", reverse: bool = False) -> Path:
    """`results/<study>/<preset>` (`-reverse`, and a `<task>-` prefix for other tasks),
    so the presets of one study never overwrite each other."""
    name = ("" if task == "copy" else f"{task}-") + preset + ("-reverse" if reverse else "")
    return Path("results") / study / name


# ----------------------------------------------------------------- output


def to_jsonable(x: Any) -> Any:
    """NumPy/JAX scalars and arrays to plain Python, recursively; NaN/inf to None."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return to_jsonable(np.asarray(x).tolist())
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


MISSING = "–"  # a table cell whose number does not exist (one seed's spread, one chunk's throughput)


def fmt(value: Any, spec: str) -> str:
    """`format(value, spec)`, or "–" for None and non-finite numbers: results.json
    stores NaN as null, and a rerun formats what it reads back."""
    if value is None or (isinstance(value, (float, np.floating)) and not np.isfinite(value)):
        return MISSING
    return format(value, spec)


def fmt_mean_std(mean: Any, std: Any, spec: str) -> str:
    """'m ± s', 'm ± –' where the spread does not exist (one seed), '–' without a mean."""
    return MISSING if fmt(mean, spec) == MISSING else f"{fmt(mean, spec)} ± {fmt(std, spec)}"


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Atomic, indented JSON; written by process 0 only (`is_writer`)."""
    if not is_writer():
        return
    write_atomic(path, json.dumps(to_jsonable(data), indent=2) + "\n")


def saved_results(path: Path, config: dict, key: str) -> dict:
    """What `path` (a study's results.json) holds from the same `config` ({} if nothing):
    the records under `key` it finished are skipped by a rerun, and its metadata (the
    first session's) kept. SystemExit naming the file when it holds another
    configuration, or is damaged."""
    if not path.exists():
        return {}
    saved = read_results(path, lambda d: None if isinstance(d, dict) and key in d else f"it has no {key}")
    if saved.get("config") != config:
        raise SystemExit(f"error: {path} holds runs of another configuration; pass another --out or delete it")
    return saved


class DamagedResults(SystemExit):
    """A results file that cannot be used; its message is the one line to print."""


def read_results(path: Path, check: Callable[[Any], str | None]) -> Any:
    """The parsed JSON at `path`, if `check(data)` finds nothing wrong with it.

    Raises:
      DamagedResults: (a SystemExit with one line naming the file and `--force`) if
        the file is not UTF-8 JSON or `check` returns a complaint.
    """
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = f"it is not valid JSON ({type(e).__name__} at byte {getattr(e, 'pos', getattr(e, 'start', '?'))})"
    else:
        problem = check(data)
        if problem is None:
            return data
    raise DamagedResults(f"error: {path} is damaged: {problem}; rerun with --force to start over "
                         f"(or move the file away to keep it)")


def cpu_model() -> str:
    """The CPU's marketing name, with its family and model numbers and whether it has
    AVX-512 (Linux /proc/cpuinfo), else platform.processor(). A cloud CPU's name is
    often just "AMD EPYC", which hides the generation, and with it whether the matrix
    products have AVX-512 (a Zen 3 has none, a Zen 4 has it)."""
    try:
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block is enough
            info.setdefault(key.strip(), value.strip())
    except OSError:
        info = {}
    if "model name" not in info:
        return platform.processor() or platform.machine()
    detail = [f"family {info[k]}" if k == "cpu family" else f"model {info[k]}"
              for k in ("cpu family", "model") if k in info]
    if "flags" in info:
        detail.append("AVX-512" if "avx512f" in info["flags"].split() else "no AVX-512")
    return f"{info['model name']} ({', '.join(detail)})" if detail else info["model name"]


CHECKOUT = Path(__file__).resolve().parents[1]  # the repository the studies run from


def _git(root: str | os.PathLike, *args: str, env: dict | None = None) -> str | None:
    """`git -C root args…`'s standard output; None if git fails or is missing."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              env=None if env is None else {**os.environ, **env})
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(root: str | os.PathLike = CHECKOUT) -> dict[str, Any]:
    """`{"commit", "dirty", "tree"}` of the git checkout at `root`: the HEAD commit,
    whether `git status --porcelain` lists any change (ignored files such as results/
    do not count), and the hash of the files as they are (`git write-tree` of every
    file git does not ignore, through a temporary index): it equals `git log
    --format=%T` of the commit whose files ran, also where the checkout's HEAD is stale
    (a copy of the working tree sent to a device machine). All None outside a checkout
    or without git."""
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain") if commit is not None else None
    return {"commit": commit.strip() if commit else None, "dirty": None if status is None else bool(status.strip()),
            "tree": None if commit is None else working_tree_hash(root)}


def working_tree_hash(root: str | os.PathLike = CHECKOUT) -> str | None:
    """The git tree hash of the files at `root` as they are now (None without git)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        if _git(root, "add", "-A", ".", env=env) is None:
            return None
        tree = _git(root, "write-tree", env=env)
    return tree.strip() if tree else None


def file_state(path: str | os.PathLike) -> dict[str, Any]:
    """`{"file", "commit", "dirty"}` of one file of a git checkout (the checkout that
    holds it): its path from the checkout's top, the last commit that touched it
    (`git log -1 --format=%H -- file`; None if no commit has it) and whether
    `git status --porcelain -- file` lists it (modified, staged or untracked). Outside a
    checkout or without git: the path as given, commit and dirty None."""
    path = Path(path).resolve()
    top = _git(path.parent, "rev-parse", "--show-toplevel")
    if top is None:
        return {"file": str(path), "commit": None, "dirty": None}
    rel = path.relative_to(Path(top.strip()).resolve()).as_posix()
    commit = (_git(top.strip(), "log", "-1", "--format=%H", "--", rel) or "").strip() or None
    status = _git(top.strip(), "status", "--porcelain", "--", rel)
    return {"file": rel, "commit": commit, "dirty": None if status is None else bool(status.strip())}


def child_env() -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH, so a child
    `python -m experiments.NAME` finds the studies from any working directory (they
    are not installed)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(CHECKOUT) + (os.pathsep + path if path else "")}


def run_metadata() -> dict[str, Any]:
    """Versions, CPU and device, the git commit (and whether the tree had uncommitted
    changes) and the command line, recorded beside every result."""
    import flax
    import optax

    return {
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
        "numpy": np.__version__, "python": platform.python_version(),
        "backend": jax.default_backend(), "devices": [str(d.device_kind) for d in jax.devices()],
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "load_average": list(os.getloadavg()), "host_memory_reused": bool(HOST_MEMORY_REUSED),
        **git_state(), "argv": list(sys.argv),
    }


def save_figure(fig, path: str | os.PathLike) -> None:
    """Saves a matplotlib figure as PNG atomically (process 0 only) and closes it."""
    import io

    plt = require("matplotlib.pyplot")
    if not is_writer():
        plt.close(fig)
        return
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def use_agg_backend() -> None:
    """Studies draw to files; never ask for a screen."""
    require("matplotlib").use("Agg")


# ----------------------------------------------------------------- progress


class TrainingBar:
    """A tqdm bar over optimizer steps fed by `train_seeds`' callback; early stopping
    closes it at 100% with "stopped at step S: target reached" (no stale ETA)."""

    def __init__(self, total: int, desc: str, disable: bool, log: MetricsLog | None = None):
        tqdm = require("tqdm.auto").tqdm
        self.desc, self.closed, self.log = desc, False, log
        self.bar = tqdm(total=total, desc=desc, unit="step", disable=disable or not is_writer(), leave=True)

    def __call__(self, report: dict) -> None:
        if self.log is not None:
            self.log(report)
        loss = f"{report['loss']:.4f}" if "loss" in report else "–"  # none before the first step (eval_steps 0)
        if "eval" in report and "bpc" in report["eval"]:
            self.bar.set_postfix(loss=loss, val_bpc=f"{float(np.mean(report['eval']['bpc'])):.3f}")
        elif "eval" in report:
            self.bar.set_postfix(loss=loss, heldout=f"{float(np.mean(report['eval']['token_accuracy'])):.3f}")
        self.bar.update(report["step"] - self.bar.n)
        if "stopped" in report:
            self.close(report["step"], report["stopped"])

    def close(self, step: int | None = None, reason: str | None = None) -> None:
        """Idempotent; with an early-stop `reason`, says so on the bar (or on a line of
        its own when bars are off)."""
        if self.closed:
            return
        self.closed = True
        if self.log is not None:
            self.log.close()
        early = reason is not None and reason != "step limit"
        if early and self.bar.disable:
            print(f"{self.desc}: stopped at step {step}: {reason}", flush=True)
        elif early:
            self.bar.total = self.bar.n  # a full bar: nothing more is coming, no ETA
            self.bar.set_postfix_str(f"stopped at step {step}: {reason}")
        self.bar.close()


class MetricsLog:
    """A `train_seeds` callback (or `TrainingBar(log=...)`) that appends one JSON line
    per evaluation to `path` (`metrics.jsonl` beside results.json): `tags` (e.g. the
    head count), the step, the wall time, the chunk's mean training loss and accuracy,
    the seeds and every evaluation metric per seed. Each line is written with one
    `write` to a file opened for appending, so a reader never sees half a line from a
    finished write; a resumed run appends after the lines already there.

    With `tensorboard` (a folder), the scalar metrics also go to TensorBoard event
    files there, one run per seed (`<run>seed<S>`, `run` from the tags), through
    tensorboardX (the `tensorboard` extra; SystemExit with one line if missing).
    """

    def __init__(self, path: str | os.PathLike, seeds: Sequence[int], tags: dict[str, Any] | None = None,
                 tensorboard: str | os.PathLike | None = None):
        self.path, self.seeds, self.tags = Path(path), [int(s) for s in seeds], dict(tags or {})
        self.writers: dict[int, Any] = {}
        if tensorboard is not None and is_writer():
            writer = require("tensorboardX").SummaryWriter
            run = "".join(f"{k}{v}_" for k, v in self.tags.items())
            self.writers = {s: writer(logdir=str(Path(tensorboard) / f"{run}seed{s}")) for s in self.seeds}

    def __call__(self, report: dict) -> None:
        if "eval" not in report or not is_writer():
            return
        evals = {k: to_jsonable(v) for k, v in report["eval"].items()}
        line = {**self.tags, "step": int(report["step"]), "time": time.time(),
                "train_loss": to_jsonable(report.get("loss")), "train_accuracy": to_jsonable(report.get("accuracy")),
                "seeds": self.seeds, "eval": evals}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line, allow_nan=False) + "\n").encode())
        finally:
            os.close(fd)
        for i, seed in enumerate(self.seeds):
            writer = self.writers.get(seed)
            if writer is None:
                continue
            for name, values in report["eval"].items():
                value = np.asarray(values)
                if value.ndim == 1 and value.shape[0] == len(self.seeds):  # one scalar per seed
                    writer.add_scalar(f"eval/{name}", float(value[i]), int(report["step"]))
            writer.flush()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers = {}


# ----------------------------------------------------------------- timing and FLOPs


def attention_flops(batch: int, seq: int, d_model: int) -> dict[str, float]:
    """FLOPs of one self-attention layer (multiply-add = 2): projections Q, K, V, O
    `8·B·N·d²`, scores and weighted sum `4·B·N²·d` (independent of the head count);
    forward+backward counted as 3× forward."""
    proj = 8.0 * batch * seq * d_model**2
    attn = 4.0 * batch * seq**2 * d_model
    return {"projections": proj, "attention": attn, "forward": proj + attn, "forward_backward": 3.0 * (proj + attn)}


def median_seconds(fn: Callable[[], Any], warmup: int, repeats: int) -> tuple[float, float]:
    """`(median seconds over `repeats` calls, seconds of the first call)`; `fn` must
    block until its result is ready. The first call compiles; `warmup - 1` more
    settle caches before timing."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def load_report() -> dict[str, Any]:
    """The 1/5/15-minute load average and the core count: a load above the core
    count means other work shared the CPU and timings are pessimistic."""
    return {"load_average": list(os.getloadavg()), "cpu_count": os.cpu_count()}


# ----------------------------------------------------------------- the model a study analyses

ANALYSIS_EVAL_SEED = 2**31 - 3  # held-out sequences of the analyses, apart from training and train's eval set


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options choosing the analysed model (head_pruning, attention_maps)."""
    p.add_argument("--task", choices=TASK_CHOICES, default="copy", help="the task the model was trained on (default copy)")
    p.add_argument("--preset", choices=sorted(set(PRESETS) | set(LM_PRESETS)), default="full",
                   help="analyse this head_ablation preset's model (default full, the one docs/results/head_pruning.md reports; values below)")
    p.add_argument("--text", type=Path, help="--task lm: a UTF-8 text file as corpus (default: the Python Language "
                   "Reference from pydoc_data)")
    p.add_argument("--heads", type=positive_int, help="its head count (default: the preset's analysed one, 8)")
    p.add_argument("--seed", type=nonnegative_int, help="its seed (default 0)")
    p.add_argument("--checkpoint", type=existing_file,
                   help="analyse this checkpoint (jax_mha.lab.checkpoint.save_checkpoint) instead of the preset's model")
    p.add_argument("--retrain", action="store_true", help="train the preset's model afresh instead of loading it")
    p.add_argument("--train-steps", type=positive_int,
                   help="step limit when the model has to be trained (a multiple of the preset's steps per call)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model a study wants: the preset's configuration at one head count and seed."""

    preset: str
    ablation: AblationConfig
    heads: int
    seed: int

    @property
    def model(self) -> ModelConfig:
        return self.ablation.model_for(self.heads)

    @property
    def filename(self) -> str:
        return f"h{self.heads}_seed{self.seed}.msgpack"


def model_spec(args) -> ModelSpec:
    """From `add_model_args`' options (ValueError for a head count that does not fit)."""
    ablation = preset_for(args.task, args.preset)
    if getattr(args, "text", None) is not None:
        ablation = with_text_file(ablation, args.text)
    if args.train_steps is not None:
        ablation = dataclasses.replace(ablation, train=dataclasses.replace(ablation.train, num_steps=args.train_steps))
    heads = ablation.analysis_heads if args.heads is None else args.heads
    ablation.model_for(heads)  # ValueError here, at the command line, if d_model % heads
    return ModelSpec(args.preset, ablation, heads, ablation.seed if args.seed is None else args.seed)


def with_text_file(ablation: AblationConfig, path: Path) -> AblationConfig:
    """An LM preset on a user's UTF-8 file (`--text FILE`): its vocabulary sizes the model.

    Raises:
      ValueError: for a copy-task preset, or a file that cannot be a corpus (names it).
    """
    if ablation.task.name != "lm":
        raise ValueError(f"--text {path} needs --task lm")
    task = dataclasses.replace(ablation.task, text_file=str(path))
    model = dataclasses.replace(ablation.model, vocab_size=task.vocab_size)  # loads the file: ValueError if unusable
    return dataclasses.replace(ablation, task=task, model=model)


def sentence_windows(task: TextTaskConfig, length: int, count: int) -> np.ndarray:
    """`count` windows of `length` validation characters, each starting a sentence (after
    ". " and at a capital letter), spread evenly over the validation split.

    Returns:
      int32 `(count, length)` ids (the split's first windows if it has no such sentence).
    """
    corpus = task.corpus
    text = corpus.decode(corpus.validation)
    starts = [i + 2 for i in range(len(text) - length - 2) if text[i : i + 2] == ". " and text[i + 2].isupper()]
    starts = starts or list(range(0, len(text) - length, length))
    picked = [starts[round(j * (len(starts) - 1) / max(count - 1, 1))] for j in range(count)]
    return np.stack([corpus.validation[s : s + length] for s in picked]).astype(np.int32)


def describe_model(model: ModelConfig, task) -> str:
    layers = f"{model.num_layers} layer{'s' if model.num_layers > 1 else ''}"
    return f"{layers} x {model.num_heads} heads, d_model={model.d_model}, {describe_task(task)}"


@dataclasses.dataclass
class StudyModel:
    """The model a study analyses and where it came from."""

    params: Any
    config: ModelConfig
    task: Task
    source: dict  # kind ("checkpoint", "trained", "untrained"), path, why


def _load_checked(path: Path):
    """`(params, config, task)` of a checkpoint; SystemExit with one line if unusable."""
    try:
        params, config, metadata = load_checkpoint(path)
        if "task" not in metadata:
            raise ValueError(f"checkpoint {path} does not say which task it was trained on (no 'task' metadata)")
        task = task_from_dict(metadata["task"])
        if config.vocab_size != task.vocab_size or config.max_len < task.seq_len:
            raise ValueError(f"checkpoint {path}: its model does not fit its task")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return params, config, task


def candidate_checkpoints(spec: ModelSpec, out: Path) -> list[Path]:
    """Where the preset's model may already be: the ablation's folder, then what the
    pruning or attention-map study trained (deduplicated, in that order)."""
    task = spec.ablation.task.name
    paths = [default_out(study, spec.preset, task) / "checkpoints" / spec.filename
             for study in ("head_ablation", "head_pruning", "attention_maps")] + [out / "checkpoints" / spec.filename]
    return list(dict.fromkeys(paths))


def find_model(spec: ModelSpec, out: Path, checkpoint: Path | None, retrain: bool) -> StudyModel | None:
    """The model to analyse if one is on disk; prints the first line of output,
    which says which checkpoint is used and why (or why one is skipped)."""
    if checkpoint is not None:
        params, config, task = _load_checked(checkpoint)
        print(f"model: {checkpoint}, given by --checkpoint ({describe_model(config, task)})", flush=True)
        return StudyModel(params, config, task, {"kind": "checkpoint", "path": str(checkpoint), "why": "--checkpoint"})
    for path in [] if retrain else candidate_checkpoints(spec, out):
        if not path.exists():
            continue
        params, config, task = _load_checked(path)
        if (config, task) != (spec.model, spec.ablation.task):
            print(f"skipping {path}: it is a {describe_model(config, task)} model, not the {spec.preset} preset's "
                  f"{describe_model(spec.model, spec.ablation.task)} (pass --checkpoint to analyse it)", flush=True)
            continue
        why = f"the --preset {spec.preset} model with {spec.heads} heads, seed {spec.seed}"
        print(f"model: {path}, {why} ({describe_model(config, task)})", flush=True)
        return StudyModel(params, config, task, {"kind": "checkpoint", "path": str(path), "why": why})
    return None


def train_model(spec: ModelSpec, out: Path, progress: bool) -> StudyModel:
    """Trains the preset's model alone (seed `spec.seed`; resumable) into
    `<out>/checkpoints/`. Alone it stops early on its own accuracy, where the
    ablation waits for all seeds, so it can differ slightly from the ablation's."""
    path = out / "checkpoints" / spec.filename
    state_dir = path.with_name(f"h{spec.heads}_seed{spec.seed}_state")
    print(f"model: training the --preset {spec.preset} model with {spec.heads} heads, seed {spec.seed} "
          f"({describe_model(spec.model, spec.ablation.task)}): no checkpoint of it in "
          f"{', '.join(map(str, candidate_checkpoints(spec, out)[:3]))}; saving to {path}", flush=True)
    bar = TrainingBar(spec.ablation.train.num_steps, f"training h={spec.heads}", not progress,
                      log=MetricsLog(out / "metrics.jsonl", [spec.seed], {"heads": spec.heads}))
    try:
        result = train_seeds(spec.model, spec.ablation.task, spec.ablation.train_for(spec.heads), [spec.seed], callback=bar,
                             state_dir=state_dir)
    except KeyboardInterrupt:
        step = saved_train_step(state_dir)
        saved = "training had not reached its first save" if step is None else f"training is saved in {state_dir} (step {step})"
        raise Interrupted(saved) from None
    finally:
        bar.close()
    params = jax.tree.map(lambda x: x[0], result.state.params)
    if is_writer():
        save_checkpoint(path, params, spec.model, {"task": task_to_dict(spec.ablation.task), "heads": spec.heads,
                                                    "seed": spec.seed, "steps_run": result.steps_run})
        shutil.rmtree(state_dir, ignore_errors=True)
    return StudyModel(params, spec.model, spec.ablation.task,
                      {"kind": "trained", "path": str(path), "why": "no checkpoint found",
                       "steps_run": result.steps_run, "wall_seconds": result.wall_seconds,
                       **{f"final_{k}": float(result.evals[k][0, -1]) for k in ("exact_accuracy", "bpc")
                          if k in result.evals}})


SEQUENCE_PARALLEL = ("ring", "ulysses")  # --sequence-parallel: how attention splits a mesh's "sequence" axis


def add_sequence_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequence-parallel", choices=SEQUENCE_PARALLEL, default="ring",
                   help="with --mesh ...,sequence=P: ring attention (default; K/V blocks passed around the devices) or "
                   "Ulysses (all-to-all to a split over the heads: every head count a multiple of P); "
                   "docs/scaling.md compares them")


def check_sequence_parallel(kind: str, num_heads: int, mesh) -> None:
    """Ulysses splits the heads over the mesh's "sequence" axis: ValueError naming
    the numbers when they do not divide."""
    from jax_mha import parallel

    size = parallel.sequence_size(mesh)
    if kind == "ulysses" and num_heads % size:
        raise ValueError(f"--sequence-parallel ulysses splits the heads over the {size} devices of 'sequence': "
                         f"{num_heads} heads do not divide; choose --heads multiples of {size} or the ring")
