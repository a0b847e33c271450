"""Evaluation of SOAR (METHOD.md "Evaluation protocol"): pass@k, the fail@128 filter, fresh-student
RLOO runs with early stopping, the paper's Tables 4-6 rows, Vendi diversity, a report (md + PNGs).

    python eval.py filter math harp olympiad --model M --out data  # data/<pool>/{train,test}.jsonl
    torchrun --nproc_per_node 8 eval.py row base ps hard-only pq grounded-t base-t --model M \\
        --train data/math/train.jsonl --test data/math/test.jsonl --soar runs/math \\
        --runs runs/eval/math --mode curriculum --seeds 0,1,2
    torchrun --nproc_per_node 8 eval.py row pq --model M --train data/math/train.jsonl \\
        --test data/olympiad/test.jsonl --soar runs/math --runs runs/eval/olympiad --fixed_step 50
    python eval.py train --synthetic mine.jsonl --name mine ...    # any question set + hard train
    python eval.py sample-teacher runs/math/teacher --out q.jsonl  # 128 teacher questions
    python eval.py vendi q.jsonl runs/math/pq.jsonl                # diversity
    python eval.py report --runs runs/eval/math --soar runs/math   # report.md + PNGs in --runs
Without --model everything runs on the built-in world (world.py) with each flag's world value.

A run folder <runs>/<method>/seed<s>/: metrics.jsonl (per step), evals.jsonl (test pass@k every
--eval_every steps), ckpt/ (reruns resume), result.json (the row's numbers; reruns skip the run).
"""
import dataclasses
import functools
import glob
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import data
import launch
import lora
import rloo
import rloo_extras
import world


WORLD_MAX_TOKENS = world.MAX_TOKENS   # new tokens a completion needs on the built-in world


@dataclasses.dataclass
class Config:
    # ---- what to evaluate ----
    model: str = launch.flag("",
        'base model (every fresh student starts here); "" = built-in world')
    world: str = launch.flag("default",
        "the built-in world without --model: default, or small (the tests')",
        choices=("default", "small"))
    train: str = launch.flag("",
        "hard train split (question/answer jsonl/parquet); \"\" = the world's")
    test: str = launch.flag("", "hard test split; \"\" = the world's")
    soar: str = launch.flag("runs/soar",
        "soar.py --out folder (pq.jsonl, student/, ...); report: comma list")
    intrinsic: str = launch.flag("",
        "`soar.py --reward learnability` --out (intrinsic-t); report: list")
    opensir: str = launch.flag("", "`soar.py --reward opensir` --out (opensir-t); report: list")
    populora: str = launch.flag("", "populora.py --out (the populora row); report: list")
    populora_single: str = launch.flag("",
        "`populora.py --single_agent` --out (the populora-single row); report: list")
    labels: str = launch.flag("",
        "pq-* rows with --model: jsonl of PQ question, correct, well_posed")
    extra: str = launch.flag("",
        "curated real questions for the upper-bound rows (e.g. MATH train)")
    synthetic: str = launch.flag("", "`train`: the question set to add to the hard train split")
    name: str = launch.flag("", "`train`: the method name (run folder and report row)")
    runs: str = launch.flag("runs/eval",
        "run folders: <runs>/<method>/seed<s>/; the report goes here too")
    out: str = launch.flag("", "output folder (`filter`, `report`) or file (`sample-teacher`)")
    seeds: str = launch.flag("0", "comma list: sampling seeds (inference rows) or training seeds")
    # ---- pass@k (METHOD.md "Evaluation protocol") ----
    passk_samples: int = launch.flag(32,
        "samples per test problem; k in 1, 4, 8, 16, 32 up to this", least=1)
    # ---- fail@128 filter (METHOD.md "Data"): T = 1, student_max_tokens, keep 0-correct, 50/50 ----
    filter_samples: int = launch.flag(128, world=32, help="samples per problem", least=1)
    split_seed: int = launch.flag(0, "seed of the 50/50 train/test split")
    # ---- fresh students (METHOD.md "Hyperparameters", "Evaluation protocol") ----
    mode: str = launch.flag("mixed",
        "synthetic + real: mixed (HARP, Olympiad) or curriculum (MATH)",
        choices=("mixed", "curriculum"))
    sampler: str = launch.flag("uniform",
        "a fresh student's questions: uniform (shuffled epochs) or leeps",
        choices=("uniform", "leeps"))
    sept_temperature: float = launch.flag(1.0,
        "SePT's answer temperature (0.5/0.7/1.0: best on a train half)")
    # ---- SeRL (METHOD.md "SeRL"): SeRL's own settings; the built-in world's beside them ----
    serl_shots: int = launch.flag(8, world=0, least=0,
        help="examples of the hard train split (2 of them its own kept questions, once it has) in "
             "each question-writing prompt; 0: SOAR's teacher prompt and format filter instead, "
             "the only prompt the built-in world's model follows")
    serl_prompts: int = launch.flag(4, world=16, help="question-writing prompts per round",
                                    least=1)
    serl_rounds: int = launch.flag(64, world=4, least=1,
        help="question-writing rounds per step, at most: a step writes until --serl_questions "
             "pass its filters (SeRL: no cap; a model that writes nothing keeps would loop)")
    serl_max_tokens: int = launch.flag(1024, world=WORLD_MAX_TOKENS,
        help="new tokens per question-writing sample", least=1)
    serl_temperature: float = launch.flag(0.8, "temperature of the question-writing samples")
    serl_similarity: float = launch.flag(0.7,
        "diversity: a written question this similar (n-gram cosine) to a hard train or kept one "
        "is dropped")
    serl_samples: int = launch.flag(16, world=8,
        help="answers sampled per written question for its majority vote; the row's RLOO group",
        least=2)
    serl_low: float = launch.flag(0.2,
        "difficulty: keep a question whose majority's share of the votes is >= this")
    serl_high: float = launch.flag(0.8, "... and <= this")
    serl_questions: int = launch.flag(16, world=4,
        help="kept written questions per step, at most; they join the step's hard train ones",
        least=0)
    serl_lr: float = launch.flag(5e-7, world=1e-4,
        help="the SeRL row's student lr (world: chosen on the train half, docs/results.md)")
    serl_kl: float = launch.flag(1e-4,
        "KL to the base model, as a per-token penalty in SeRL's reward (not in its loss)")
    serl_train_batch: int = launch.flag(16, least=1,
        help="rollouts per optimizer step: a step's rollouts make several PPO updates")
    serl_clip: float = launch.flag(0.2, "PPO's clip of SeRL's updates: ratios outside 1 +- this")
    student_steps: int = launch.flag(1500, world=24,
        help="at most; the early-stopping rule usually ends a run before", least=1)
    switch_step: int = launch.flag(64, world=6,
        help="curriculum: synthetic only for this many steps, then real only")
    student_warmup: int = launch.flag(20, world=2,
        help="lr warmup of mixed runs; curriculum runs use 0")
    student_lr: float = launch.flag(1e-5, world=3e-4, help="AdamW, cosine over student_steps")
    student_samples: int = launch.flag(32, world=8,
        help="samples per question (the student's RLOO group)", least=2)
    big_group: int = launch.flag(128, world=16, help="the group of the hard-only-128 row", least=2)
    student_questions: int = launch.flag(8, world=4, help="questions per student step", least=1)
    kl_coef: float = launch.flag(0.001, "k3 KL to the model the run started from")
    lora_rank: int = launch.flag(0,
        "rank of the fresh students' adapters (METHOD.md \"LoRA\"); 0 = full fine-tuning", least=0)
    lora_alpha: float = launch.flag(32.0, "adapters' scale: the update is (alpha / rank) B A")
    temperature: float = launch.flag(1.0, "sampling temperature (training, pass@k, filter)")
    student_max_tokens: int = launch.flag(1024, world=WORLD_MAX_TOKENS,
        help="new tokens per student completion (training, pass@k, filter)", least=1)
    teacher_max_tokens: int = launch.flag(512, world=WORLD_MAX_TOKENS,
        help="new tokens per teacher sample", least=1)
    teacher_questions: int = launch.flag(128, world=32,
        help="questions sampled from a teacher (and real ones of upper-128)", least=1)
    eval_every: int = launch.flag(20, world=4, help="test pass@k every this many steps", least=1)
    ckpt_every: int = launch.flag(100, world=8, help="checkpoint every this many steps", least=1)
    fixed_step: int = launch.flag(0,
        "> 0: report this step's test metric instead (OlympiadBench: 50)")
    # ---- early stopping (METHOD.md "Early stopping") ----
    es_window: int = launch.flag(25, world=5,
        help="centred moving average of the mean training reward", least=1)
    es_fraction: float = launch.flag(0.15,
        "stop at the first step whose slope < this * the max slope")
    es_average: int = launch.flag(200, world=8,
        help="report the test metric averaged over the next this many steps", least=1)
    # ---- diversity (METHOD.md "Diversity") ----
    embed: str = launch.flag("ngram",
        "ngram (offline, no model) or a HF model path (mean-pooled states)")
    vendi_subset: int = launch.flag(128, world=32, help="questions per bootstrap subset", least=1)
    vendi_draws: int = launch.flag(100, world=20, help="bootstrap subsets", least=1)
    # ---- systems ----
    micro_batch_tokens: int = launch.flag(16384,
        "tokens per forward/backward pass (rows x longest row)")
    prompt_pass: str = launch.flag("auto",
        "training forward: shared (each distinct prompt once), single (one causal pass per row) "
        "or auto (rloo.SHARED_PROMPTS_BY_DEVICE: shared on CPU, single on GPU)",
        choices=("auto", "shared", "single"))
    activation_checkpointing: bool = launch.flag(True, world=False,
        help="recompute activations: a 3B student fits beside vLLM")
    gpu_memory_utilization: float = launch.flag(0.3, "the vLLM engine's share of GPU memory")
    verbose: bool = launch.flag(False, "keep vLLM's warnings and load bars on the console")
    # ---- tracking ----
    wandb: str = launch.flag("",
        "W&B project: `row` and `report` log their tables (and plots) there")
    wandb_name: str = launch.flag("", "the W&B run's name (\"\" = W&B picks one)")


