"""Evaluation of SOAR (METHOD.md "Evaluation protocol"): pass@k, the fail@128 filter, fresh-student
RLOO runs with the early-stopping rule, the rows of the paper's Tables 4-6, Vendi diversity, and a
report (markdown table + PNG plots).

    python eval.py filter math harp olympiad --model M --out data    # data/<pool>/{train,test}.jsonl
    torchrun --nproc_per_node 8 eval.py row base ps hard-only pq grounded-t base-t --model M \\
        --train data/math/train.jsonl --test data/math/test.jsonl --soar runs/math --runs runs/eval/math \\
        --mode curriculum --seeds 0,1,2
    torchrun --nproc_per_node 8 eval.py row pq --model M --train data/math/train.jsonl \\
        --test data/olympiad/test.jsonl --soar runs/math --runs runs/eval/olympiad --fixed_step 50
    python eval.py train --synthetic my_questions.jsonl --name mine ...   # any question set + hard train
    python eval.py sample-teacher runs/math/teacher --out q.jsonl        # 128 teacher questions
    python eval.py vendi q.jsonl runs/math/pq.jsonl                      # diversity
    python eval.py report --runs runs/eval/math --soar runs/math         # report.md + PNGs in --runs
Without --model everything runs on the built-in world (world.py) with its preset (world.PRESET).

A run folder is <runs>/<method>/seed<s>/: metrics.jsonl (one line per training step), evals.jsonl
(test pass@k every --eval_every steps), ckpt/ (resume), result.json (the row's numbers; a run that
has one is finished and is skipped when the command is rerun; any other rerun continues).
"""
import dataclasses
import glob
import json
import math
import os
import random
import shutil
import statistics
import time

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import data
import rloo
import world


@dataclasses.dataclass
class Config:
    # ---- what to evaluate ----
    model: str = ""             # base model (every fresh student starts here); "" = the built-in world
    world: str = "default"      # the built-in world without --model: default, or small (the tests')
    train: str = ""             # hard train split (question/answer jsonl/parquet); "" = the world's
    test: str = ""              # hard test split; "" = the world's
    soar: str = "runs/soar"     # a soar.py --out folder (pq.jsonl, student/, ...); report: a comma list of them
    teacher: str = ""           # teacher HF folder for grounded-t; "" = <soar>/teacher
    intrinsic: str = ""         # the --out folder of a `soar.py --reward learnability` run (intrinsic-t); report: a list
    opensir: str = ""           # the --out folder of a `soar.py --reward opensir` run (opensir-t); report: a list
    labels: str = ""            # pq-correct, pq-wellposed with --model: jsonl of the PQ's question, correct, well_posed
    extra: str = ""             # curated real questions for the upper-bound rows (e.g. MATH train)
    synthetic: str = ""         # `train`: the question set to add to the hard train split
    name: str = ""              # `train`: the method name (run folder and report row)
    runs: str = "runs/eval"     # run folders: <runs>/<method>/seed<s>/; the report goes here too
    out: str = ""               # `filter`: output folder; `sample-teacher`: output file; `report`: folder
    seeds: str = "0"            # comma list: sampling seeds (inference rows) or training seeds
    # ---- pass@k (METHOD.md "Evaluation protocol") ----
    passk_samples: int = 32     # samples per test problem; k in 1, 4, 8, 16, 32 up to this
    # ---- fail@128 filter (METHOD.md "Data"): T = 1, student_max_tokens, keep 0-correct, split 50/50 ----
    filter_samples: int = 128   # samples per problem
    split_seed: int = 0         # seed of the 50/50 train/test split
    # ---- fresh students (METHOD.md "Hyperparameters", "Evaluation protocol") ----
    mode: str = "mixed"         # mixed (HARP, Olympiad) or curriculum (MATH): how synthetic and real combine
    sampler: str = "uniform"    # uniform (shuffled epochs) or leeps: how a fresh student's questions are chosen
    sept_temperature: float = 1.0   # SePT: the temperature of its own answers (best of 0.5/0.7/1.0 on a train half)
    student_steps: int = 1500   # at most; the early-stopping rule usually ends a run before
    switch_step: int = 64       # curriculum: synthetic only for this many steps, then real only
    student_warmup: int = 20    # lr warmup of mixed runs; curriculum runs use 0
    student_lr: float = 1e-5    # AdamW, cosine over student_steps
    student_samples: int = 32   # samples per question (the student's RLOO group)
    big_group: int = 128        # the group of the hard-only-128 row
    student_questions: int = 8  # questions per student step
    kl_coef: float = 0.001      # k3 KL to the model the run started from
    temperature: float = 1.0    # sampling temperature (training, pass@k, filter)
    student_max_tokens: int = 1024  # new tokens per student completion (training, pass@k, filter)
    teacher_max_tokens: int = 512   # new tokens per teacher sample
    teacher_questions: int = 128  # questions sampled from a teacher (and real questions of upper-128)
    eval_every: int = 20        # test pass@k every this many steps
    ckpt_every: int = 100       # checkpoint every this many steps
    fixed_step: int = 0         # > 0: report the test metric at this step instead (OlympiadBench: 50)
    # ---- early stopping (METHOD.md "Early stopping") ----
    es_window: int = 25         # centred moving average of the mean training reward
    es_fraction: float = 0.15   # stop at the first step whose slope < this * the max slope
    es_average: int = 200       # report the test metric averaged over the next this many steps
    # ---- diversity (METHOD.md "Diversity") ----
    embed: str = "ngram"        # ngram (offline, no model) or a HF model path (mean-pooled states)
    vendi_subset: int = 128     # questions per bootstrap subset
    vendi_draws: int = 100      # bootstrap subsets
    # ---- systems ----
    micro_batch_tokens: int = 16384  # tokens per forward/backward pass (rows x longest row)
    activation_checkpointing: bool = True   # recompute activations in backward: a 3B student fits beside the engine
    gpu_memory_utilization: float = 0.3     # the vLLM engine's share of GPU memory


KS = (1, 4, 8, 16, 32)
LEEPS_WINDOW = 20       # steps over which each portfolio's share of non-trivial groups is measured
LEEPS_NEIGHBOURS = 8    # nearest neighbours whose outcomes rank an explore question
# settings a resumed fresh-student run may change without invalidating its checkpoint
MAY_CHANGE = {"runs", "out", "seeds", "ckpt_every", "micro_batch_tokens", "activation_checkpointing",
              "gpu_memory_utilization"}

# The rows of the paper's Tables 4-6, in the paper's order (the report keeps it).
ROWS = {
    "base": "the base model, inference only",
    "hard-only": "fresh student, RLOO on the hard train split alone (group --student_samples)",
    "hard-only-128": "the same, group --big_group (128)",
    "intrinsic-t": "fresh student on 128 questions of the learnability teacher (<intrinsic>/teacher) + hard train",
    "base-t": "fresh student on 128 questions of the base model as teacher + hard train",
    "pq": "fresh student on SOAR's promotion questions (<soar>/pq.jsonl) + hard train",
    "pq-correct": "the same on the promotion questions whose answers are correct (world.describe, or --labels)",
    "pq-wellposed": "the same on the well-posed promotion questions, answers correct or not (or --labels)",
    "ps": "SOAR's promoted student (<soar>/student), inference only",
    "grounded-t": "fresh student on 128 questions of SOAR's teacher (<soar>/teacher) + hard train",
    "opensir-t": "fresh student on 128 questions of the OpenSIR-style teacher (<opensir>/teacher) + hard train",
    "sept": "fresh student, SePT: NLL on its own answers to the hard train split, no reward",
    "upper-128": "fresh student on 128 questions of --extra + hard train",
    "upper": "fresh student on all of --extra (e.g. MATH train) + hard train",
}


def parse_args(argv=None) -> tuple[str, list[str], Config]:
    p = rloo.config_parser(Config, world.PRESET, description=__doc__,
                           epilog="rows:\n" + "\n".join(f"  {k:14} {v}" for k, v in ROWS.items()))
    p.add_argument("command", choices=list(COMMANDS))
    p.add_argument("args", nargs="*", help="filter: pools; row: methods; sample-teacher: a teacher; vendi: files")
    a = vars(p.parse_intermixed_args(argv))   # options anywhere: before, between and after the rows
    command, args, cfg = a["command"], a["args"], rloo.config_from(Config, a, world.PRESET)
    if cfg.mode not in ("mixed", "curriculum") or cfg.sampler not in ("uniform", "leeps"):
        p.error(f"--mode must be mixed or curriculum and --sampler uniform or leeps, not {cfg.mode!r}, {cfg.sampler!r}")
    if command == "row" and (not args or set(args) - set(ROWS)):
        p.error(f"row needs methods out of: {', '.join(ROWS)}")
    if command == "train" and not (cfg.synthetic and cfg.name) or cfg.name in ROWS:
        p.error("train needs --synthetic FILE and --name NAME (a name that is not one of the rows)")
    return command, args, cfg


# ---------------------------------------------------------------------------------------------
# pure statistics (tested against brute force / known answers)

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (METHOD.md "Evaluation protocol"): 1 - C(n-c,k)/C(n,k), in the product
    form 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_passk(counts: list[int], n: int, ks=KS) -> dict:
    """pass@k of a test set: the mean over problems of the per-problem estimate."""
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in counts) / len(counts) for k in ks if k <= n}