KS = (1, 4, 8, 16, 32)
LEEPS_WINDOW = 20       # steps over which each portfolio's share of non-trivial groups is measured
LEEPS_NEIGHBOURS = 8    # nearest neighbours whose outcomes rank an explore question
TEACHER_ROUNDS = 8      # rejection-sampling rounds for a teacher's questions (teacher_questions)
SERL_OWN_SHOTS = 2      # SeRL: a few-shot prompt's examples drawn from its own kept questions
# SeRL's RL step as OpenRLHF runs it (METHOD.md "SeRL"): its reward is 1/0 (agrees with the label or
# not); the RLOO value is clipped to +-SERL_REWARD_CLIP; the whitening divides by
# sqrt(max(var, SERL_VAR_FLOOR)); AdamW's betas are OpenRLHF's
SERL_REWARD_CLIP = 10.0
SERL_VAR_FLOOR = 1e-8
SERL_ADAM_BETAS = (0.9, 0.95)
ROUND_VENDI_SUBSET = 8  # the report's Vendi per PopuLoRA round: of this many problems (one agent's)
MAY_CHANGE = {"prompt_pass", "runs", "out", "seeds", "ckpt_every", "micro_batch_tokens",
              "activation_checkpointing", "gpu_memory_utilization", "verbose", "wandb",
              "wandb_name"}   # settings a resumed run may change


def sept_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """SePT (METHOD.md "SePT"): advantage 1 for every sample whatever its reward, so rloo_loss
    without KL is the NLL of the samples themselves."""
    return torch.ones_like(rewards)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the tables: what it evaluates, or where its fresh student's questions come from
    and what that student does differently. Paths may name flags: "{soar}/pq.jsonl" is --soar's."""
    about: str
    model: str = ""       # inference only: pass@k of this HF folder; else a fresh student trains
    teacher: str = ""     # its questions: --teacher_questions sampled from this HF teacher...
    file: str = ""        # ...or the problems of this file
    keep: str = ""        # only the questions with this label (pq_subset: correct, wellposed)
    subsample: bool = False   # at most --teacher_questions of them, drawn per seed
    group: str = "student_samples"    # the Config field of its RLOO group size
    advantages: object = rloo.rloo_advantages   # its student's advantages (sept_advantages)
    temperature: str = "temperature"  # the Config field of its student's sampling temperature
    train_temperature: float | None = None   # its log-probs' in training; None: the sampling one
    kl: bool = True       # the k3 KL to the base model in its student's loss
    sampler: str = ""     # uniform or leeps; "" = --sampler
    lr: str = "student_lr"        # the Config field of its student's learning rate
    self_instruct: bool = False   # SeRL: each step it writes questions too (self_instruct())


ROWS = {  # the paper's Tables 4-6 rows, in its order (the report keeps it); a new row is one entry
    "base": Row("the base model, inference only", model="{model}"),
    "hard-only": Row("fresh student, RLOO on the hard train split alone (group --student_samples)"),
    "hard-only-128": Row("the same, group --big_group (128)", group="big_group"),
    "intrinsic-t": Row("fresh student on 128 questions of the learnability teacher + hard train",
                       teacher="{intrinsic}/teacher"),
    "base-t": Row("fresh student on 128 questions of the base model as teacher + hard train",
                  teacher="{model}"),
    "pq": Row("fresh student on SOAR's promotion questions + hard train", file="{soar}/pq.jsonl"),
    "pq-correct": Row("the same on the promotion questions whose answers are correct "
                      "(world.describe, or --labels)", file="{soar}/pq.jsonl", keep="correct"),
    "pq-wellposed": Row("the same on the well-posed promotion questions, answers correct or not "
                        "(or --labels)", file="{soar}/pq.jsonl", keep="wellposed"),
    "ps": Row("SOAR's promoted student, inference only", model="{soar}/student"),
    "populora": Row("PopuLoRA's students, inference only: each one's pass@k and their mean",
                    model="{populora}/students"),
    "populora-single": Row("PopuLoRA's single-agent baseline, inference only",
                           model="{populora_single}/students"),
    "grounded-t": Row("fresh student on 128 questions of SOAR's teacher + hard train",
                      teacher="{soar}/teacher"),
    "opensir-t": Row("fresh student on 128 questions of the OpenSIR-style teacher + hard train",
                     teacher="{opensir}/teacher"),
    "sept": Row("fresh student, SePT: NLL on its own answers to the hard train split, no reward",
                advantages=sept_advantages, temperature="sept_temperature", kl=False,
                train_temperature=1.0),   # NLL of the model itself on its sharper samples
    "serl": Row("fresh student, SeRL: each step it writes questions (few-shot, from the hard train "
                "split), labels them by its majority vote, keeps them by quality, diversity and "
                "difficulty, and trains on them + hard train", group="serl_samples", lr="serl_lr",
                self_instruct=True),
    "upper-128": Row("fresh student on 128 questions of --extra + hard train", file="{extra}",
                     subsample=True),
    "upper": Row("fresh student on all of --extra (e.g. MATH train) + hard train", file="{extra}"),
}


def row_of(method: str, cfg: Config) -> Row:
    """ROWS[method]; a name outside ROWS is the `train` command's: a fresh student on --synthetic"""
    return ROWS.get(method) or Row(f"fresh student on {cfg.synthetic} + hard train",
                                   file="{synthetic}")


def path_of(template: str, cfg: Config) -> str:
    """a Row path with the flags it names filled in from cfg"""
    return template.format(**dataclasses.asdict(cfg))


def missing_inputs(rows: dict[str, Row], cfg: Config) -> dict[str, str]:
    """method: the flag it needs and was not given, or its input file that does not exist"""
    missing = {}
    for m, row in rows.items():
        for t in (row.model, row.teacher, row.file):
            flags = [f for f in re.findall(r"{(\w+)}", t) if f != "model" and not getattr(cfg, f)]
            if flags or "{model}" not in t and t and not os.path.exists(path_of(t, cfg)):
                missing[m] = f"--{flags[0]}" if flags else path_of(t, cfg)
        if row.keep and cfg.model and not cfg.labels:   # the built-in world labels its questions
            missing[m] = "--labels"
    return missing


def seeds(cfg: Config) -> list[int]:
    return [int(s) for s in cfg.seeds.split(",")]


def parse_args(argv=None) -> tuple[str, list[str], Config]:
    p = launch.config_parser(Config, description=__doc__,
                             epilog="rows:\n" + "\n".join(f"  {k:14} {v.about}"
                                                          for k, v in ROWS.items()))
    p.add_argument("command", choices=list(COMMANDS))
    p.add_argument("args", nargs="*",
                   help="filter: pools; row: methods; sample-teacher: a teacher; vendi: files")
    a = vars(p.parse_intermixed_args(argv))   # options anywhere: before, between and after the rows
    command = a["command"]
    args = a["args"]
    cfg = launch.config_from(Config, a)
    error = p.error if rloo.rank0() else lambda _: sys.exit(launch.USAGE_EXIT)   # rank 0 says it
    bad = launch.too_small(cfg) + ["--temperature: need T > 0"] * (cfg.temperature <= 0)
    bad += ["--serl_low, --serl_high: need 0 <= low <= high <= 1"] * (
        not 0 <= cfg.serl_low <= cfg.serl_high <= 1)
    if bad:
        error("these settings cannot work: " + "; ".join(bad))
    if command == "row" and (not args or set(args) - set(ROWS)):
        error(f"row needs methods out of: {', '.join(ROWS)}")
    if command == "train" and not (cfg.synthetic and cfg.name) or cfg.name in ROWS:
        error("train needs --synthetic FILE and --name NAME (a name that is not one of the rows)")
    return command, args, cfg


# ---- pure statistics (tested against brute force / known answers) ----

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (METHOD.md "Evaluation protocol"):
    1 - C(n-c,k)/C(n,k) as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms huge binomials."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_passk(counts: list[int], n: int, ks=KS) -> dict:
    """pass@k of a test set: the mean over problems of the per-problem estimate."""
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in counts) / len(counts)
            for k in ks if k <= n}


def mean_std(xs: list[float]) -> tuple[float, float]:
    """mean and sample std (ddof 1) over seeds; std 0 for one seed"""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def paired_ci(diffs: list[float], draws: int = 10000, level: float = 0.95,
              seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of paired differences (one per seed, resampled)."""
    d = np.asarray(diffs, float)
    means = d[np.random.default_rng(seed).integers(0, len(d), (draws, len(d)))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def slope_ci(curves: list[list[float]], draws: int = 2000,
             seed: int = 0) -> tuple[float, float, float]:
    """The least-squares slope of y over its index, pooled over curves (one per seed), and its 95%
    bootstrap CI, resampling curves (a seed's steps are not independent of each other)."""
    def slope(cs):
        x = np.concatenate([np.arange(len(c)) for c in cs])
        y = np.concatenate([np.asarray(c, float) for c in cs])
        return float(np.polyfit(x, y, 1)[0]) if len(set(x)) > 1 else 0.0
    rng = np.random.default_rng(seed)
    boot = [slope([curves[i] for i in rng.integers(0, len(curves), len(curves))])
            for _ in range(draws)]
    return slope(curves), *map(float, np.quantile(boot, [0.025, 0.975]))


def early_stop(rewards: list[float], window: int = 25, fraction: float = 0.15) -> int | None:
    """The rule of METHOD.md "Early stopping": smooth the mean training reward with a centred
    `window`-step moving average, take slopes normalised by its range, stop at the first step past
    the steepest whose slope < fraction * the max slope (a curve that starts flat, reward ~0 on hard
    problems, would else stop at step 0). None while no step qualifies (still rising, or flat)."""
    if len(rewards) < window + 1:
        return None
    smooth = np.convolve(np.asarray(rewards, float), np.ones(window) / window,
                         mode="valid")  # [i] centred on i + window//2
    span = smooth.max() - smooth.min()
    if span <= 0:
        return None
    slope = np.diff(smooth) / span   # normalised: scale-free, any reward units give the same step
    peak = int(slope.argmax())
    if slope[peak] <= 0:
        return None
    below = np.nonzero(slope[peak + 1:] < fraction * slope[peak])[0]
    return None if len(below) == 0 else int(peak + 1 + below[0] + window // 2)


def select(evals: list[dict], rewards: list[float], cfg: Config, offset: int = 0) -> dict:
    """One run's number: the test metric at --fixed_step, else its mean over the evals in [stop,
    stop + es_average] (no stop yet: the last es_average steps); the rule sees rewards[offset:]."""
    stop = None if cfg.fixed_step else early_stop(rewards[offset:], cfg.es_window, cfg.es_fraction)
    if cfg.fixed_step:
        rule, lo = "fixed", cfg.fixed_step
    elif stop is not None:
        rule, lo = "early-stop", stop + offset
    else:
        rule, lo = "last", max(0, evals[-1]["step"] - cfg.es_average)
    hi = lo if cfg.fixed_step else lo + cfg.es_average
    rows = ([e for e in evals if lo <= e["step"] <= hi]
            or [min(evals, key=lambda e: abs(e["step"] - lo))])
    keys = [k for k in rows[0] if k.startswith("pass@")]
    return dict(rule=rule, stop_step=lo, window=[lo, hi], evals_used=[e["step"] for e in rows],
                passk={k: statistics.fmean(e[k] for e in rows) for k in keys})


def finished(rewards: list[float], step: int, cfg: Config, offset: int = 0) -> bool:
    """May a fresh-student run end before `step`? At --fixed_step, or once the early-stopping step
    on the rewards so far has its averaging window behind it (which the final rule then reports)."""
    if cfg.fixed_step:
        return step >= cfg.fixed_step
    stop = early_stop(rewards[offset:], cfg.es_window, cfg.es_fraction)
    return stop is not None and step >= stop + offset + cfg.es_average


def batch_at(step: int, synthetic: list[dict], real: list[dict], cfg: Config, seed: int):
    """(source, pool, indices) of step `step` (indices for the uniform sampler), pure in (seed,
    step) so a resume replays exactly. mixed: one pool (synthetic + real), reshuffled each epoch;
    curriculum (METHOD.md "Evaluation protocol"): synthetic for switch_step steps, then real."""
    if cfg.mode == "curriculum" and step < cfg.switch_step:
        source, pool, i = "synthetic", synthetic, step
    elif cfg.mode == "curriculum":
        source, pool, i = "real", real, step - cfg.switch_step
    else:
        source, pool, i = "mixed", synthetic + real, step
    idx = []
    for pos in range(i * cfg.student_questions, (i + 1) * cfg.student_questions):
        epoch, j = divmod(pos, len(pool))
        order = list(range(len(pool)))
        random.Random(f"{seed}/{source}/{epoch}").shuffle(order)
        idx.append(order[j])
    return source, pool, idx


def leeps(n: int, emb: np.ndarray, history: list[dict], size: int, rng: random.Random):
    """LEEPS (METHOD.md "LEEPS"): `size` of the n pool questions, with portfolios. exploit: those
    whose last group had reward variance, least recently drawn first; explore: the rest, most
    promising first by the cosine-weighted share of such groups among their LEEPS_NEIGHBOURS nearest
    drawn neighbours (`emb` rows). The budget splits by each portfolio's share of such groups in the
    last LEEPS_WINDOW steps. history: earlier steps' questions, portfolio, nontrivial."""
    last = {}   # question: was its last group non-trivial
    when = {}   # question: the step it was last drawn
    for s, h in enumerate(history):
        for i, nt in zip(h["questions"], h["nontrivial"]):
            last[i] = nt
            when[i] = s
    recent = [(p, nt) for h in history[-LEEPS_WINDOW:]
              for p, nt in zip(h["portfolio"], h["nontrivial"])]
    ratio = {p: (sum(nt for q, nt in recent if q == p) + 1) / (sum(q == p for q, _ in recent) + 2)
             for p in ("exploit", "explore")}
    exploit = sorted((i for i, nt in last.items() if nt), key=lambda i: (when[i], rng.random()))
    exploit = exploit[:round(size * ratio["exploit"] / (ratio["exploit"] + ratio["explore"]))]
    explore = [i for i in range(n) if not last.get(i)]
    seen = sorted(last)
    if seen and explore:  # neighbours' similarity-weighted, Laplace-smoothed non-trivial share
        sim = np.maximum(emb[explore] @ emb[seen].T, 0)
        near = np.argsort(-sim, axis=1)[:, :LEEPS_NEIGHBOURS]
        w = np.take_along_axis(sim, near, 1)
        outcome = np.array([last[i] for i in seen], dtype=float)[near]
        promise = ((w * outcome).sum(1) + 1) / (w.sum(1) + 2)
    else:
        promise = np.full(len(explore), 0.5)
    explore = [i for _, _, i in sorted(zip(-promise, [rng.random() for _ in explore], explore))]
    chosen = (exploit + explore)[:size]
    return chosen, (["exploit"] * len(exploit[:size])
                    + ["explore"] * (len(chosen) - len(exploit[:size])))


# ---- on the engines (every rank calls these; generation and grading are split over ranks) ----

def eval_passk(llm, test: list[dict], cfg: Config, seed: int, key) -> dict:
    counts = rloo.count_correct(llm, test, prompt=data.student_prompt, correct=data.solved,
                                n=cfg.passk_samples, max_tokens=cfg.student_max_tokens,
                                temperature=cfg.temperature, group=dist.group.WORLD,
                                seed=rloo.seed_of(seed, "passk", key))
    return {**mean_passk(counts, cfg.passk_samples), "solved": sum(c > 0 for c in counts)}


def members(path: str) -> list[str]:
    """the models in `path`: itself, or for a population's folder (populora.py's students/) each
    member's adapter folder"""
    if os.path.exists(os.path.join(path, "config.json")) or lora.adapter_rank(path):
        return [path]
    return [os.path.join(path, name) for name in sorted(os.listdir(path))
            if "." not in name]   # (not the versions, <name>.v<N>, the names link to)


def check_adapter_bases(paths: list[str], cfg: Config) -> None:
    """Every PEFT adapter folder among `paths` (--soar's, --populora's, --intrinsic's, --opensir's)
    must have been trained on --model: the engine serves adapters on --model's weights, and on other
    weights one measures something else, silently."""
    for path in paths:
        base = lora.adapter_base(path)
        if base and os.path.realpath(base) != os.path.realpath(cfg.model):
            raise launch.UsageError(f"{path} is an adapter of {base}, not of --model {cfg.model}")


def serve(path: str, llm) -> None:
    """The model in `path` into the engines: a PEFT adapter folder (a LoRA run's teacher/ or
    student/) as an adapter on --model's weights (put back first if a full folder replaced them),
    else an HF folder's full weights, read by the engine's own loader (no trainer is built)."""
    if lora.adapter_rank(path):
        lora.serve_adapter(llm, path)
    else:
        rloo_extras.serve_hf(llm, path)


def teacher_questions(path: str, cfg: Config, seed: int, llm, tok) -> list[dict]:
    """cfg.teacher_questions questions of the teacher in `path`, with SOAR's teacher prompt and
    format filter (METHOD.md "Evaluation protocol": same prompt and filter), in two turns if it was
    trained so (answer_form)."""
    serve(path, llm)
    seeds = [rloo.seed_of(seed, "eval", "teacher", i) for i in range(TEACHER_ROUNDS)]
    form = answer_form(path)
    how = dict(max_tokens=cfg.teacher_max_tokens, temperature=cfg.temperature,
               group=dist.group.WORLD)
    if form:
        draw = rloo_extras.turns_of(llm, data.teacher_prompt(tok),
                             answer_prompt=data.answer_prompt(tok, form), stop=data.QUESTION_STOP,
                             turn_end=data.question_end, **how)
    else:
        draw = rloo.samples_of(llm, data.teacher_prompt(tok), **how)
    kept, _ = rloo.sample_until(draw, need=cfg.teacher_questions, parse=data.parse_teacher_batch,
                                round_seeds=seeds, group=dist.group.WORLD,
                                what=f"the format filter of data.TEACHER_PROMPT ({path})")
    return [{"question": q, "answer": a} for _, (q, a) in kept]


def writing_prompts(cfg: Config, tok, seed_set: list[dict], kept: list[str],
                    rng: random.Random) -> list:
    """SeRL's question-writing prompts of a step: each lists --serl_shots examples, SERL_OWN_SHOTS
    of its kept questions (when it has them) and the rest from the seed set; with --serl_shots 0
    (the built-in world's model follows only it), SOAR's teacher prompt."""
    if not cfg.serl_shots:
        return [data.teacher_prompt(tok)] * cfg.serl_prompts
    prompts = []
    for _ in range(cfg.serl_prompts):
        shots = rng.sample(kept, min(SERL_OWN_SHOTS, len(kept)))
        shots += [q["question"] for q in rng.sample(seed_set, min(cfg.serl_shots - len(shots),
                                                                  len(seed_set)))]
        rng.shuffle(shots)
        prompts.append(data.fewshot_prompt(tok, shots))
    return prompts


def self_instruct(cfg: Config, seed: int, step: int, llm, tok, seed_set: list[dict],
                  metrics: list[dict]) -> dict:
    """SeRL's data of one step (METHOD.md "SeRL"), written by the weights in the engine, in rounds
    until --serl_questions are kept (at most --serl_rounds rounds): each round writes the questions
    of --serl_prompts prompts, keeps those that pass the quality filter and the diversity filter
    (against the seed set and the questions this step accepted before them), and of those the ones
    whose majority vote over --serl_samples answers is in the difficulty bounds, labelled with its
    answer. Returns the metrics row's `generated` (question, answer, share; at most
    --serl_questions) and `serl` (how many passed each filter, and the rounds)."""
    kept = [q["question"] for m in metrics for q in m["generated"]]   # few-shot examples
    seen = [p["question"] for p in seed_set]
    accepted = []   # the step's questions past the diversity filter
    generated = []
    counts = dict(written=0, quality=0, diverse=0, difficulty=0, rounds=0)
    for r in range(cfg.serl_rounds):
        written = write_questions(cfg, seed, step, r, llm, tok, seed_set, kept)
        good = [q for q in dict.fromkeys(written) if data.serl_quality(q)]
        diverse = []   # similarity = 1 - novelty
        for q, new in zip(good, data.novelty(good, seen)):
            if max(1 - new, 1 - data.novelty([q], accepted)[0]) <= cfg.serl_similarity:
                accepted.append(q)
                diverse.append(q)
        outs = rloo.generate(llm, [data.student_prompt(q) for q in diverse], n=cfg.serl_samples,
                             temperature=cfg.temperature, max_tokens=cfg.student_max_tokens,
                             seed=rloo.seed_of(seed, "serl-vote", step, r),
                             group=dist.group.WORLD)
        votes = rloo.split_map(data.majority_labels, [[s.text for s in o] for o in outs],
                               dist.group.WORLD)
        labelled = serl_kept(diverse, votes, cfg)
        generated += labelled
        for key, passed in (("written", written), ("quality", good), ("diverse", diverse),
                            ("difficulty", labelled)):
            counts[key] += len(passed)
        counts["rounds"] += 1
        if len(generated) >= cfg.serl_questions:
            break
    return {"generated": generated[:cfg.serl_questions], "serl": counts}


def write_questions(cfg: Config, seed: int, step: int, r: int, llm, tok, seed_set: list[dict],
                    kept: list[str]) -> list[str]:
    """round r of a step's question writing (SeRL's): the questions of --serl_prompts samples of
    its prompts (writing_prompts), read as numbered items, or with --serl_shots 0 by the format
    filter (its answer unused: the vote labels the question)"""
    rng = random.Random(f"{seed}/serl/{step}/{r}")
    outs = rloo.generate(llm, writing_prompts(cfg, tok, seed_set, kept, rng),
                         temperature=cfg.serl_temperature, max_tokens=cfg.serl_max_tokens,
                         seed=rloo.seed_of(seed, "serl", step, r), group=dist.group.WORLD)
    texts = [o[0].text for o in outs]
    if cfg.serl_shots:
        return [q for t in texts for q in data.numbered_questions(t, cfg.serl_shots + 1)]
    return [p[0] for p in rloo.split_map(data.parse_teacher_batch, texts, dist.group.WORLD)
            if p is not None]


def serl_update(cfg: Config, policy, llm, batch: list[tuple[str, str]], seed: int) -> dict:
    """SeRL's RL step on one rollout batch (METHOD.md "SeRL"), as its OpenRLHF template runs it:
    --student_samples completions per question (the row's: --serl_samples) and SeRL's reward, 1 if
    a completion's answer verifies against the label, else 0; RLOO's leave-one-out baseline on it,
    clipped to +-SERL_REWARD_CLIP; the KL to the base model as a per-token penalty in the reward, so
    a token's return is the rollout's advantage minus serl_kl times the KL (log p - log p_ref) of it
    and every later token (--serl_kl 0: no penalty, no reference); the returns whitened over the
    batch's tokens; then one PPO update (rloo.ppo_loss, clip --serl_clip) per --serl_train_batch
    rollouts, in a shuffled order, each against the log-probs the policy gave them before the
    first: rl_step's path for several updates (rloo.minibatches, rloo.update_minibatches). Returns
    rl_step's stats (the updates' means, the harness's rewards) and `updates`."""
    group = dist.group.WORLD
    k = cfg.student_samples
    with rloo.timed("sync"):
        rloo.sync_weights(policy, llm)
    flat, rewards = rloo.rollouts(llm, batch, prompt=data.student_prompt, reward=data.grade,
                                  samples=k, max_tokens=cfg.student_max_tokens, seed=seed,
                                  temperature=cfg.temperature, group=group)
    table = serl_rewards(rewards, k)
    shaped = serl_advantages(table).flatten().tolist()
    batches = rloo.minibatches(len(flat), cfg.serl_train_batch, seed, group)
    mine = [i for rows in batches for i in rows]
    samples = [smp for smp, _ in flat]
    opts = dict(temperature=cfg.temperature, micro_batch_tokens=cfg.micro_batch_tokens)
    old = rloo.rows_logprobs(policy, policy.model, samples, mine, **opts)
    ref = old   # --serl_kl 0: no reference, and log p - log p_ref = 0
    if cfg.serl_kl:
        ref = rloo.rows_logprobs(policy, policy.ref, samples, mine, **opts)
    returns = [kl_returns(shaped[i], old[i], ref[i], cfg.serl_kl) for i in mine]
    adv = dict(zip(mine, whiten(returns, group, policy.device)))
    stats = rloo.update_minibatches(policy, samples, adv, batches,
                                    loss=functools.partial(rloo.ppo_loss, clip=cfg.serl_clip),
                                    old_logprobs=old, **opts)
    return {**stats, "updates": len(batches), "reward": statistics.fmean(rewards),
            "rewards": rewards, "nontrivial": (table.std(1) > 0).tolist()}


def serl_rewards(rewards: list[float], k: int) -> torch.Tensor:
    """SeRL's reward of each completion, [questions, k]: 1 if it verifies against the label (the
    harness's R_CORRECT), else 0"""
    return (torch.tensor(rewards, dtype=torch.float64) == data.R_CORRECT).double().view(-1, k)


def serl_advantages(table: torch.Tensor) -> torch.Tensor:
    """RLOO's value of each completion (rloo.rloo_advantages), clipped to +-SERL_REWARD_CLIP as
    OpenRLHF clips a reward before its KL penalty is added"""
    return rloo.rloo_advantages(table).clamp(-SERL_REWARD_CLIP, SERL_REWARD_CLIP)


def kl_returns(advantage: float, logp: list[float], ref_logp: list[float],
               kl_coef: float) -> list[float]:
    """SeRL's (OpenRLHF's) per-token return of one rollout: its advantage, less kl_coef times the
    KL estimate log p - log p_ref of this token and every later one (METHOD.md "SeRL")"""
    penalty = [-kl_coef * (p - r) for p, r in zip(logp, ref_logp)]
    returns = []
    total = advantage
    for x in reversed(penalty):
        total += x
        returns.append(total)
    return returns[::-1]


def whiten(rows: list[list[float]], group, dev) -> list[list[float]]:
    """the values of this rank's rows less the mean of every rank's, over their standard deviation
    (OpenRLHF's: sqrt(max(variance, SERL_VAR_FLOOR)), so a batch of equal values stays small)"""
    flat = [x for row in rows for x in row]
    moments = torch.tensor([len(flat), sum(flat), sum(x * x for x in flat)], dtype=torch.float64,
                           device=dev)
    dist.all_reduce(moments, group=group)
    n, total, squares = moments.tolist()
    mean = total / max(n, 1.0)
    std = math.sqrt(max(squares / max(n, 1.0) - mean * mean, SERL_VAR_FLOOR))
    return [[(x - mean) / std for x in row] for row in rows]


def serl_kept(questions: list[str], votes: list[tuple[str | None, float]],
              cfg: Config) -> list[dict]:
    """SeRL's difficulty filter: the questions whose majority answer's share of the votes lies in
    [--serl_low, --serl_high], labelled with that answer (data.majority_labels)"""
    return [{"question": q, "answer": answer, "share": share}
            for q, (answer, share) in zip(questions, votes)
            if answer is not None and cfg.serl_low <= share <= cfg.serl_high]


def answer_form(path: str) -> str | None:
    """The p' form (data.answer_prompt) of the teacher in `path` if soar.py trained it in two turns
    (--teacher_turns 2): its soar.json says so wherever the folder is; a teacher/ written before
    soar.json did, its run's config. None for one turn and for any other model."""
    path = os.path.normpath(path)
    tag = os.path.join(path, "soar.json")
    config = data.read_json(tag) if os.path.exists(tag) else {}
    if "teacher_turns" not in config and os.path.basename(path) == "teacher":
        config = soar_config(os.path.dirname(path)) or {}
    return config["answer_prompt"] if config.get("teacher_turns", 1) == 2 else None


# ---- one run folder ----

def inference_run(cfg: Config, seed: int, method: str, path: str, llm, test,
                  out: str) -> dict:
    """base / ps / populora rows: pass@k of the model in `path` on the test split, sampling seed
    `seed`; of a population (members), each member's (in `members`) and their mean."""
    per_member = {}
    for model in members(path):
        serve(model, llm)
        per_member[os.path.basename(model)] = {
            k: v for k, v in eval_passk(llm, test, cfg, seed, "inference").items()
            if k.startswith("pass@")}
    passk = {k: statistics.mean(p[k] for p in per_member.values())
             for k in next(iter(per_member.values()))}
    res = dict(method=method, test=cfg.test, seed=seed, model=path, passk=passk)
    if len(per_member) > 1:
        res["members"] = per_member
    if rloo.rank0():
        data.write_json(os.path.join(out, "result.json"), res)
    return res


def fresh_student(cfg: Config, row: Row, mesh, out: str, config: dict):
    """(policy, step): the base model at step 0, or where out/ckpt left it (and its rows files).
    SeRL's takes several updates a step (serl_update): its schedule counts them, up to the most a
    step can take, and it keeps its KL reference for the reward's penalty, none in its loss."""
    warmup = 0 if cfg.mode == "curriculum" else cfg.student_warmup
    updates = 1   # per step
    kl_coef = cfg.kl_coef if row.kl else 0.0
    if row.self_instruct:
        rollouts = (cfg.student_questions + cfg.serl_questions) * cfg.student_samples
        updates = -(-rollouts // cfg.serl_train_batch)
        kl_coef = cfg.serl_kl
    opts = dict(lr=cfg.student_lr, warmup_steps=warmup * updates,
                total_steps=cfg.student_steps * updates, kl_coef=kl_coef, prompts=cfg.prompt_pass,
                activation_checkpointing=cfg.activation_checkpointing)
    if cfg.lora_rank:
        policy = lora.load_policy(cfg.model, mesh, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                                  seed=rloo.seed_of(config["seed"], "adapter"), **opts)
    else:
        policy = rloo.load_policy(cfg.model, mesh, **opts)
    if row.self_instruct:
        policy.kl_coef = 0.0   # its reference serves serl_update's penalty, not the loss
        for group in policy.optimizer.param_groups:
            group["betas"] = SERL_ADAM_BETAS
    ckpt, state = launch.resume(out, config, MAY_CHANGE)
    if ckpt:
        rloo_extras.load_state(policy, os.path.join(ckpt, "policy"))
    launch.restore_rows(out, ckpt, ("metrics.jsonl", "evals.jsonl"))   # only the ckpt's steps
    return policy, (state["step"] if ckpt else 0)


def student_step(cfg: Config, row: Row, seed: int, step: int, policy, llm, tok, synthetic, real,
                 metrics: list[dict], emb: dict) -> dict:
    """One RLOO step of a fresh student on its sampler's questions (SeRL: and on the questions it
    writes, self_instruct()): the step's metrics row."""
    t0 = time.perf_counter()
    launch.METER.reset()   # this step's counts only (not the evaluation's nor another run's)
    faults = data.grading_faults()
    source, pool, idx = batch_at(step, synthetic, real, cfg, seed)
    portfolio = None
    if cfg.sampler == "leeps":   # history: the metrics rows of earlier steps on this pool
        if source not in emb:   # once per pool, not every step
            emb[source] = data.embed_ngram([q["question"] for q in pool])
        history = [m for m in metrics if m["source"] == source]
        idx, portfolio = leeps(len(pool), emb[source], history, cfg.student_questions,
                               random.Random(f"{seed}/leeps/{step}"))
    sampler_s = time.perf_counter() - t0
    batch = [(pool[i]["question"], pool[i]["answer"]) for i in idx]
    written = {}
    if row.self_instruct:   # the questions are written by the weights of this step
        rloo.sync_weights(policy, llm)
        with rloo.timed("self_instruct"):   # its tokens: tokens/generated/self_instruct
            written = self_instruct(cfg, seed, step, llm, tok, real, metrics)
        batch += [(q["question"], q["answer"]) for q in written["generated"]]
        stats = serl_update(cfg, policy, llm, batch, rloo.seed_of(seed, "student", step))
    else:
        stats = rloo.rl_step(policy, llm, batch, prompt=data.student_prompt, reward=data.grade,
                             samples=cfg.student_samples,
                             temperature=getattr(cfg, row.temperature),
                             max_tokens=cfg.student_max_tokens, group=dist.group.WORLD,
                             seed=rloo.seed_of(seed, "student", step),
                             micro_batch_tokens=cfg.micro_batch_tokens, advantages=row.advantages,
                             loss=rloo.rloo_loss, train_temperature=row.train_temperature)
    sample_rewards = stats.pop("rewards")
    stats["accuracy"] = statistics.fmean(r == data.R_CORRECT for r in sample_rewards)
    return {"step": step, "source": source, "questions": idx, "portfolio": portfolio, **stats,
            **written, "nontrivial_share": statistics.fmean(stats["nontrivial"]),
            "skipped_updates": 0,
            **launch.step_counts(faults), "sampler_seconds": round(sampler_s, 4),
            "seconds": round(time.perf_counter() - t0, 3)}


def train_run(cfg: Config, seed: int, method: str, row: Row, synthetic, real, test, llm, tok,
              mesh, out: str) -> dict:
    """A fresh student from the base model on synthetic + real (METHOD.md "Evaluation protocol") as
    `row` says (group, advantages, temperature, KL), on its sampler's questions, test pass@k every
    eval_every steps, until early stopping (or --fixed_step, --student_steps) fixes the row's
    number. Resumes from out/ckpt; writes out/result.json."""
    cfg = dataclasses.replace(cfg, student_samples=getattr(cfg, row.group),
                              student_lr=getattr(cfg, row.lr),
                              sampler=row.sampler or cfg.sampler,
                              mode=cfg.mode if synthetic else "mixed")  # hard-only: hard split only
    offset = cfg.switch_step if cfg.mode == "curriculum" else 0  # the rule sees the real-only phase
    config = {**dataclasses.asdict(cfg), "seed": seed, "method": method}
    policy, step = fresh_student(cfg, row, mesh, out, config)
    metrics_path = os.path.join(out, "metrics.jsonl")
    evals_path = os.path.join(out, "evals.jsonl")
    rloo.print0(f"{method} seed {seed}: {len(synthetic)} synthetic + {len(real)} real questions, "
                f"{cfg.mode}, group {cfg.student_samples}; "
                f"{'resuming at' if step else 'starting at'} step {step} -> {out}")
    dist.barrier()
    metrics = data.read_jsonl(metrics_path)
    evals = data.read_jsonl(evals_path)
    rewards = [m["reward"] for m in metrics]
    committed = (len(metrics), len(evals))   # the rows the last checkpoint holds
    emb = {}   # leeps: the question embeddings of each pool
    with tqdm(total=cfg.student_steps, initial=step, disable=not rloo.rank0(), desc=method,
              dynamic_ncols=True) as bar:
        while True:
            if step % cfg.eval_every == 0 or step == cfg.fixed_step or step == cfg.student_steps:
                rloo.sync_weights(policy, llm)
                evals.append({"step": step, **eval_passk(llm, test, cfg, seed, step)})
                if rloo.rank0():
                    data.append_jsonl(evals_path, [evals[-1]])
            if step >= cfg.student_steps or finished(rewards, step, cfg, offset):
                break
            metrics.append(student_step(cfg, row, seed, step, policy, llm, tok, synthetic, real,
                                        metrics, emb))
            rewards.append(metrics[-1]["reward"])
            if rloo.rank0():
                data.append_jsonl(metrics_path, metrics[-1:])
            step += 1
            bar.update(1)
            bar.set_postfix(reward=f"{rewards[-1]:.1f}", acc=f"{metrics[-1]['accuracy']:.3f}")
            if step % cfg.ckpt_every == 0:
                launch.save_checkpoint(out, step, {"policy": (policy, True)},
                                       {"step": step, "config": config},
                                       rows={"metrics.jsonl": metrics[committed[0]:],
                                             "evals.jsonl": evals[committed[1]:]})
                committed = (len(metrics), len(evals))
    res = dict(method=os.path.basename(os.path.dirname(out)), test=cfg.test, seed=seed,
               mode=cfg.mode, samples=cfg.student_samples, steps_done=step,
               n_synthetic=len(synthetic), n_real=len(real), sampler=cfg.sampler,
               nontrivial_share=(statistics.fmean(m["nontrivial_share"] for m in metrics)
                                 if metrics else None), **select(evals, rewards, cfg, offset))
    if rloo.rank0():
        if row.self_instruct:   # SeRL's kept questions, for the report's Vendi scores
            data.write_jsonl(os.path.join(out, "questions.jsonl"),
                             [q for m in metrics for q in m["generated"]])
        data.write_json(os.path.join(out, "result.json"), res)
        shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)  # its optimizer state: large
    dist.barrier()
    return res


# ---- commands that need the engines ----

def setup(cfg: Config, question_sets: list[list[dict]], teacher: bool = False,
          engine_share: float | None = None, served=(), fewshot_from=()):
    """mesh (one FSDP mesh over all ranks: the student is sharded over all, each rank's engine makes
    its share), tokenizer and a per-rank engine fitting the longest question plus a completion and,
    if `teacher`, a teacher prompt (and the p' of a two-turn teacher among `served`) plus its sample
    and such a sample as a question; with `fewshot_from` (SeRL's seed set), a few-shot prompt of its
    longest questions and of its own written ones, plus a sample. The engine serves adapters of up
    to --lora_rank and of the PEFT folders among the paths `served`."""
    _, world_size, device = rloo.init_distributed()
    mesh = init_device_mesh(device.type, (world_size,))
    tok = launch.tokenizer(cfg.model)
    answer_prompts = [data.answer_prompt(tok, f) for f in map(answer_form, served) if f]
    writes = max(cfg.teacher_max_tokens if teacher else 0,
                 cfg.serl_max_tokens if fewshot_from else 0)   # a written question, at most
    seq_len = data.engine_len(tok, [q["question"] for qs in question_sets for q in qs],
                              cfg.student_max_tokens, writes,
                              max(answer_prompts, key=len, default=[]))
    if fewshot_from and cfg.serl_shots:   # (its own written questions: a sample each, at most)
        longest = sorted((q["question"] for q in fewshot_from),
                         key=lambda q: len(tok(q).input_ids))[-cfg.serl_shots:]
        seq_len = max(seq_len, len(data.fewshot_prompt(tok, longest)) + 16
                      + (SERL_OWN_SHOTS + 1) * cfg.serl_max_tokens)
    if cfg.micro_batch_tokens < seq_len:
        raise launch.UsageError(f"--micro_batch_tokens {cfg.micro_batch_tokens} is less "
                                f"than one sequence (prompt + completion: up to {seq_len} tokens)")
    llm = rloo.build_engine(cfg.model, seed=seeds(cfg)[0], max_model_len=seq_len,
                            gpu_memory_utilization=engine_share or cfg.gpu_memory_utilization,
                            verbose=cfg.verbose, **lora.engine_args(
                                max([cfg.lora_rank] + [lora.adapter_rank(p) for p in served]), 2))
    return mesh, tok, llm


def run_dir(cfg: Config, method: str, seed: int) -> str:
    """<runs>/<method>[+leeps]/seed<s>; "+leeps" marks a fresh student on LEEPS (row name too)"""
    row = row_of(method, cfg)
    leeps = not row.model and (row.sampler or cfg.sampler) == "leeps"
    return os.path.join(cfg.runs, method + "+leeps" * leeps, f"seed{seed}")


def done(cfg: Config, method: str, seed: int) -> bool:
    return os.path.exists(os.path.join(run_dir(cfg, method, seed), "result.json"))


def cmd_row(cfg: Config, methods: list[str]) -> None:
    """The rows `methods` x seeds, each into its run folder, each as its ROWS entry says."""
    if all(done(cfg, m, s) for m in methods for s in seeds(cfg)):   # before any engine is built
        rloo.print0(f"{cfg.runs}: {', '.join(methods)} x seeds {cfg.seeds}: all finished "
                    "already; nothing to do")
        return
    rows = {m: row_of(m, cfg) for m in methods}
    if missing := missing_inputs(rows, cfg):   # before the world is built
        raise launch.UsageError(f"missing inputs (method: path or flag): {missing}")
    for path in {path_of(t, cfg) for r in rows.values() for t in (r.model, r.teacher)
                 if t and os.path.basename(t) in ("teacher", "student")}:   # a soar.py run's
        if behind := launch.hf_behind(os.path.dirname(path), names=[os.path.basename(path)]):
            raise launch.UsageError(f"{behind[0]} is behind its run's checkpoint: rerun "
                                    "that soar.py command to finish writing it")
    cfg = world.resolve(cfg)
    soar = soar_config(cfg.soar) if any("{soar}" in t for r in rows.values()
                                        for t in (r.model, r.teacher, r.file)) else None
    # SOAR's outputs only mean something against the base model SOAR started from
    if soar and os.path.realpath(soar["model"]) != os.path.realpath(cfg.model):
        raise launch.UsageError(f"{cfg.soar} was run from {soar['model']}, "
                                f"not from --model {cfg.model}")
    served = [m for r in rows.values() for t in (r.model, r.teacher)
              if t and "{model}" not in t for m in members(path_of(t, cfg))]
    check_adapter_bases(served, cfg)
    if not (cfg.train and cfg.test):
        raise launch.UsageError("--train and --test are required with --model: "
                                "the fail@128 train and test splits")
    rloo.init_distributed()   # rank 0 reads the problems (load_problems drops some on timeouts)
    hard = launch.problems(cfg.train)
    test = launch.problems(cfg.test)
    files = {r.file: launch.problems(path_of(r.file, cfg)) for r in rows.values() if r.file}
    mesh, tok, llm = setup(cfg, [hard, test, *files.values()],
                           teacher=any(r.teacher or r.self_instruct for r in rows.values()),
                           served=served,
                           fewshot_from=hard if any(r.self_instruct for r in rows.values()) else ())
    for method, row in rows.items():
        for seed in seeds(cfg):
            out = run_dir(cfg, method, seed)
            launch.lock_folder(out)   # one process per run folder
            if done(cfg, method, seed):
                rloo.print0(f"{out}: finished already")
                continue
            if row.model:
                res = inference_run(cfg, seed, method, path_of(row.model, cfg), llm, test, out)
            else:
                synthetic = row_questions(cfg, row, seed, files, out, llm, tok)
                if row.file and not synthetic:
                    rloo.print0(f"{method}: skipped, {path_of(row.file, cfg)} "
                                "has no such questions yet")
                    continue
                res = train_run(cfg, seed, method, row, synthetic, hard, test, llm, tok, mesh,
                                out)
            rloo.print0(f"{method} seed {seed}: " + "  ".join(f"{k} {100 * v:.1f}%"
                                                                for k, v in res["passk"].items()))
    log_tables(cfg, [data.read_json(os.path.join(run_dir(cfg, m, s), "result.json"))
                     for m in methods for s in seeds(cfg) if done(cfg, m, s)])


def row_questions(cfg: Config, row: Row, seed: int, files: dict, out: str, llm,
                  tok) -> list[dict]:
    """The question set a fresh student of `row` adds to the hard train split, for seed `seed`."""
    synthetic = files.get(row.file, [])
    if row.teacher:  # teacher questions: sampled once per seed, kept in the run folder
        qpath = os.path.join(out, "questions.jsonl")
        synthetic = data.read_jsonl(qpath)
        if not synthetic:
            synthetic = teacher_questions(path_of(row.teacher, cfg), cfg, seed, llm, tok)
            if rloo.rank0():
                data.write_jsonl(qpath, synthetic)
    if row.keep:
        synthetic = pq_subset(synthetic, row.keep, cfg)
    if row.subsample:
        synthetic = random.Random(f"{seed}/upper").sample(
            synthetic, min(cfg.teacher_questions, len(synthetic)))
    return synthetic


def pq_subset(pq: list[dict], which: str, cfg: Config) -> list[dict]:
    """The PQ of row pq-correct (`which` "correct": answer right) or pq-wellposed ("wellposed":
    complete and solvable, answer right or not; the paper's appendix C.5), as labelled by --labels
    (jsonl: question, correct, well_posed; e.g. by a judge) or else world.describe."""
    key = "correct" if which == "correct" else "well_posed"
    if not cfg.labels:
        return [q for q in pq if world.describe(q["question"], q["answer"])[key]]
    labels = {r["question"]: r for r in data.read_jsonl(cfg.labels)}
    if missing := [q["question"] for q in pq if key not in labels.get(q["question"], {})]:
        raise ValueError(f"{cfg.labels} has no {key!r} label for {len(missing)} promotion "
                         f"questions, e.g. {missing[0]!r}")
    return [q for q in pq if labels[q["question"]][key]]


def cmd_sample_teacher(cfg: Config, args: list[str]) -> None:
    cfg = world.resolve(cfg)
    path = args[0] if args else os.path.join(cfg.soar, "teacher")
    if not cfg.out:
        raise launch.UsageError("sample-teacher needs --out FILE")
    check_adapter_bases([path], cfg)
    _, tok, llm = setup(cfg, [], teacher=True, served=[path])
    qs = teacher_questions(path, cfg, seeds(cfg)[0], llm, tok)
    if rloo.rank0():
        data.write_jsonl(cfg.out, qs)
        print(f"wrote {len(qs)} questions of {path} to {cfg.out}")


def counted(path: str) -> list[dict]:
    """a filter's counts.jsonl up to its first row that is not the next problem's (a line cut by a
    kill, garbage), the file rewritten to those rows"""
    lines = open(path, encoding="utf-8", errors="replace").readlines() \
        if os.path.exists(path) else []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            break
        if not (isinstance(row, dict) and row.get("index") == len(rows)
                and isinstance(row.get("correct"), int)):
            break
        rows.append(row)
    if len(rows) < len(lines):
        print(f"{path}: {len(lines) - len(rows)} lines from line {len(rows) + 1} on are cut or "
              "garbage: dropped, to be counted again", file=sys.stderr)
    data.write_jsonl(path, rows)
    return rows


def cmd_filter(cfg: Config, pools: list[str]) -> None:
    """fail@128 (METHOD.md "Data"): for each pool, keep the problems the model never solves in
    filter_samples tries, split them 50/50 (seeded). Writes <out>/<pool>/ counts.jsonl (per problem,
    appended per chunk: a rerun continues), train.jsonl, test.jsonl, filter.json."""
    if not (cfg.model and cfg.out and pools):
        raise launch.UsageError("filter needs pools (math, harp, olympiad or files), --model "
                                "and --out")
    rloo.init_distributed()
    problems = {p: launch.problems(p) for p in pools}
    mesh, tok, llm = setup(cfg, list(problems.values()), engine_share=0.9)   # no trainer beside
    n = cfg.filter_samples
    chunk = max(1, 8192 // n)   # problems per call: about 8192 samples
    sizes = [len(probs) for probs in problems.values()]
    for index, (pool, probs) in enumerate(problems.items()):
        out = os.path.join(cfg.out, os.path.splitext(os.path.basename(pool))[0])
        counts_path = os.path.join(out, "counts.jsonl")
        have = launch.on_rank0(counted, counts_path)
        rloo.print0(f"{pool}: {len(probs)} problems, {len(have)} done")
        for lo in tqdm(range(len(have), len(probs), chunk), disable=not rloo.rank0(), desc=pool,
                       dynamic_ncols=True):
            counts = rloo.count_correct(llm, probs[lo:lo + chunk], prompt=data.student_prompt,
                                        correct=data.solved, n=n,
                                        max_tokens=cfg.student_max_tokens,
                                        seed=filter_seed(cfg, sizes, index, lo),
                                        temperature=cfg.temperature, group=dist.group.WORLD)
            if rloo.rank0():
                data.append_jsonl(counts_path, [{"index": lo + i, "correct": c}
                                                for i, c in enumerate(counts)])
            dist.barrier()
        counts = [r["correct"] for r in data.read_jsonl(counts_path)]
        hard = [p for p, c in zip(probs, counts) if c == 0]
        train, test = data.split_train_test(hard, cfg.split_seed)
        if rloo.rank0():
            data.write_jsonl(os.path.join(out, "train.jsonl"), train)
            data.write_jsonl(os.path.join(out, "test.jsonl"), test)
            data.write_json(os.path.join(out, "filter.json"),
                            dict(pool=pool, model=cfg.model, samples=n, problems=len(probs),
                                 kept=len(hard), train=len(train), test=len(test)))
            print(f"{pool}: {len(hard)} of {len(probs)} never solved in {n} samples -> "
                  f"{len(train)} train / {len(test)} test in {out}")


def filter_seed(cfg: Config, sizes: list[int], pool: int, lo: int) -> int:
    """The seed of cmd_filter's call on problems lo.. of pool number `pool` (of pools of `sizes`
    problems, in the order given): the problems of all pools in a row, each filter_samples seeds
    after the one before (count_correct: problem i of a call draws seed + i * n + j, j < n), so no
    two samples of a filter share a seed, across chunks, problems and pools."""
    return rloo.seed_of(seeds(cfg)[0], "filter") + (sum(sizes[:pool]) + lo) * cfg.filter_samples


# ---- commands that need no engine ----

def vendi_of(questions: list[str], cfg: Config) -> tuple[float, float]:
    return data.vendi_bootstrap(data.embed(questions, cfg.embed), cfg.vendi_subset, cfg.vendi_draws)


def cmd_vendi(cfg: Config, files: list[str]) -> None:
    for f in files:
        qs = [q["question"] for q in data.load_problems(f)]
        if not qs:
            raise ValueError(f"{f} has no questions")
        print(f"{f}: Vendi {'{:.2f} +- {:.2f}'.format(*vendi_of(qs, cfg))} ({len(qs)} questions, "
              f"subsets of {min(len(qs), cfg.vendi_subset)}, embedding {cfg.embed})")


def ordered(methods) -> list[str]:
    return sorted(methods, key=lambda m: (list(ROWS).index(m) if m in ROWS else len(ROWS), m))


def passk_keys(results: list[dict]) -> list[str]:
    """the pass@k keys the results hold, by k"""
    return sorted({k for r in results for k in r["passk"]}, key=lambda k: int(k[5:]))


# the rows every row is paired with in the report's table (by seed), and their names there
PAIRED_WITH = {"hard-only": "Hard-Only", "base-t": "Base-T"}


def table(results: list[dict], test: str) -> list[str]:
    """Tables 4-6: rows = methods (paper's order); columns = pass@k in % (mean ± std over seeds),
    the top k's pass@k minus Hard-Only's and minus Base-T's (paired_delta), the step of the number
    (early stop, fixed, last window), non-trivial: the share of groups with a reward signal."""
    rs = [r for r in results if r["test"] == test]
    ks = passk_keys(rs)
    refs = {ref: {r["seed"]: r["passk"][ks[-1]] for r in rs if r["method"] == ref}
            for ref in PAIRED_WITH}
    paired = " | ".join(f"{ks[-1]} - {name} [95% CI]" for name in PAIRED_WITH.values())
    lines = [f"## pass@k (%) on `{test}`", "",
             "| method | " + " | ".join(ks) + f" | {paired} | seeds | step | non-trivial |",
             "|---|" + "---|" * (len(ks) + len(PAIRED_WITH) + 3)]
    for m in ordered({r["method"] for r in rs}):
        mr = [r for r in rs if r["method"] == m]
        cells = ["{:.1f} ± {:.1f}".format(*mean_std([100 * r["passk"][k] for r in mr
                                                     if k in r["passk"]])) for k in ks]
        steps = [r["stop_step"] for r in mr if "stop_step" in r]
        step = f"{statistics.fmean(steps):.0f} ({mr[0]['rule']})" if steps else "-"
        shares = [100 * r["nontrivial_share"] for r in mr if r.get("nontrivial_share") is not None]
        share = "{:.0f} ± {:.0f}%".format(*mean_std(shares)) if shares else "-"
        deltas = [paired_delta(mr, refs[ref], ks[-1]) if m != ref else "-" for ref in PAIRED_WITH]
        lines.append(f"| {m} | " + " | ".join(cells + deltas)
                     + f" | {len(mr)} | {step} | {share} |")
    return lines + [""]


def paired_delta(rows: list[dict], ref: dict, k: str) -> str:
    """the rows' pass@k minus the reference's ({seed: pass@k}), paired by seed, in points
    (mean_ci)"""
    return mean_ci([100 * (r["passk"][k] - ref[r["seed"]]) for r in rows
                    if r["seed"] in ref and k in r["passk"]])


def mean_ci(diffs: list[float]) -> str:
    """a table's cell: the mean of paired differences and its 95% bootstrap CI (paired_ci); "-"
    without any"""
    if not diffs:
        return "-"
    return "{:+.1f} [{:+.1f}, {:+.1f}]".format(statistics.fmean(diffs), *paired_ci(diffs))


def plot_curves(results: list[dict], path: str) -> bool:
    """Test pass@k by fresh-student step (seed mean), panel per (test, k); inference rows dashed"""
    import matplotlib.pyplot as plt
    curves = {}
    for r in results:
        for e in data.read_jsonl(os.path.join(r["dir"], "evals.jsonl")):
            for k in (k for k in e if k.startswith("pass@")):
                curves.setdefault((r["test"], r["method"], k), {}).setdefault(
                    e["step"], []).append(e[k])
    if not curves:
        return False
    tests = sorted({t for t, _, _ in curves})
    ks = sorted({k for _, _, k in curves}, key=lambda k: int(k[5:]))
    fig, axes = plt.subplots(len(tests), len(ks), figsize=(3.2 * len(ks), 2.8 * len(tests)),
                             squeeze=False)
    for i, t in enumerate(tests):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            for m in ordered({m for tt, m, kk in curves if (tt, kk) == (t, k)}):
                pts = sorted(curves[t, m, k].items())
                ax.plot([s for s, _ in pts], [100 * statistics.fmean(v) for _, v in pts],
                        marker=".", label=m)
            for m in ordered({r["method"] for r in results
                              if r["test"] == t and "steps_done" not in r}):
                ys = [r["passk"][k] for r in results
                      if (r["test"], r["method"]) == (t, m) and k in r["passk"]]
                if ys:
                    ax.axhline(100 * statistics.fmean(ys), ls="--", lw=1,
                               color="grey" if m == "base" else "k", label=m)
            ax.set_title(f"{k} on {os.path.basename(t)}", fontsize=9)
            ax.set_xlabel("training step")
            ax.set_ylabel("%")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_soar(runs: dict[str, list[dict]], path: str) -> None:
    """SOAR's outer loop per run (metrics.jsonl): teacher reward, its moving average, promotions"""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.2), squeeze=False,
                             sharey=True)
    for ax, (name, metrics) in zip(axes[0], runs.items()):
        steps = [m["step"] for m in metrics]
        ax.plot(steps, [m["reward"] for m in metrics], marker=".",
                label="teacher reward (mean_k R_k)")
        ax.plot(steps, [math.nan if m["ma"] is None else m["ma"] for m in metrics], marker="x",
                label="moving average")   # restarts after a promotion
        for m in metrics:
            if m["promoted"]:
                ax.axvline(m["step"], color="tab:green", alpha=0.4, lw=1)
        ax.plot([], [], color="tab:green", alpha=0.4, label="promotion")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_title(f"{name}: {metrics[-1]['promotions']} promotions", fontsize=9)
        ax.set_xlabel("outer step")
    axes[0][0].set_ylabel("reward (accuracy gain)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def soar_config(folder: str) -> dict | None:
    """a soar.py --out folder's settings (its newest checkpoint's); None before its first step"""
    ckpts = launch.ckpt_dirs(folder)
    return data.read_json(os.path.join(ckpts[-1], "state.json"))["config"] if ckpts else None


def teacher_runs(cfg: Config) -> dict[str, dict]:
    """The soar.py runs of --soar, --intrinsic, --opensir (comma lists) with a finished step: their
    teacher reward (from the config), metrics and curriculum (what the teacher wrote)."""
    runs = {}
    for d in ",".join(x for x in (cfg.soar, cfg.intrinsic, cfg.opensir) if x).split(","):
        metrics = data.read_jsonl(os.path.join(d, "metrics.jsonl"))
        config = soar_config(d)
        if metrics and config:
            runs[d] = dict(reward=config["reward"], metrics=metrics, curriculum=curriculum(
                data.read_jsonl(os.path.join(d, "questions.jsonl"))))
    return runs


def curriculum(questions: list[dict]) -> dict[int, dict[str, float]]:
    """per outer step, the share of each world.CATEGORIES among the teacher's questions"""
    per = {}
    for q in questions:
        per.setdefault(q["step"], []).append(world.describe(q["question"], q["answer"])["category"])
    return {s: {c: cs.count(c) / len(cs) for c in world.CATEGORIES}
            for s, cs in sorted(per.items())}


def teacher_learning(runs: dict[str, dict]) -> list[str]:
    """Does the teacher learn? Per teacher reward, over seeds: (a) the share of steps before the 1st
    promotion whose g datasets got unequal rewards (else no RLOO gradient); (b) the step reward
    Rhat's pooled slope, seed-bootstrap 95% CI; (c) world.USEFUL share, first vs last quarter."""
    lines = ["| teacher reward | runs | steps | (a) steps with reward variance, before the 1st "
             "promotion | (b) slope of Rhat per step [95% CI] | (c) useful share, first -> last "
             "quarter |", "|---|---|---|---|---|---|"]
    for reward in sorted({r["reward"] for r in runs.values()}):
        rs = [r for r in runs.values() if r["reward"] == reward]
        before = [m for r in rs for m in r["metrics"][:next(
            (i for i, m in enumerate(r["metrics"]) if m["promoted"]), len(r["metrics"]))]]
        a = statistics.fmean(len(set(m["R_k"])) > 1 for m in before) if before else math.nan
        b = slope_ci([[m["reward"] for m in r["metrics"]] for r in rs])
        shares = [[sum(v[c] for c in world.USEFUL) for v in r["curriculum"].values()]
                  for r in rs]
        c = first_to_last([s for s in shares if s], "{:.0%}")   # (none before questions.jsonl)
        lines.append(f"| {reward} | {len(rs)} | {min(len(r['metrics']) for r in rs)} | {a:.0%} of "
                     f"{len(before)} | " "{:+.4f} [{:+.4f}, {:+.4f}] | {} |".format(*b, c))
    return lines


def first_to_last(curves: list[list[float]], fmt: str) -> str:
    """'first -> last' quarter of each curve (one per run), each mean ± std over the runs"""
    if not curves:
        return "-"
    first = [statistics.fmean(c[:max(1, len(c) // 4)]) for c in curves]
    last = [statistics.fmean(c[-max(1, len(c) // 4):]) for c in curves]
    pair = f"{fmt} ± {fmt}"
    return pair.format(*mean_std(first)) + " -> " + pair.format(*mean_std(last))


def population_table(results: list[dict]) -> list[str]:
    """PopuLoRA's claims on the test split (result.json's `members`): the population's mean, best
    and worst student beside the single-agent baseline, paired by seed (95% bootstrap CI)."""
    rs = [r for r in results if r["method"] == "populora"]
    single = {(r["test"], r["seed"]): r for r in results if r["method"] == "populora-single"}
    if not rs:
        return []
    k = passk_keys(rs)[-1]
    lines = [f"## PopuLoRA: the population's students ({k}, %)", "",
             "| test | seeds | mean | best | worst | single agent | mean - single [95% CI] "
             "| worst - single [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for test in sorted({r["test"] for r in rs}):
        runs = [r for r in rs if r["test"] == test]
        # a population of one student (1T-1S) has no members: it is its own mean, best and worst
        member_passk = [[100 * m[k] for m in r.get("members", {"s0": r["passk"]}).values()]
                        for r in runs]
        cells = ["{:.1f} ± {:.1f}".format(*mean_std([f(p) for p in member_passk]))
                 for f in (statistics.fmean, max, min)]
        pairs = [(p, 100 * single[test, r["seed"]]["passk"][k])
                 for r, p in zip(runs, member_passk) if (test, r["seed"]) in single]
        base = "{:.1f} ± {:.1f}".format(*mean_std([b for _, b in pairs])) if pairs else "-"
        deltas = [mean_ci([f(p) - b for p, b in pairs]) for f in (statistics.fmean, min)]
        lines.append(f"| {os.path.basename(test)} | {len(runs)} | " + " | ".join(cells)
                     + f" | {base} | " + " | ".join(deltas) + " |")
    return lines + [""]


def population_runs(cfg: Config) -> dict[str, dict]:
    """The populora.py runs of --populora and --populora_single (comma lists) with a finished
    round, and per round what their students solved (population_rounds)."""
    runs = {}
    for method, folders in (("populora", cfg.populora), ("populora-single", cfg.populora_single)):
        for d in filter(None, folders.split(",")):
            questions = data.read_jsonl(os.path.join(d, "questions.jsonl"))
            if questions:
                runs[d] = dict(method=method, rounds=population_rounds(questions, cfg.embed))
    return runs


def population_rounds(questions: list[dict], embed: str) -> list[dict]:
    """Per round of a populora.py run, over its problems that passed every check: the students'
    mean solve rate; the difficulty (the world's steps per problem); coverage: the Vendi score of
    ROUND_VENDI_SUBSET problems (a population writes more a round than one agent), the share of
    world.USEFUL and the world's kinds (kind, steps, "gives away" steps) seen so far."""
    by_round = {}
    for q in questions:
        by_round.setdefault(q["round"], []).append(q)
    seen = set()
    rounds = []
    for rnd, qs in sorted(by_round.items()):
        described = [world.describe(q["question"], q["answer"]) for q in qs]
        seen |= {(d["kind"], d["steps"], d["gives_away"]) for d in described if d["well_posed"]}
        rounds.append(dict(round=rnd,
                           solve_rate=statistics.fmean(q["solve_rate"] for q in qs),
                           steps=statistics.fmean(d["steps"] for d in described),
                           vendi=data.vendi_bootstrap(
                               data.embed([q["question"] for q in qs], embed),
                               ROUND_VENDI_SUBSET, draws=20)[0],
                           useful=statistics.fmean(d["category"] in world.USEFUL
                                                   for d in described),
                           kinds=len(seen)))
    return rounds


POPULATION_PANELS = {"solve_rate": "students' solve rate", "steps": "difficulty: steps per problem",
                     "vendi": f"Vendi of {ROUND_VENDI_SUBSET} of the round's problems",
                     "useful": "share of world.USEFUL", "kinds": "world kinds seen so far"}


def population_summary(runs: dict[str, dict]) -> list[str]:
    """per method, each POPULATION_PANELS measure's first -> last quarter of the rounds"""
    lines = ["| run | runs | " + " | ".join(f"{t}, first -> last quarter"
                                            for t in POPULATION_PANELS.values()) + " |",
             "|---|---|" + "---|" * len(POPULATION_PANELS)]
    for method in ordered({r["method"] for r in runs.values()}):
        rs = [r["rounds"] for r in runs.values() if r["method"] == method]
        cells = [first_to_last([[x[key] for x in r] for r in rs], "{:.2f}")
                 for key in POPULATION_PANELS]
        lines.append(f"| {method} | {len(rs)} | " + " | ".join(cells) + " |")
    return lines


def plot_populations(runs: dict[str, dict], path: str) -> None:
    """PopuLoRA over its rounds, a panel per POPULATION_PANELS measure and a line per run: the
    populations solid, the single agent dashed."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(POPULATION_PANELS), figsize=(3.2 * len(POPULATION_PANELS), 2.8),
                             squeeze=False)
    for ax, (key, title) in zip(axes[0], POPULATION_PANELS.items()):
        for d, r in runs.items():
            single = r["method"] == "populora-single"
            ax.plot([x["round"] for x in r["rounds"]], [x[key] for x in r["rounds"]],
                    ls="--" if single else "-", color="tab:orange" if single else "tab:blue",
                    alpha=0.7, marker=".", label=f"{r['method']}: {os.path.basename(d)}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("round")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curriculum(runs: dict[str, dict], path: str) -> None:
    """What the teacher wrote over the outer steps: the share of each world.CATEGORIES among its
    questions, a row per teacher reward and a panel per run (seed)."""
    import matplotlib.pyplot as plt
    rewards = sorted({r["reward"] for r in runs.values()})
    by = {w: [(d, r) for d, r in runs.items() if r["reward"] == w] for w in rewards}
    cols = max(map(len, by.values()))
    fig, axes = plt.subplots(len(rewards), cols, figsize=(3.2 * cols, 2.6 * len(rewards)),
                             squeeze=False, sharex=True, sharey=True)
    for i, w in enumerate(rewards):
        for j, (d, r) in enumerate(by[w]):
            cur = r["curriculum"]
            axes[i][j].stackplot(list(cur),
                                 *[[v[c] for v in cur.values()] for c in world.CATEGORIES],
                                 labels=world.CATEGORIES, alpha=0.8)
            axes[i][j].set_title(f"{w}: {os.path.basename(d)}", fontsize=8)
        for ax in axes[i][len(by[w]):]:
            ax.axis("off")
        axes[i][0].set_ylabel("share of questions")
    for ax in axes[-1]:
        ax.set_xlabel("outer step")
    axes[0][0].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_report(cfg: Config, args=()) -> str:
    """report.md in --out (default --runs): a table per test split from every result.json under
    --runs, the Vendi score of every question set in sight (each --soar run's PQ, the teachers'
    samples), plots curves.png (fresh students) and soar.png (each --soar run's metrics.jsonl);
    with --populora: the populations' students and populations.png (their rounds)."""
    import matplotlib   # the plots' functions import it, not the top: only the report plots
    matplotlib.use("Agg")
    out = cfg.out or cfg.runs
    os.makedirs(out, exist_ok=True)
    found = sorted(glob.glob(os.path.join(cfg.runs, "**", "result.json"), recursive=True))
    results = [{**data.read_json(p), "dir": os.path.dirname(p)} for p in found]
    lines = ["# SOAR evaluation", ""]
    for test in sorted({r["test"] for r in results}):
        lines += table(results, test)
    runs = {d: m for d in cfg.soar.split(",")
            if (m := data.read_jsonl(os.path.join(d, "metrics.jsonl")))}
    sets = {"pq": [os.path.join(d, "pq.jsonl") for d in runs]}
    for path in sorted(glob.glob(os.path.join(cfg.runs, "*", "seed*", "questions.jsonl"))):
        sets.setdefault(os.path.basename(os.path.dirname(os.path.dirname(path))), []).append(path)
    rows = []   # a Vendi score per file (a seed's questions), mean ± std over the files
    for m in ordered(sets):
        qs = [[q["question"] for q in data.read_jsonl(p)] for p in sets[m]]
        scores = [vendi_of(q, cfg)[0] for q in qs if q]
        if scores:
            rows.append("| {} | {:.2f} ± {:.2f} | {} | {} |".format(
                m, *mean_std(scores), len(scores), sum(map(len, qs))))
    if rows:
        lines += [f"## Diversity: Vendi score ({cfg.embed} embedding, mean over {cfg.vendi_draws} "
                  f"subsets of {cfg.vendi_subset}; mean ± std over seeds)", "",
                  "| questions | Vendi | seeds | n |", "|---|---|---|---|", *rows, ""]
    if plot_curves(results, os.path.join(out, "curves.png")):
        lines += ["## Test pass@k over fresh-student training", "", "![curves](curves.png)", ""]
    if runs:   # the SOAR runs with at least one finished step
        plot_soar(runs, os.path.join(out, "soar.png"))
        lines += ["## SOAR's outer loop", "",
                  *(f"- {d}: {len(m)} outer steps, {m[-1]['promotions']} promotions"
                    for d, m in runs.items()), "", "![soar](soar.png)", ""]
    teachers = teacher_runs(cfg)
    if teachers:
        lines += ["## Does the teacher learn?", "", *teacher_learning(teachers), ""]
    if any(v[world.CATEGORIES[0]] < 1 for r in teachers.values() for v in r["curriculum"].values()):
        plot_curriculum(teachers, os.path.join(out, "curriculum.png"))  # built-in world questions
        lines += ["## What the teachers wrote (built-in world)", "",
                  "![curriculum](curriculum.png)", ""]
    lines += population_table(results)
    populations = population_runs(cfg)
    if populations:
        plot_populations(populations, os.path.join(out, "populations.png"))
        lines += ["## PopuLoRA over training (problems that passed every check)", "",
                  *population_summary(populations), "", "![populations](populations.png)", ""]
    text = "\n".join(lines)
    data.write_text(os.path.join(out, "report.md"), text)
    log_tables(cfg, results, [os.path.join(out, f) for f in re.findall(r"\]\((\w+\.png)\)", text)])
    print(text)
    return text


def log_tables(cfg: Config, results: list[dict], plots=()) -> None:
    """(rank 0, --wandb) a W&B run of this command: per method a table of its runs' results
    (pass@k, the step it was read at), and the plots"""
    if not (cfg.wandb and rloo.rank0()):
        return
    wb = launch.tracker(cfg.wandb, cfg.wandb_name, cfg.out or cfg.runs, dataclasses.asdict(cfg))
    import wandb   # (loaded by launch.tracker: only with --wandb)
    for m in ordered({r["method"] for r in results}):
        rs = [r for r in results if r["method"] == m]
        ks = passk_keys(rs)
        wb.log({m: wandb.Table(columns=["test", "seed", *ks, "step"],
                               data=[[r["test"], r["seed"], *(r["passk"].get(k) for k in ks),
                                      r.get("stop_step")] for r in rs])})
    wb.log({os.path.basename(p).removesuffix(".png"): wandb.Image(p) for p in plots})
    wb.finish()


COMMANDS = {"filter": cmd_filter, "row": cmd_row, "train": lambda cfg, _: cmd_row(cfg, [cfg.name]),
            "sample-teacher": cmd_sample_teacher, "vendi": cmd_vendi, "report": cmd_report}


def main(argv=None):
    command, args, cfg = parse_args(argv)
    COMMANDS[command](cfg, args)


if __name__ == "__main__":
    launch.main("eval.py", main)