def mean_std(xs: list[float]) -> tuple[float, float]:
    """mean and sample std (ddof 1) over seeds; std 0 for one seed"""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def paired_ci(diffs: list[float], draws: int = 10000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of paired differences (one per seed; seeds drawn with
    replacement)."""
    d = np.asarray(diffs, float)
    means = d[np.random.default_rng(seed).integers(0, len(d), (draws, len(d)))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def slope_ci(curves: list[list[float]], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The least-squares slope of y over its index, pooled over curves (one per seed), and its 95%
    bootstrap CI over curves (a seed's steps are not independent of each other, so seeds are resampled)."""
    def slope(cs):
        x = np.concatenate([np.arange(len(c)) for c in cs])
        y = np.concatenate([np.asarray(c, float) for c in cs])
        return float(np.polyfit(x, y, 1)[0]) if len(set(x)) > 1 else 0.0
    rng = np.random.default_rng(seed)
    boot = [slope([curves[i] for i in rng.integers(0, len(curves), len(curves))]) for _ in range(draws)]
    return slope(curves), *map(float, np.quantile(boot, [0.025, 0.975]))


def early_stop(rewards: list[float], window: int = 25, fraction: float = 0.15) -> int | None:
    """The rule of METHOD.md "Early stopping": smooth the mean training reward with a centred moving average of `window`
    steps, take discrete slopes normalised by the range of the smoothed curve, stop at the first
    step whose slope < fraction * the max slope. "First" counts from the steepest step: a curve
    that starts flat (reward ~0 on hard problems) would otherwise stop at step 0. None while no
    step qualifies (still rising, or flat: no slope > 0)."""
    if len(rewards) < window + 1:
        return None
    smooth = np.convolve(np.asarray(rewards, float), np.ones(window) / window, mode="valid")  # [i] centred on i + window//2
    span = smooth.max() - smooth.min()
    if span <= 0:
        return None
    slope = np.diff(smooth) / span       # normalised: scale-free, so any reward units give the same step
    peak = int(slope.argmax())
    if slope[peak] <= 0:
        return None
    below = np.nonzero(slope[peak + 1:] < fraction * slope[peak])[0]
    return None if len(below) == 0 else int(peak + 1 + below[0] + window // 2)


def select(evals: list[dict], rewards: list[float], cfg: Config, offset: int = 0) -> dict:
    """The row's number for one run: the test metric at --fixed_step, or averaged over the evals in
    [stop, stop + es_average] after the early-stopping step; no stop yet: the last es_average steps.
    `offset`: the rule sees only rewards[offset:] (curriculum: the real-only phase)."""
    if cfg.fixed_step:
        rule, lo, hi = "fixed", cfg.fixed_step, cfg.fixed_step
    else:
        stop = early_stop(rewards[offset:], cfg.es_window, cfg.es_fraction)
        last = evals[-1]["step"]
        rule, lo = ("early-stop", stop + offset) if stop is not None else ("last", max(0, last - cfg.es_average))
        hi = lo + cfg.es_average
    rows = [e for e in evals if lo <= e["step"] <= hi] or [min(evals, key=lambda e: abs(e["step"] - lo))]
    keys = [k for k in rows[0] if k.startswith("pass@")]
    return dict(rule=rule, stop_step=lo, window=[lo, hi], evals_used=[e["step"] for e in rows],
                passk={k: statistics.fmean(e[k] for e in rows) for k in keys})


def finished(rewards: list[float], step: int, cfg: Config, offset: int = 0) -> bool:
    """May a fresh-student run end before `step`? At --fixed_step, or once the early-stopping step
    on the rewards so far has its full averaging window behind it (the final rule then sees
    exactly this curve, so the reported window is the one that ended the run)."""
    if cfg.fixed_step:
        return step >= cfg.fixed_step
    stop = early_stop(rewards[offset:], cfg.es_window, cfg.es_fraction)
    return stop is not None and step >= stop + offset + cfg.es_average


def batch_at(step: int, synthetic: list[dict], real: list[dict], cfg: Config, seed: int):
    """(source, pool, indices): the pool of training step `step` and, for the uniform sampler, its
    questions, a pure function of (seed, step), so a resumed run replays exactly. mixed: one pool
    (synthetic + real) walked in a fresh shuffle each epoch; curriculum: synthetic for the first
    switch_step steps, then real (METHOD.md "Evaluation protocol")."""
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
    """LEEPS (METHOD.md "LEEPS"): `size` of the pool's n questions and each one's portfolio. exploit:
    the questions whose latest group had non-zero reward variance, least recently drawn first;
    explore: the others, most promising first by their LEEPS_NEIGHBOURS nearest drawn neighbours'
    (cosine of the rows of `emb`) similarity-weighted share of such groups. The budget is split by each portfolio's share of such
    groups over the last LEEPS_WINDOW steps. history: earlier steps' questions, portfolio, nontrivial."""
    last, when = {}, {}
    for s, h in enumerate(history):
        for i, nt in zip(h["questions"], h["nontrivial"]):
            last[i], when[i] = nt, s
    recent = [(p, nt) for h in history[-LEEPS_WINDOW:] for p, nt in zip(h["portfolio"], h["nontrivial"])]
    ratio = {p: (sum(nt for q, nt in recent if q == p) + 1) / (sum(q == p for q, _ in recent) + 2)
             for p in ("exploit", "explore")}
    exploit = sorted((i for i, nt in last.items() if nt), key=lambda i: (when[i], rng.random()))
    exploit = exploit[:round(size * ratio["exploit"] / (ratio["exploit"] + ratio["explore"]))]
    explore = [i for i in range(n) if not last.get(i)]
    seen = sorted(last)
    if seen and explore:   # the similarity-weighted, Laplace-smoothed share of the neighbours' non-trivial groups
        sim = np.maximum(emb[explore] @ emb[seen].T, 0)
        near = np.argsort(-sim, axis=1)[:, :LEEPS_NEIGHBOURS]
        w, outcome = np.take_along_axis(sim, near, 1), np.array([last[i] for i in seen], dtype=float)[near]
        promise = ((w * outcome).sum(1) + 1) / (w.sum(1) + 2)
    else:
        promise = np.full(len(explore), 0.5)
    explore = [i for _, _, i in sorted(zip(-promise, [rng.random() for _ in explore], explore))]
    chosen = (exploit + explore)[:size]
    return chosen, ["exploit"] * len(exploit[:size]) + ["explore"] * (len(chosen) - len(exploit[:size]))


# ---------------------------------------------------------------------------------------------
# on the engines (every rank calls these; generation and grading are split over the ranks)

def eval_passk(llm, test: list[dict], cfg: Config, seed: int, key) -> dict:
    counts = rloo.correct_counts(llm, test, n=cfg.passk_samples, max_tokens=cfg.student_max_tokens,
                                 temperature=cfg.temperature, seed=rloo.seed_of(seed, "passk", key),
                                 group=dist.group.WORLD)
    return {**mean_passk(counts, cfg.passk_samples), "solved": sum(c > 0 for c in counts)}


def frozen(path: str, mesh):
    """The model in HF folder `path` as a sharded policy, only to reach the engines through
    rloo.sync_weights (the one exact sync path; the engine is built once, from --model)."""
    return rloo.load_policy(path, mesh, lr=0.0, warmup_steps=0, total_steps=1, kl_coef=0.0)


def teacher_questions(path: str, cfg: Config, seed: int, llm, tok, mesh) -> list[dict]:
    """cfg.teacher_questions questions of the teacher in `path`, with SOAR's teacher prompt and format
    filter (METHOD.md "Evaluation protocol": same prompt and filter)."""
    rloo.sync_weights(frozen(path, mesh), llm)
    kept, _ = rloo.sample_teacher(llm, data.teacher_prompt(tok), need=cfg.teacher_questions,
                                  max_tokens=cfg.teacher_max_tokens, temperature=cfg.temperature, seed=seed,
                                  key="eval", max_rounds=8, group=dist.group.WORLD)
    return [{"question": q, "answer": a} for _, (q, a) in kept]


# ---------------------------------------------------------------------------------------------
# one run folder

def inference_run(cfg: Config, seed: int, method: str, path: str, llm, mesh, test, out: str) -> dict:
    """base / ps rows: pass@k of the model in `path` on the test split, sampling seed `seed`."""
    rloo.sync_weights(frozen(path, mesh), llm)
    res = dict(method=method, test=cfg.test, seed=seed, model=path,
               passk={k: v for k, v in eval_passk(llm, test, cfg, seed, "inference").items() if k.startswith("pass@")})
    if dist.get_rank() == 0:
        data.write_json(os.path.join(out, "result.json"), res)
    return res


def train_run(cfg: Config, seed: int, method: str, synthetic, real, test, llm, mesh, out: str) -> dict:
    """A fresh student from the base model, RLOO on synthetic + real (METHOD.md "Evaluation protocol"),
    or SePT's reward-free step (method "sept"), on questions --sampler picks, test pass@k every
    eval_every steps, until the early-stopping rule (or --fixed_step, or --student_steps) says the
    row's number is known. Resumable from out/ckpt; writes out/result.json."""
    # without a synthetic set (hard-only) there is nothing to put first: mixed, i.e. the hard split alone
    cfg = dataclasses.replace(cfg, student_samples=cfg.big_group if method == "hard-only-128" else cfg.student_samples,
                              mode=cfg.mode if synthetic else "mixed")
    warmup = 0 if cfg.mode == "curriculum" else cfg.student_warmup
    offset = cfg.switch_step if cfg.mode == "curriculum" else 0   # the rule watches the real-only phase
    config, rank = {**dataclasses.asdict(cfg), "seed": seed, "method": method}, dist.get_rank()
    sept = method == "sept"   # plain NLL on its own samples: no reward, no KL (METHOD.md "SePT")
    policy = rloo.load_policy(cfg.model, mesh, lr=cfg.student_lr, warmup_steps=warmup, total_steps=cfg.student_steps,
                              kl_coef=0.0 if sept else cfg.kl_coef, activation_checkpointing=cfg.activation_checkpointing)
    metrics_path, evals_path = os.path.join(out, "metrics.jsonl"), os.path.join(out, "evals.jsonl")
    ckpt, state = rloo.resume(out, config, MAY_CHANGE)
    if ckpt:
        rloo.load_state(policy, os.path.join(ckpt, "policy"))
    start = state["step"] if ckpt else 0
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        data.truncate_jsonl(metrics_path, start)   # rows of steps the checkpoint does not hold
        data.truncate_jsonl(evals_path, start)
        print(f"{method} seed {seed}: {len(synthetic)} synthetic + {len(real)} real questions, {cfg.mode}, "
              f"group {cfg.student_samples}; {'resuming at' if start else 'starting at'} step {start} -> {out}",
              flush=True)
    dist.barrier()
    metrics, evals, emb = data.read_jsonl(metrics_path), data.read_jsonl(evals_path), {}
    rewards = [m["reward"] for m in metrics]
    step = start
    with tqdm(total=cfg.student_steps, initial=start, disable=rank != 0, desc=method, dynamic_ncols=True) as bar:
        while True:
            if step % cfg.eval_every == 0 or step == cfg.fixed_step or step == cfg.student_steps:
                rloo.sync_weights(policy, llm)
                evals.append({"step": step, **eval_passk(llm, test, cfg, seed, step)})
                if rank == 0:
                    data.append_jsonl(evals_path, [evals[-1]])
            if step >= cfg.student_steps or finished(rewards, step, cfg, offset):
                break
            t0 = time.perf_counter()
            rloo.reset_counts()   # this step's counts only (not the evaluation's, nor another run's)
            source, pool, idx = batch_at(step, synthetic, real, cfg, seed)
            portfolio = None
            if cfg.sampler == "leeps":   # its history: the metrics rows of earlier steps on this pool
                if source not in emb:   # once per pool, not every step
                    emb[source] = data.embed_ngram([q["question"] for q in pool])
                idx, portfolio = leeps(len(pool), emb[source], [m for m in metrics if m["source"] == source],
                                       cfg.student_questions, random.Random(f"{seed}/leeps/{step}"))
            sampler_s = time.perf_counter() - t0
            stats = rloo.student_step(policy, llm, [(pool[i]["question"], pool[i]["answer"]) for i in idx],
                                      samples=cfg.student_samples, temperature=cfg.sept_temperature if sept else
                                      cfg.temperature, max_tokens=cfg.student_max_tokens, sept=sept,
                                      seed=rloo.seed_of(seed, "student", step), group=dist.group.WORLD,
                                      micro_batch_tokens=cfg.micro_batch_tokens)
            rewards.append(stats["reward"])
            metrics.append({"step": step, "source": source, "questions": idx, "portfolio": portfolio, **stats,
                            "nontrivial_share": statistics.fmean(stats["nontrivial"]), "skipped_updates": 0,
                            **rloo.gather_counts(), "sampler_seconds": round(sampler_s, 4),
                            "seconds": round(time.perf_counter() - t0, 3)})
            if rank == 0:
                data.append_jsonl(metrics_path, metrics[-1:])
            step += 1
            bar.update(1)
            bar.set_postfix(reward=f"{stats['reward']:.1f}", acc=f"{stats['accuracy']:.3f}")
            if step % cfg.ckpt_every == 0:
                rloo.save_checkpoint(out, step, {"policy": (policy, True)}, {"step": step, "config": config})
    res = dict(method=os.path.basename(os.path.dirname(out)), test=cfg.test, seed=seed, mode=cfg.mode,
               samples=cfg.student_samples, steps_done=step,
               n_synthetic=len(synthetic), n_real=len(real), sampler=cfg.sampler,
               nontrivial_share=statistics.fmean(m["nontrivial_share"] for m in metrics) if metrics else None,
               **select(evals, rewards, cfg, offset))
    if rank == 0:
        data.write_json(os.path.join(out, "result.json"), res)
        shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)  # optimizer state: GBs per run at scale
    dist.barrier()
    return res


# ---------------------------------------------------------------------------------------------
# commands that need the engines

def setup(cfg: Config, question_sets: list[list[dict]], teacher: bool = False):
    """mesh (one FSDP mesh over all ranks: the student is sharded over all of them and every rank's
    engine generates its share), tokenizer and one engine per rank, long enough for the longest
    question of any set plus a completion, and if `teacher`, for a teacher prompt plus its sample
    and for such a sample as a question."""
    from transformers import AutoTokenizer
    _, world_size, device = rloo.init_distributed()
    mesh = init_device_mesh(device.type, (world_size,))
    tok = AutoTokenizer.from_pretrained(cfg.model)
    seq_len = rloo.engine_len(tok, [q["question"] for qs in question_sets for q in qs], cfg.student_max_tokens,
                              cfg.teacher_max_tokens if teacher else 0)
    bad = [msg for b, msg in [
        (cfg.student_samples < 2 or cfg.big_group < 2, "--student_samples and --big_group: RLOO needs at least 2"),
        (min(cfg.student_questions, cfg.eval_every, cfg.ckpt_every, cfg.passk_samples) < 1,
         "--student_questions, --eval_every, --ckpt_every and --passk_samples must be at least 1"),
        (cfg.micro_batch_tokens < seq_len, f"--micro_batch_tokens {cfg.micro_batch_tokens} is less than one "
                                           f"sequence (prompt + completion: up to {seq_len} tokens)")] if b]
    if bad:
        raise SystemExit("eval.py: these settings cannot work:\n  " + "\n  ".join(bad))
    llm = rloo.build_engine(cfg.model, seed=int(cfg.seeds.split(",")[0]),
                            gpu_memory_utilization=cfg.gpu_memory_utilization, max_model_len=seq_len)
    return mesh, tok, llm


def run_dir(cfg: Config, method: str, seed: int) -> str:
    """<runs>/<method>[+leeps]/seed<s>: "+leeps" marks a fresh student on the LEEPS sampler (the row's name too)"""
    name = method + "+leeps" if cfg.sampler == "leeps" and method not in ("base", "ps") else method
    return os.path.join(cfg.runs, name, f"seed{seed}")


def done(cfg: Config, method: str, seed: int) -> bool:
    return os.path.exists(os.path.join(run_dir(cfg, method, seed), "result.json"))


def cmd_row(cfg: Config, methods: list[str]) -> None:
    """The rows `methods` x seeds, each into its run folder (a method outside ROWS is the `train`
    command's --name: a fresh student on --synthetic + hard train)."""
    seeds = [int(s) for s in cfg.seeds.split(",")]
    if all(done(cfg, m, s) for m in methods for s in seeds):   # before any engine is built
        if os.environ.get("RANK", "0") == "0":
            print(f"{cfg.runs}: {', '.join(methods)} x seeds {cfg.seeds}: all finished already; nothing to do")
        return
    teachers = {"grounded-t": cfg.teacher or os.path.join(cfg.soar, "teacher"), "base-t": "",
                "intrinsic-t": os.path.join(cfg.intrinsic, "teacher") if cfg.intrinsic else "--intrinsic",
                "opensir-t": os.path.join(cfg.opensir, "teacher") if cfg.opensir else "--opensir"}
    pq_path = os.path.join(cfg.soar, "pq.jsonl")   # empty until a promotion
    inputs = {**teachers, "pq": pq_path, "ps": os.path.join(cfg.soar, "student"), "upper": cfg.extra or "--extra",
              "upper-128": cfg.extra or "--extra"}
    for m in ("pq-correct", "pq-wellposed"):   # the built-in world labels its own questions
        inputs[m] = (cfg.labels or "--labels") if cfg.model else pq_path
    missing = {m: inputs[m] for m in methods if inputs.get(m) and not os.path.exists(inputs[m])}
    if missing:
        raise SystemExit(f"missing inputs (method: path or flag): {missing}")
    cfg = world.resolve(cfg)
    teachers["base-t"] = cfg.model
    soar = soar_config(cfg.soar) if any(m in ("ps", "grounded-t") or m.startswith("pq") for m in methods) else None
    if soar:   # SOAR's outputs only mean something against the base model SOAR started from
        if os.path.realpath(soar_model := soar["model"]) != os.path.realpath(cfg.model):
            raise SystemExit(f"{cfg.soar} was run from {soar_model}, not from --model {cfg.model}")
    if not (cfg.train and cfg.test):
        raise SystemExit("--train and --test are required with --model: the fail@128 train and test splits")
    hard, test = data.load_problems(cfg.train), data.load_problems(cfg.test)
    extra = data.load_problems(cfg.extra) if any(m.startswith("upper") for m in methods) else []
    pq = data.load_problems(pq_path) if any(m.startswith("pq") for m in methods) else []
    custom = data.load_problems(cfg.synthetic) if cfg.synthetic else []
    mesh, tok, llm = setup(cfg, [hard, test, extra, pq, custom], teacher=bool(set(methods) & set(teachers)))
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    for method in methods:
        for seed in seeds:
            out = run_dir(cfg, method, seed)
            rloo.lock_folder(out)   # one process per run folder
            if done(cfg, method, seed):
                say(f"{out}: finished already")
                continue
            synthetic = pq if method == "pq" else pq_subset(pq, method[3:], cfg) if method.startswith("pq-") else None
            if synthetic == []:
                say(f"{method}: skipped, {cfg.soar} has no such promotion questions yet", flush=True)
                continue
            if method in ("base", "ps"):
                path = cfg.model if method == "base" else os.path.join(cfg.soar, "student")
                res = inference_run(cfg, seed, method, path, llm, mesh, test, out)
            else:
                if method in teachers:   # questions of a teacher: sampled once per seed, kept in the run folder
                    qpath = os.path.join(out, "questions.jsonl")
                    synthetic = data.read_jsonl(qpath)
                    if not synthetic:
                        synthetic = teacher_questions(teachers[method], cfg, seed, llm, tok, mesh)
                        if dist.get_rank() == 0:
                            data.write_jsonl(qpath, synthetic)
                elif method.startswith("upper"):
                    synthetic = extra if method == "upper" else \
                        random.Random(f"{seed}/upper").sample(extra, min(cfg.teacher_questions, len(extra)))
                elif synthetic is None:
                    synthetic = [] if method in ROWS else custom
                res = train_run(cfg, seed, method, synthetic, hard, test, llm, mesh, out)
            say(f"{method} seed {seed}: " + "  ".join(f"{k} {100 * v:.1f}%" for k, v in res["passk"].items()),
                flush=True)


def pq_subset(pq: list[dict], which: str, cfg: Config) -> list[dict]:
    """The promotion questions of row pq-correct (`which` "correct": the answer is right) or pq-wellposed
    ("wellposed": a complete, solvable problem, its answer right or not; the paper's appendix C.5). Labels
    from --labels (a jsonl with question, correct and well_posed, e.g. from a judge model), else from the
    built-in world, which reads its own problems back (world.describe)."""
    key = "correct" if which == "correct" else "well_posed"
    if not cfg.labels:
        return [q for q in pq if world.describe(q["question"], q["answer"])[key]]
    labels = {r["question"]: r for r in data.read_jsonl(cfg.labels)}
    if missing := [q["question"] for q in pq if key not in labels.get(q["question"], {})]:
        raise ValueError(f"{cfg.labels} has no {key!r} label for {len(missing)} promotion questions, "
                         f"e.g. {missing[0]!r}")
    return [q for q in pq if labels[q["question"]][key]]


def cmd_sample_teacher(cfg: Config, args: list[str]) -> None:
    cfg = world.resolve(cfg)
    path = args[0] if args else cfg.teacher or os.path.join(cfg.soar, "teacher")
    if not cfg.out:
        raise SystemExit("sample-teacher needs --out FILE")
    mesh, tok, llm = setup(cfg, [], teacher=True)
    qs = teacher_questions(path, cfg, int(cfg.seeds.split(",")[0]), llm, tok, mesh)
    if dist.get_rank() == 0:
        data.write_jsonl(cfg.out, qs)
        print(f"wrote {len(qs)} questions of {path} to {cfg.out}")


def cmd_filter(cfg: Config, pools: list[str]) -> None:
    """fail@128 (METHOD.md "Data"): for each pool, keep the problems the model never solves in
    filter_samples tries, split them 50/50 (seeded). Writes <out>/<pool>/ counts.jsonl (per problem,
    appended per chunk: a rerun continues), train.jsonl, test.jsonl, filter.json."""
    if not (cfg.model and cfg.out and pools):
        raise SystemExit("filter needs pools (math, harp, olympiad or files), --model and --out")
    problems = {p: data.load_problems(p) for p in pools}
    mesh, tok, llm = setup(cfg, list(problems.values()))
    n, chunk, rank = cfg.filter_samples, max(1, 8192 // cfg.filter_samples), dist.get_rank()
    for pool, probs in problems.items():
        out = os.path.join(cfg.out, os.path.splitext(os.path.basename(pool))[0])
        counts_path = os.path.join(out, "counts.jsonl")
        have = data.read_jsonl(counts_path)
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            print(f"{pool}: {len(probs)} problems, {len(have)} done", flush=True)
        for lo in tqdm(range(len(have), len(probs), chunk), disable=rank != 0, desc=pool, dynamic_ncols=True):
            counts = rloo.correct_counts(llm, probs[lo:lo + chunk], n=n, max_tokens=cfg.student_max_tokens,
                                         seed=rloo.seed_of(int(cfg.seeds.split(",")[0]), "filter") + lo,
                                         temperature=cfg.temperature, group=dist.group.WORLD)
            if rank == 0:
                data.append_jsonl(counts_path, [{"index": lo + i, "correct": c} for i, c in enumerate(counts)])
            dist.barrier()
        counts = [r["correct"] for r in data.read_jsonl(counts_path)]
        hard = [p for p, c in zip(probs, counts) if c == 0]
        train, test = data.split_train_test(hard, cfg.split_seed)
        if rank == 0:
            data.write_jsonl(os.path.join(out, "train.jsonl"), train)
            data.write_jsonl(os.path.join(out, "test.jsonl"), test)
            data.write_json(os.path.join(out, "filter.json"), dict(pool=pool, model=cfg.model, samples=n,
                                                                   problems=len(probs), kept=len(hard),
                                                                   train=len(train), test=len(test)))
            print(f"{pool}: {len(hard)} of {len(probs)} never solved in {n} samples -> {len(train)} train / "
                  f"{len(test)} test in {out}")


# ---------------------------------------------------------------------------------------------
# commands that need no engine

def vendi_of(questions: list[str], cfg: Config) -> tuple[float, float]:
    return data.vendi_bootstrap(data.embed(questions, cfg.embed), cfg.vendi_subset, cfg.vendi_draws)


def cmd_vendi(cfg: Config, files: list[str]) -> None:
    for f in files:
        qs = [q["question"] for q in data.load_problems(f)]
        if not qs:
            raise ValueError(f"{f} has no questions")
        print(f"{f}: Vendi {'{:.2f} +- {:.2f}'.format(*vendi_of(qs, cfg))} ({len(qs)} questions, subsets of "
              f"{min(len(qs), cfg.vendi_subset)}, embedding {cfg.embed})")


def ordered(methods) -> list[str]:
    return sorted(methods, key=lambda m: (list(ROWS).index(m) if m in ROWS else len(ROWS), m))


def table(results: list[dict], test: str) -> list[str]:
    """Tables 4-6: rows = methods (the paper's order), columns = pass@k in %, mean ± std over seeds,
    the difference of the largest k's pass@k to Hard-Only's, paired by seed, with its 95% bootstrap CI,
    and the step the row's number comes from (early-stopping step, fixed step, or the last window)."""
    rs = [r for r in results if r["test"] == test]
    ks = sorted({k for r in rs for k in r["passk"]}, key=lambda k: int(k[5:]))
    ref = {r["seed"]: r["passk"][ks[-1]] for r in rs if r["method"] == "hard-only"}
    lines = [f"## pass@k (%) on `{test}`", "", "| method | " + " | ".join(ks) + f" | {ks[-1]} - Hard-Only [95% CI] "
             "| seeds | step | non-trivial |", "|---|" + "---|" * (len(ks) + 4)]
    for m in ordered({r["method"] for r in rs}):
        mr = [r for r in rs if r["method"] == m]
        cells = ["{:.1f} ± {:.1f}".format(*mean_std([100 * r["passk"][k] for r in mr if k in r["passk"]])) for k in ks]
        steps = [r["stop_step"] for r in mr if "stop_step" in r]
        step = f"{statistics.fmean(steps):.0f} ({mr[0]['rule']})" if steps else "-"
        shares = [100 * r["nontrivial_share"] for r in mr if r.get("nontrivial_share") is not None]
        share = "{:.0f} ± {:.0f}%".format(*mean_std(shares)) if shares else "-"   # question groups with a reward signal
        diffs = [100 * (r["passk"][ks[-1]] - ref[r["seed"]]) for r in mr if r["seed"] in ref and ks[-1] in r["passk"]]
        delta = "{:+.1f} [{:+.1f}, {:+.1f}]".format(statistics.fmean(diffs), *paired_ci(diffs)) \
            if diffs and m != "hard-only" else "-"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {delta} | {len(mr)} | {step} | {share} |")
    return lines + [""]


def plot_curves(results: list[dict], path: str) -> bool:
    """Test pass@k over fresh-student training steps (mean over seeds), one panel per (test, k);
    inference rows (base, ps) as dashed levels."""
    import matplotlib.pyplot as plt
    curves = {}
    for r in results:
        for e in data.read_jsonl(os.path.join(r["dir"], "evals.jsonl")):
            for k in (k for k in e if k.startswith("pass@")):
                curves.setdefault((r["test"], r["method"], k), {}).setdefault(e["step"], []).append(e[k])
    if not curves:
        return False
    tests = sorted({t for t, _, _ in curves})
    ks = sorted({k for _, _, k in curves}, key=lambda k: int(k[5:]))
    fig, axes = plt.subplots(len(tests), len(ks), figsize=(3.2 * len(ks), 2.8 * len(tests)), squeeze=False)
    for i, t in enumerate(tests):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            for m in ordered({m for tt, m, kk in curves if (tt, kk) == (t, k)}):
                pts = sorted(curves[t, m, k].items())
                ax.plot([s for s, _ in pts], [100 * statistics.fmean(v) for _, v in pts], marker=".", label=m)
            for m in ordered({r["method"] for r in results if r["test"] == t and "steps_done" not in r}):
                ys = [r["passk"][k] for r in results if (r["test"], r["method"]) == (t, m) and k in r["passk"]]
                if ys:
                    ax.axhline(100 * statistics.fmean(ys), ls="--", lw=1, color="grey" if m == "base" else "k", label=m)
            ax.set_title(f"{k} on {os.path.basename(t)}", fontsize=9)
            ax.set_xlabel("training step")
            ax.set_ylabel("%")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_soar(runs: dict[str, list[dict]], path: str) -> None:
    """SOAR's outer loop from each run's metrics.jsonl, a panel per run: teacher reward, its moving
    average, promotions."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.2), squeeze=False, sharey=True)
    for ax, (name, metrics) in zip(axes[0], runs.items()):
        steps = [m["step"] for m in metrics]
        ax.plot(steps, [m["reward"] for m in metrics], marker=".", label="teacher reward (mean_k R_k)")
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
    """the settings a soar.py --out folder was run with (its newest checkpoint's); None before its first step"""
    ckpts = rloo.ckpt_dirs(folder)
    return data.read_json(os.path.join(ckpts[-1], "state.json"))["config"] if ckpts else None


def teacher_runs(cfg: Config) -> dict[str, dict]:
    """The soar.py runs named by --soar, --intrinsic and --opensir (comma lists) that have a finished
    step: their teacher reward (from the run's config), metrics, and curriculum (what the teacher wrote)."""
    runs = {}
    for d in ",".join(x for x in (cfg.soar, cfg.intrinsic, cfg.opensir) if x).split(","):
        metrics, config = data.read_jsonl(os.path.join(d, "metrics.jsonl")), soar_config(d)
        if metrics and config:
            runs[d] = dict(reward=config["reward"], metrics=metrics,
                           curriculum=curriculum(data.read_jsonl(os.path.join(d, "questions.jsonl"))))
    return runs


def curriculum(questions: list[dict]) -> dict[int, dict[str, float]]:
    """per outer step, the share of each world.CATEGORIES among the teacher's questions"""
    per = {}
    for q in questions:
        per.setdefault(q["step"], []).append(world.describe(q["question"], q["answer"])["category"])
    return {s: {c: cs.count(c) / len(cs) for c in world.CATEGORIES} for s, cs in sorted(per.items())}


def teacher_learning(runs: dict[str, dict]) -> list[str]:
    """Does the teacher learn? Per teacher reward, over its runs (seeds): (a) the share of steps before
    the first promotion whose g datasets got different rewards (else the RLOO gradient is 0); (b) the
    slope of the step reward Rhat over steps, pooled, with a 95% bootstrap CI over seeds; (c) the share
    of world.USEFUL questions in the first and the last quarter of the steps."""
    lines = ["| teacher reward | runs | steps | (a) steps with reward variance, before the 1st promotion | "
             "(b) slope of Rhat per step [95% CI] | (c) useful share, first -> last quarter |", "|---|---|---|---|---|---|"]
    for reward in sorted({r["reward"] for r in runs.values()}):
        rs = [r for r in runs.values() if r["reward"] == reward]
        before = [m for r in rs for m in r["metrics"][:next((i for i, m in enumerate(r["metrics"]) if m["promoted"]),
                                                             len(r["metrics"]))]]
        a = statistics.fmean(len(set(m["R_k"])) > 1 for m in before) if before else math.nan
        b = slope_ci([[m["reward"] for m in r["metrics"]] for r in rs])
        first, last = [], []
        for r in rs:
            shares = [sum(v[c] for c in world.USEFUL) for v in r["curriculum"].values()]
            if shares:   # a run from before soar.py wrote questions.jsonl has none
                q = max(1, len(shares) // 4)
                first, last = first + [statistics.fmean(shares[:q])], last + [statistics.fmean(shares[-q:])]
        c = "{:.0%} ± {:.0%} -> {:.0%} ± {:.0%}".format(*mean_std(first), *mean_std(last)) if first else "-"
        lines.append(f"| {reward} | {len(rs)} | {min(len(r['metrics']) for r in rs)} | {a:.0%} of {len(before)} | "
                     "{:+.4f} [{:+.4f}, {:+.4f}] | {} |".format(*b, c))
    return lines


def plot_curriculum(runs: dict[str, dict], path: str) -> None:
    """What the teacher wrote over the outer steps: the share of each world.CATEGORIES among its
    questions, a row per teacher reward and a panel per run (seed)."""
    import matplotlib.pyplot as plt
    rewards = sorted({r["reward"] for r in runs.values()})
    by = {w: [(d, r) for d, r in runs.items() if r["reward"] == w] for w in rewards}
    cols = max(map(len, by.values()))
    fig, axes = plt.subplots(len(rewards), cols, figsize=(3.2 * cols, 2.6 * len(rewards)), squeeze=False,
                             sharex=True, sharey=True)
    for i, w in enumerate(rewards):
        for j, (d, r) in enumerate(by[w]):
            cur = r["curriculum"]
            axes[i][j].stackplot(list(cur), *[[v[c] for v in cur.values()] for c in world.CATEGORIES],
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
    --runs, the Vendi score of every question set in sight (the PQ of each --soar run, the teachers'
    samples), and the plots curves.png (fresh students) and soar.png (each --soar run's metrics.jsonl)."""
    import matplotlib
    matplotlib.use("Agg")
    out = cfg.out or cfg.runs
    os.makedirs(out, exist_ok=True)
    results = []
    for path in sorted(glob.glob(os.path.join(cfg.runs, "**", "result.json"), recursive=True)):
        with open(path) as f:
            results.append({**json.load(f), "dir": os.path.dirname(path)})
    lines = ["# SOAR evaluation", ""]
    for test in sorted({r["test"] for r in results}):
        lines += table(results, test)
    runs = {d: m for d in cfg.soar.split(",") if (m := data.read_jsonl(os.path.join(d, "metrics.jsonl")))}
    sets = {"pq": [os.path.join(d, "pq.jsonl") for d in runs]}
    for path in sorted(glob.glob(os.path.join(cfg.runs, "*", "seed*", "questions.jsonl"))):
        sets.setdefault(os.path.basename(os.path.dirname(os.path.dirname(path))), []).append(path)
    rows = []   # a Vendi score per file (a seed's questions), mean ± std over the files
    for m in ordered(sets):
        qs = [[q["question"] for q in data.read_jsonl(p)] for p in sets[m]]
        scores = [vendi_of(q, cfg)[0] for q in qs if q]
        if scores:
            rows.append("| {} | {:.2f} ± {:.2f} | {} | {} |".format(m, *mean_std(scores), len(scores),
                                                                   sum(map(len, qs))))
    if rows:
        lines += [f"## Diversity: Vendi score ({cfg.embed} embedding, mean over {cfg.vendi_draws} subsets of "
                  f"{cfg.vendi_subset}; mean ± std over seeds)", "", "| questions | Vendi | seeds | n |",
                  "|---|---|---|---|", *rows, ""]
    if plot_curves(results, os.path.join(out, "curves.png")):
        lines += ["## Test pass@k over fresh-student training", "", "![curves](curves.png)", ""]
    if runs:   # the SOAR runs with at least one finished step
        plot_soar(runs, os.path.join(out, "soar.png"))
        lines += ["## SOAR's outer loop", "", *(f"- {d}: {len(m)} outer steps, {m[-1]['promotions']} promotions"
                                              for d, m in runs.items()), "", "![soar](soar.png)", ""]
    teachers = teacher_runs(cfg)
    if teachers:
        lines += ["## Does the teacher learn?", "", *teacher_learning(teachers), ""]
    if any(v[world.CATEGORIES[0]] < 1 for r in teachers.values() for v in r["curriculum"].values()):
        plot_curriculum(teachers, os.path.join(out, "curriculum.png"))   # the built-in world's questions
        lines += ["## What the teachers wrote (built-in world)", "", "![curriculum](curriculum.png)", ""]
    text = "\n".join(lines)
    data.write_text(os.path.join(out, "report.md"), text)
    print(text)
    return text


COMMANDS = {"filter": cmd_filter, "row": cmd_row, "train": lambda cfg, _: cmd_row(cfg, [cfg.name]),
            "sample-teacher": cmd_sample_teacher, "vendi": cmd_vendi, "report": cmd_report}


def main(argv=None):
    command, args, cfg = parse_args(argv)
    with rloo.clean_exit("eval.py"):
        COMMANDS[command](cfg, args)


if __name__ == "__main__":
    main()
