"""Evaluation of SOAR (SPEC.md "Evaluation protocol" and "Data"): pass@k, the fail@128 filter,
fresh-student RLOO runs with the early-stopping rule, the rows of the paper's Tables 4-6, Vendi
diversity, and a report (markdown table + PNG plots).

    python eval.py filter math harp olympiad --model M --out data    # data/<pool>/{train,test}.jsonl
    torchrun --nproc_per_node 8 eval.py row base ps hard-only pq grounded-t base-t --model M \\
        --hard data/math/train.jsonl --test data/math/test.jsonl --soar runs/math --runs runs/eval/math \\
        --mode curriculum --seeds 0,1,2
    torchrun --nproc_per_node 8 eval.py row pq --model M --hard data/math/train.jsonl \\
        --test data/olympiad/test.jsonl --soar runs/math --runs runs/eval/olympiad --fixed_step 50
    python eval.py train --synthetic my_questions.jsonl --name mine ...   # any question set + hard train
    python eval.py sample-teacher runs/math/teacher --out q.jsonl        # 128 teacher questions
    python eval.py vendi q.jsonl runs/math/pq.jsonl                      # diversity
    python eval.py report --runs runs/eval/math --soar runs/math         # report.md + PNGs in --runs
Without --model everything runs on the built-in world (world.py) with small settings (WORLD_DEFAULTS).

A run folder is <runs>/<method>/seed<s>/: metrics.jsonl (one line per training step), evals.jsonl
(test pass@k every --eval_every steps), ckpt/ (resume), result.json (the row's numbers; a run that
has one is finished and is skipped when the command is rerun; any other rerun continues).
"""
import argparse
import dataclasses
import glob
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import data
import rloo
import soar


@dataclasses.dataclass
class Config:
    # ---- what to evaluate ----
    model: str = ""             # base model (every fresh student starts here); "" = the built-in world
    world: str = "default"      # which built-in world without --model: "default" or "small" (tests)
    hard: str = ""              # hard train split (question/answer jsonl/parquet); "" = the world's
    test: str = ""              # hard test split; "" = the world's
    soar: str = "runs/soar"     # a soar.py --out folder: pq.jsonl, student/, teacher/, metrics.jsonl
    teacher: str = ""           # teacher HF folder for grounded-t; "" = <soar>/teacher
    intrinsic: str = ""         # the --out folder of a `soar.py --reward learnability` run (intrinsic-t)
    extra: str = ""             # curated real questions for the upper-bound rows (e.g. MATH train)
    synthetic: str = ""         # `train`: the question set to add to the hard train split
    name: str = ""              # `train`: the method name (run folder and report row)
    runs: str = "runs/eval"     # run folders: <runs>/<method>/seed<s>/; the report goes here too
    out: str = ""               # `filter`: output folder; `sample-teacher`: output file; `report`: folder
    seeds: str = "0"            # comma list: sampling seeds (inference rows) or training seeds
    seed: int = 0               # set per run from --seeds
    # ---- pass@k (SPEC: k in {1,4,8,16,32} from 32 samples per test problem) ----
    passk_samples: int = 32
    # ---- fail@128 filter (SPEC "Data"): 128 samples, T = 1, 1024 tokens, keep 0-correct, 50/50 ----
    filter_samples: int = 128
    split_seed: int = 0
    # ---- fresh students (SPEC Table 3, student column; "Evaluation protocol") ----
    mode: str = "mixed"         # "mixed" (HARP, Olympiad) or "curriculum" (MATH)
    steps: int = 1500           # at most; the early-stopping rule usually ends a run before
    switch_step: int = 64       # curriculum: synthetic only for this many steps, then real only
    warmup: int = 20            # lr warmup of mixed runs; curriculum runs use 0 (SPEC)
    lr: float = 1e-5
    samples: int = 32           # RLOO group size per question
    big_group: int = 128        # the group of the hard-only-128 row
    questions: int = 8          # questions per step
    kl_coef: float = 0.001      # to the model the run started from
    temperature: float = 1.0
    max_tokens: int = 1024      # student completions (training, pass@k, filter)
    teacher_max_tokens: int = 512
    teacher_questions: int = 128  # questions sampled from a teacher (and real questions of upper-128)
    eval_every: int = 20        # test pass@k every this many steps
    ckpt_every: int = 100
    fixed_step: int = 0         # > 0: report the test metric at this step instead (OlympiadBench: 50)
    # ---- early stopping (SPEC "Evaluation protocol") ----
    es_window: int = 25         # centred moving average of the mean training reward
    es_fraction: float = 0.15   # stop at the first step whose slope < this * the max slope
    es_average: int = 200       # report the test metric averaged over the next this many steps
    # ---- diversity (SPEC: Vendi over 128-question subsets, 100 draws) ----
    embed: str = "ngram"        # "ngram" (offline, no model) or a HF model path (mean-pooled states)
    vendi_subset: int = 128
    vendi_draws: int = 100
    # ---- systems ----
    micro_batch_tokens: int = 16384
    gpu_memory_utilization: float = 0.3


# The built-in world: a tiny model on 2 CPU cores, so short runs, short answers, a big lr (as soar.py's).
WORLD_DEFAULTS = dict(steps=24, switch_step=6, warmup=2, lr=1e-3, samples=8, big_group=16, questions=4,
                      max_tokens=48, teacher_max_tokens=48, teacher_questions=32, eval_every=4, ckpt_every=8,
                      es_window=5, es_average=8, filter_samples=32, vendi_subset=32, vendi_draws=20)
KS = (1, 4, 8, 16, 32)
ENGINES = []   # built by setup(); shut down before the process group goes (main)
# settings that a resumed fresh-student run must share with its checkpoint
RUN_KEYS = ("mode", "switch_step", "warmup", "lr", "samples", "questions", "kl_coef", "temperature",
            "max_tokens", "model")

# The rows of the paper's Tables 4-6, in the paper's order (the report keeps it).
ROWS = {
    "base": "the base model, inference only",
    "hard-only": "fresh student, RLOO on the hard train split alone (group --samples)",
    "hard-only-128": "the same, group --big_group (128)",
    "intrinsic-t": "fresh student on 128 questions of the learnability teacher (<intrinsic>/teacher) + hard train",
    "base-t": "fresh student on 128 questions of the base model as teacher + hard train",
    "pq": "fresh student on SOAR's promotion questions (<soar>/pq.jsonl) + hard train",
    "ps": "SOAR's promoted student (<soar>/student), inference only",
    "grounded-t": "fresh student on 128 questions of SOAR's teacher (<soar>/teacher) + hard train",
    "upper-128": "fresh student on 128 questions of --extra + hard train",
    "upper": "fresh student on all of --extra (e.g. MATH train) + hard train",
}


def parse_args(argv=None) -> tuple[str, list[str], Config]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="rows:\n" + "\n".join(f"  {k:14} {v}" for k, v in ROWS.items()))
    p.add_argument("command", choices=["filter", "row", "train", "sample-teacher", "vendi", "report"])
    p.add_argument("args", nargs="*", help="filter: pools; row: methods; sample-teacher: a teacher; vendi: files")
    for f in dataclasses.fields(Config):
        p.add_argument(f"--{f.name}", type=f.type, default=None)
    a = vars(p.parse_args(argv))
    command, args = a.pop("command"), a.pop("args")
    flags = {k: v for k, v in a.items() if v is not None}
    cfg = Config(**{**({} if flags.get("model") else WORLD_DEFAULTS), **flags})
    if cfg.mode not in ("mixed", "curriculum"):
        p.error(f"--mode must be mixed or curriculum, not {cfg.mode!r}")
    if command == "row" and (not args or set(args) - set(ROWS)):
        p.error(f"row needs methods out of: {', '.join(ROWS)}")
    if command == "train" and not (cfg.synthetic and cfg.name) or cfg.name in ROWS:
        p.error("train needs --synthetic FILE and --name NAME (a name that is not one of the rows)")
    return command, args, cfg


# ---------------------------------------------------------------------------------------------
# pure statistics (tested against brute force / known answers)

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (SPEC): 1 - C(n-c,k)/C(n,k), in the product
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


def early_stop(rewards: list[float], window: int = 25, fraction: float = 0.15) -> int | None:
    """SPEC's rule: smooth the mean training reward with a centred moving average of `window`
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


def batch_at(step: int, synthetic: list[dict], real: list[dict], cfg: Config) -> tuple[str, list[dict]]:
    """The questions of training step `step`, a pure function of (seed, step), so a resumed run
    replays exactly. mixed: one pool (synthetic + real) walked in a fresh shuffle each epoch;
    curriculum: synthetic for the first switch_step steps, then real (SPEC)."""
    if cfg.mode == "curriculum" and step < cfg.switch_step:
        source, pool, i = "synthetic", synthetic, step
    elif cfg.mode == "curriculum":
        source, pool, i = "real", real, step - cfg.switch_step
    else:
        source, pool, i = "mixed", synthetic + real, step
    batch = []
    for pos in range(i * cfg.questions, (i + 1) * cfg.questions):
        epoch, j = divmod(pos, len(pool))
        order = list(range(len(pool)))
        random.Random(f"{cfg.seed}/{source}/{epoch}").shuffle(order)
        batch.append(pool[order[j]])
    return source, batch


# ---------------------------------------------------------------------------------------------
# Vendi diversity (SPEC "Evaluation protocol")

def embed_ngram(texts: list[str], dim: int = 4096, n: int = 3) -> np.ndarray:
    """Character n-gram counts hashed into `dim` buckets (crc32: stable across runs), L2-normalised.
    The default because it needs no model and no network and is deterministic: it measures surface
    diversity, which is what separates the teachers in the paper (Intrinsic-T's collapse onto
    near-copies). Its numbers are not on the scale of the paper's (whose embedding is unstated); pass
    --embed <HF model> for a semantic embedding, and compare methods only under one embedding."""
    X = np.zeros((len(texts), dim))
    for r, t in enumerate(texts):
        t = " ".join(t.lower().split())
        for i in range(max(1, len(t) - n + 1)):
            X[r, zlib.crc32(t[i:i + n].encode()) % dim] += 1
    return X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)


@torch.no_grad()
def embed_hf(texts: list[str], path: str, batch: int = 32) -> np.ndarray:
    """Mean-pooled last hidden states of a HF model (e.g. the base model, or a sentence encoder)."""
    from transformers import AutoModel, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    tok.pad_token = tok.pad_token or tok.eos_token
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], return_tensors="pt", padding=True, truncation=True, max_length=512)
        h = model(**enc).last_hidden_state
        m = enc.attention_mask[..., None].to(h.dtype)
        out.append(((h * m).sum(1) / m.sum(1)).float().numpy())
    return np.concatenate(out)


def vendi(X: np.ndarray) -> float:
    """VS = exp(-sum l log l) over the eigenvalues l of K/n, K the cosine kernel of the rows of X.
    Identical items give 1, mutually orthogonal ones give n."""
    X = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)
    lam = np.linalg.eigvalsh(X @ X.T / len(X))
    lam = lam[lam > 1e-12]
    return float(np.exp(-(lam * np.log(lam)).sum()))


def vendi_bootstrap(X: np.ndarray, subset: int = 128, draws: int = 100, seed: int = 0) -> tuple[float, float]:
    """Mean and std of VS over `draws` random subsets of `subset` questions, drawn without
    replacement (duplicates would read as lost diversity); a set of <= subset questions is one draw."""
    if len(X) <= subset:
        return vendi(X), 0.0
    rng = np.random.default_rng(seed)
    return mean_std([vendi(X[rng.choice(len(X), subset, replace=False)]) for _ in range(draws)])


def embed(texts: list[str], cfg: Config) -> np.ndarray:
    return embed_ngram(texts) if cfg.embed == "ngram" else embed_hf(texts, cfg.embed)


# ---------------------------------------------------------------------------------------------
# sampling and grading on the engines (every rank calls these; generation and grading are split
# over the ranks of `group`, results gathered on all)

def correct_counts(llm, problems: list[dict], *, n: int, max_tokens: int, seed: int, temperature: float = 1.0,
                   group=None, chunk: int = 0, progress: bool = False) -> list[int]:
    """How many of n samples (student prompt) are correct (the 120 case) for each problem. Done in
    chunks of prompts so 5000 x 128 samples never sit in memory at once; request i carries seed + i
    whatever the chunking (rloo.generate), so results do not depend on it."""
    grade = soar.grade if dist.is_initialized() else (lambda c, g, _: data.grade(c, g))
    chunk = chunk or max(1, 8192 // n)
    counts = []
    for lo in tqdm(range(0, len(problems), chunk), disable=not progress, desc="sampling", dynamic_ncols=True):
        part = problems[lo:lo + chunk]
        outs = rloo.generate(llm, [data.student_prompt(p["question"]) for p in part], n=n, temperature=temperature,
                             max_tokens=max_tokens, seed=seed + lo, group=group)
        rewards = grade([s.text for o in outs for s in o], [p["answer"] for p in part for _ in range(n)], group)
        counts += [sum(r == data.R_CORRECT for r in rewards[i * n:(i + 1) * n]) for i in range(len(part))]
    return counts


def fail_at_k(llm, problems: list[dict], k: int = 128, max_tokens: int = 1024, seed: int = 0, group=None,
              temperature: float = 1.0) -> list[dict]:
    """The fail@k filter (SPEC "Data"): the problems with 0 correct out of k samples at T = 1."""
    counts = correct_counts(llm, problems, n=k, max_tokens=max_tokens, seed=seed, temperature=temperature, group=group)
    return [p for p, c in zip(problems, counts) if c == 0]


def eval_passk(llm, test: list[dict], cfg: Config, key) -> dict:
    counts = correct_counts(llm, test, n=cfg.passk_samples, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                            seed=soar.seed_of(cfg, "passk", key), group=dist.group.WORLD)
    return {**mean_passk(counts, cfg.passk_samples), "solved": sum(c > 0 for c in counts)}


def frozen(path: str, mesh):
    """The model in HF folder `path` as a sharded policy, only to reach the engines through
    rloo.sync_weights (the one exact sync path; the engine is built once, from --model)."""
    return rloo.load_policy(path, mesh, lr=0.0, warmup_steps=0, total_steps=1, kl_coef=0.0)


def sample_teacher(path: str, n: int, cfg: Config, llm, tok, mesh) -> list[dict]:
    """n questions from a teacher with the teacher prompt and the format filter (soar.py's rejection
    sampling; SPEC: "same prompt and filter")."""
    teacher = frozen(path, mesh)
    scfg = soar.Config(num_datasets=1, dataset_size=n, seed=cfg.seed, temperature=cfg.temperature, teacher_max_tokens=cfg.teacher_max_tokens)
    kept, sampled = soar.sample_teacher(scfg, teacher, llm, data.teacher_prompt(tok), "eval", dist.group.WORLD)
    del teacher
    return [{"question": q, "answer": a} for _, (q, a) in kept]


# ---------------------------------------------------------------------------------------------
# one run folder

def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def inference_run(cfg: Config, method: str, path: str, llm, mesh, test, out: str, rank: int) -> dict:
    """base / ps rows: pass@k of the model in `path` on the test split, sampling seed cfg.seed."""
    rloo.sync_weights(frozen(path, mesh), llm)
    res = dict(method=method, test=cfg.test, seed=cfg.seed, model=path,
               passk={k: v for k, v in eval_passk(llm, test, cfg, "inference").items() if k.startswith("pass@")})
    if rank == 0:
        write_json(os.path.join(out, "result.json"), res)
    return res


def train_run(cfg: Config, method: str, synthetic, real, test, llm, mesh, out: str, rank: int,
              samples: int) -> dict:
    """A fresh student from the base model, RLOO on synthetic + real (SPEC "Evaluation protocol"),
    test pass@k every eval_every steps, until the early-stopping rule (or --fixed_step, or --steps)
    says the row's number is known. Resumable from out/ckpt; writes out/result.json at the end."""
    # without a synthetic set (hard-only) there is nothing to put first: mixed, i.e. the hard split alone
    cfg = dataclasses.replace(cfg, samples=samples, mode=cfg.mode if synthetic else "mixed")
    warmup = 0 if cfg.mode == "curriculum" else cfg.warmup
    offset = cfg.switch_step if cfg.mode == "curriculum" else 0   # the rule watches the real-only phase
    settings = {k: getattr(cfg, k) for k in RUN_KEYS}
    policy = rloo.load_policy(cfg.model, mesh, lr=cfg.lr, warmup_steps=warmup, total_steps=cfg.steps,
                              kl_coef=cfg.kl_coef)
    metrics_path, evals_path = os.path.join(out, "metrics.jsonl"), os.path.join(out, "evals.jsonl")
    start, ckpts = 0, soar.ckpt_dirs(out)
    if ckpts:
        with open(os.path.join(ckpts[-1], "state.json")) as f:
            state = json.load(f)
        diff = {k: (v, settings[k]) for k, v in state["settings"].items() if settings.get(k) != v}
        if diff:
            raise ValueError(f"{ckpts[-1]} was written with other settings (saved, now): {diff}")
        rloo.load_state(policy, os.path.join(ckpts[-1], "policy"))
        start = state["step"]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        soar.truncate_jsonl(metrics_path, start)   # rows of steps the checkpoint does not hold
        soar.truncate_jsonl(evals_path, start)
        print(f"{method} seed {cfg.seed}: {len(synthetic)} synthetic + {len(real)} real questions, {cfg.mode}, "
              f"group {samples}; {'resuming at' if start else 'starting at'} step {start} -> {out}", flush=True)
    dist.barrier()
    rewards = [m["reward"] for m in data.read_jsonl(metrics_path)]
    evals = data.read_jsonl(evals_path)
    step = start
    with tqdm(total=cfg.steps, initial=start, disable=rank != 0, desc=method, dynamic_ncols=True) as bar:
        while True:
            if step % cfg.eval_every == 0 or step == cfg.fixed_step or step == cfg.steps:
                rloo.sync_weights(policy, llm)
                evals.append({"step": step, **eval_passk(llm, test, cfg, step)})
                if rank == 0:
                    soar.append_jsonl(evals_path, [evals[-1]])
            if step >= cfg.steps or finished(rewards, step, cfg, offset):
                break
            source, batch = batch_at(step, synthetic, real, cfg)
            t0 = time.perf_counter()
            stats = soar.student_step(policy, llm, [(q["question"], q["answer"]) for q in batch], samples=samples,
                                      temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                      seed=soar.seed_of(cfg, "student", step), group=dist.group.WORLD,
                                      micro_batch_tokens=cfg.micro_batch_tokens)
            rewards.append(stats["reward"])
            if rank == 0:
                soar.append_jsonl(metrics_path, [{"step": step, "source": source, **stats,
                                                  "seconds": round(time.perf_counter() - t0, 3)}])
            step += 1
            bar.update(1)
            bar.set_postfix(reward=f"{stats['reward']:.1f}", acc=f"{stats['accuracy']:.3f}")
            if step % cfg.ckpt_every == 0:
                soar.save_checkpoint(out, step, {"policy": policy}, {"step": step, "settings": settings}, rank)
    res = dict(method=method, test=cfg.test, seed=cfg.seed, mode=cfg.mode, samples=samples, steps_done=step,
               n_synthetic=len(synthetic), n_real=len(real), **select(evals, rewards, cfg, offset))
    if rank == 0:
        write_json(os.path.join(out, "result.json"), res)
        shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)  # optimizer state: GBs per run at scale
    dist.barrier()
    del policy
    return res


# ---------------------------------------------------------------------------------------------
# commands that need the engines

def setup(cfg: Config, question_sets: list[list[dict]], teacher: bool = False):
    """rank, world, mesh (one FSDP mesh over all ranks: the student is sharded over all of them and
    every rank's engine generates its share), tokenizer and one engine per rank, long enough for
    the longest question of any set plus a completion, and if `teacher`, for a teacher prompt plus
    its sample and for such a sample as a question."""
    from transformers import AutoTokenizer
    rank, world, device = rloo.init_distributed()
    mesh = init_device_mesh(device.type, (world,))
    tok = AutoTokenizer.from_pretrained(cfg.model)
    questions = [q["question"] for qs in question_sets for q in qs]
    llm = rloo.build_engine(cfg.model, seed=cfg.seed, gpu_memory_utilization=cfg.gpu_memory_utilization,
                            max_model_len=soar.engine_len(tok, questions, cfg.max_tokens,
                                                          cfg.teacher_max_tokens if teacher else 0))
    ENGINES.append(llm)
    return rank, world, mesh, tok, llm


def resolve_world(cfg: Config) -> Config:
    """Without --model: the built-in world's model and splits (rank 0 builds it, cached)."""
    if cfg.model:
        return cfg
    import world as tiny_world
    rloo.init_distributed()
    paths = tiny_world.build_world_all_ranks(small=cfg.world == "small")
    return dataclasses.replace(cfg, model=paths["model"], hard=cfg.hard or paths["train"],
                               test=cfg.test or paths["test"])


def run_dir(cfg: Config, method: str, seed: int) -> str:
    return os.path.join(cfg.runs, method, f"seed{seed}")


def done(path: str) -> bool:
    return os.path.exists(os.path.join(path, "result.json"))


def cmd_row(cfg: Config, methods: list[str]) -> None:
    """The rows `methods` x seeds, each into its run folder (a method outside ROWS is the `train`
    command's --name: a fresh student on --synthetic + hard train)."""
    seeds = [int(s) for s in cfg.seeds.split(",")]
    if all(done(run_dir(cfg, m, s)) for m in methods for s in seeds):   # before any engine is built
        if os.environ.get("RANK", "0") == "0":
            print(f"{cfg.runs}: {', '.join(methods)} x seeds {cfg.seeds}: all finished already; nothing to do")
        return
    teachers = {"grounded-t": cfg.teacher or os.path.join(cfg.soar, "teacher"), "base-t": cfg.model,
                "intrinsic-t": os.path.join(cfg.intrinsic, "teacher") if cfg.intrinsic else "--intrinsic"}
    inputs = {**teachers, "pq": os.path.join(cfg.soar, "metrics.jsonl"), "ps": os.path.join(cfg.soar, "student"),
              "upper": cfg.extra or "--extra", "upper-128": cfg.extra or "--extra", "base-t": ""}
    missing = {m: inputs[m] for m in methods if inputs.get(m) and not os.path.exists(inputs[m])}
    if missing:
        raise SystemExit(f"missing inputs (method: path or flag): {missing}")
    cfg = resolve_world(cfg)
    teachers["base-t"] = cfg.model
    ckpts = soar.ckpt_dirs(cfg.soar) if set(methods) & {"pq", "ps", "grounded-t"} else []
    if ckpts:   # SOAR's outputs only mean something against the base model SOAR started from
        with open(os.path.join(ckpts[-1], "state.json")) as f:
            soar_model = json.load(f)["config"]["model"]
        if os.path.realpath(soar_model) != os.path.realpath(cfg.model):
            raise SystemExit(f"{cfg.soar} was run from {soar_model}, not from --model {cfg.model}")
    if not (cfg.hard and cfg.test):
        raise SystemExit("--hard and --test are required with --model: the fail@128 train and test splits")
    hard, test = data.load_problems(cfg.hard), data.load_problems(cfg.test)
    extra = data.load_problems(cfg.extra) if any(m.startswith("upper") for m in methods) else []
    pq_path = os.path.join(cfg.soar, "pq.jsonl")   # empty until a promotion
    pq = data.load_problems(pq_path) if "pq" in methods and os.path.exists(pq_path) else []
    custom = data.load_problems(cfg.synthetic) if cfg.synthetic else []
    rank, world, mesh, tok, llm = setup(cfg, [hard, test, extra, pq, custom], teacher=bool(set(methods) & set(teachers)))
    for method in methods:
        for seed in seeds:
            run, out = dataclasses.replace(cfg, seed=seed), run_dir(cfg, method, seed)
            if done(out):
                if rank == 0:
                    print(f"{out}: finished already")
                continue
            if method == "pq" and not pq:
                if rank == 0:
                    print(f"pq: skipped, {cfg.soar} has no promotion questions yet (no promotion)", flush=True)
                continue
            if method in ("base", "ps"):
                path = cfg.model if method == "base" else os.path.join(cfg.soar, "student")
                res = inference_run(run, method, path, llm, mesh, test, out, rank)
            else:
                if method in teachers:   # questions of a teacher: sampled once per seed, kept in the run folder
                    qpath = os.path.join(out, "questions.jsonl")
                    synthetic = data.read_jsonl(qpath)
                    if not synthetic:
                        synthetic = sample_teacher(teachers[method], cfg.teacher_questions, run, llm, tok, mesh)
                        if rank == 0:
                            data.write_jsonl(qpath, synthetic)
                elif method.startswith("upper"):
                    synthetic = extra if method == "upper" else \
                        random.Random(f"{seed}/upper").sample(extra, min(cfg.teacher_questions, len(extra)))
                else:
                    synthetic = pq if method == "pq" else [] if method in ROWS else custom
                samples = cfg.big_group if method == "hard-only-128" else cfg.samples
                res = train_run(run, method, synthetic, hard, test, llm, mesh, out, rank, samples)
            if rank == 0:
                print(f"{method} seed {seed}: " + "  ".join(f"{k} {100 * v:.1f}%" for k, v in res["passk"].items()),
                      flush=True)


def cmd_sample_teacher(cfg: Config, args: list[str]) -> None:
    cfg = resolve_world(cfg)
    path = args[0] if args else cfg.teacher or os.path.join(cfg.soar, "teacher")
    if not cfg.out:
        raise SystemExit("sample-teacher needs --out FILE")
    rank, world, mesh, tok, llm = setup(cfg, [], teacher=True)
    qs = sample_teacher(path, cfg.teacher_questions, cfg, llm, tok, mesh)
    if rank == 0:
        data.write_jsonl(cfg.out, qs)
        print(f"wrote {len(qs)} questions of {path} to {cfg.out}")


def cmd_filter(cfg: Config, pools: list[str]) -> None:
    """fail@128 (SPEC "Data"): for each pool, keep the problems the model never solves in
    filter_samples tries, split them 50/50 (seeded). Writes <out>/<pool>/ counts.jsonl (per problem,
    appended per chunk: a rerun continues), train.jsonl, test.jsonl, filter.json."""
    if not (cfg.model and cfg.out and pools):
        raise SystemExit("filter needs pools (math, harp, olympiad or files), --model and --out")
    problems = {p: data.load_problems(p) for p in pools}
    rank, world, mesh, tok, llm = setup(cfg, list(problems.values()))
    n, chunk = cfg.filter_samples, max(1, 8192 // cfg.filter_samples)
    for pool, probs in problems.items():
        out = os.path.join(cfg.out, os.path.splitext(os.path.basename(pool))[0])
        counts_path = os.path.join(out, "counts.jsonl")
        have = data.read_jsonl(counts_path)
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            print(f"{pool}: {len(probs)} problems, {len(have)} done", flush=True)
        for lo in tqdm(range(len(have), len(probs), chunk), disable=rank != 0, desc=pool, dynamic_ncols=True):
            part = probs[lo:lo + chunk]
            counts = correct_counts(llm, part, n=n, max_tokens=cfg.max_tokens, seed=soar.seed_of(cfg, "filter") + lo,
                                    temperature=cfg.temperature, group=dist.group.WORLD, chunk=chunk)
            if rank == 0:
                soar.append_jsonl(counts_path, [{"index": lo + i, "correct": c} for i, c in enumerate(counts)])
            dist.barrier()
        counts = [r["correct"] for r in data.read_jsonl(counts_path)]
        hard = [p for p, c in zip(probs, counts) if c == 0]
        train, test = data.split_train_test(hard, cfg.split_seed)
        if rank == 0:
            data.write_jsonl(os.path.join(out, "train.jsonl"), train)
            data.write_jsonl(os.path.join(out, "test.jsonl"), test)
            write_json(os.path.join(out, "filter.json"), dict(pool=pool, model=cfg.model, samples=n, problems=len(probs),
                                                              kept=len(hard), train=len(train), test=len(test)))
            print(f"{pool}: {len(hard)} of {len(probs)} never solved in {n} samples -> {len(train)} train / "
                  f"{len(test)} test in {out}")


# ---------------------------------------------------------------------------------------------
# commands that need no engine

def cmd_vendi(cfg: Config, files: list[str]) -> dict:
    res = {}
    for f in files:
        qs = [q["question"] for q in data.load_problems(f)]
        if not qs:
            raise ValueError(f"{f} has no questions")
        m, s = vendi_bootstrap(embed(qs, cfg), cfg.vendi_subset, cfg.vendi_draws)
        res[f] = dict(vendi=m, std=s, questions=len(qs), embed=cfg.embed)
        print(f"{f}: Vendi {m:.2f} +- {s:.2f} ({len(qs)} questions, subsets of {min(len(qs), cfg.vendi_subset)}, "
              f"embedding {cfg.embed})")
    return res


def ordered(methods) -> list[str]:
    return sorted(methods, key=lambda m: (list(ROWS).index(m) if m in ROWS else len(ROWS), m))


def table(results: list[dict], test: str) -> list[str]:
    """Tables 4-6: rows = methods (the paper's order), columns = pass@k in %, mean ± std over seeds,
    and the step the row's number comes from (early-stopping step, fixed step, or the last window)."""
    rs = [r for r in results if r["test"] == test]
    ks = sorted({k for r in rs for k in r["passk"]}, key=lambda k: int(k[5:]))
    lines = [f"## pass@k (%) on `{test}`", "", "| method | " + " | ".join(ks) + " | seeds | step |",
             "|---|" + "---|" * (len(ks) + 2)]
    for m in ordered({r["method"] for r in rs}):
        mr = [r for r in rs if r["method"] == m]
        cells = ["{:.1f} ± {:.1f}".format(*mean_std([100 * r["passk"][k] for r in mr if k in r["passk"]])) for k in ks]
        steps = [r["stop_step"] for r in mr if "stop_step" in r]
        step = f"{statistics.fmean(steps):.0f} ({mr[0]['rule']})" if steps else "-"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {len(mr)} | {step} |")
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


def plot_soar(metrics: list[dict], path: str) -> None:
    """SOAR's outer loop from its metrics.jsonl: teacher reward Rhat, its moving average, promotions."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["reward"] for m in metrics], marker=".", label="teacher reward (mean_k R_k)")
    ma = [(m["step"], m["ma"]) for m in metrics if m["ma"] is not None]
    ax.plot([s for s, _ in ma], [v for _, v in ma], label="moving average")
    for m in metrics:
        if m["promoted"]:
            ax.axvline(m["step"], color="tab:green", alpha=0.4, lw=1)
    ax.plot([], [], color="tab:green", alpha=0.4, label="promotion")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("outer step")
    ax.set_ylabel("reward (accuracy gain)")
    ax.legend(fontsize=7, loc="upper left")
    ax2 = ax.twinx()
    ax2.step(steps, [m["promotions"] for m in metrics], where="post", color="tab:red", alpha=0.6)
    ax2.set_ylabel("promotions", color="tab:red")
    ax2.set_ylim(0, max(1, metrics[-1]["promotions"]) * 1.05)  # a count: from 0, also when it stays 0
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_report(cfg: Config) -> str:
    """report.md in --out (default --runs): a table per test split from every result.json under
    --runs, the Vendi score of every question set in sight (SOAR's PQ, the teachers' samples), and
    the plots curves.png (fresh students) and soar.png (SOAR's metrics.jsonl)."""
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
    sets = {"pq": [os.path.join(cfg.soar, "pq.jsonl")]} if os.path.exists(os.path.join(cfg.soar, "pq.jsonl")) else {}
    for path in sorted(glob.glob(os.path.join(cfg.runs, "*", "seed*", "questions.jsonl"))):
        sets.setdefault(os.path.basename(os.path.dirname(os.path.dirname(path))), []).append(path)
    if sets:
        lines += [f"## Diversity: Vendi score ({cfg.embed} embedding, subsets of {cfg.vendi_subset}, "
                  f"{cfg.vendi_draws} draws; mean ± std)", "", "| questions | Vendi | n |", "|---|---|---|"]
        for m in ordered(sets):
            qs = [q["question"] for p in sets[m] for q in data.read_jsonl(p)]
            if qs:
                lines.append("| {} | {:.2f} ± {:.2f} | {} |".format(
                    m, *vendi_bootstrap(embed(qs, cfg), cfg.vendi_subset, cfg.vendi_draws), len(qs)))
        lines.append("")
    if plot_curves(results, os.path.join(out, "curves.png")):
        lines += ["## Test pass@k over fresh-student training", "", "![curves](curves.png)", ""]
    metrics = data.read_jsonl(os.path.join(cfg.soar, "metrics.jsonl"))
    if metrics:
        plot_soar(metrics, os.path.join(out, "soar.png"))
        lines += [f"## SOAR ({cfg.soar}): {len(metrics)} outer steps, {metrics[-1]['promotions']} promotions", "",
                  "![soar](soar.png)", ""]
    text = "\n".join(lines)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return text


def main(argv=None):
    command, args, cfg = parse_args(argv)
    try:
        if command == "vendi":
            cmd_vendi(cfg, args)
        elif command == "report":
            cmd_report(cfg)
        elif command == "filter":
            cmd_filter(cfg, args)
        elif command == "row":
            cmd_row(cfg, args)
        elif command == "train":
            cmd_row(cfg, [cfg.name])
        elif command == "sample-teacher":
            cmd_sample_teacher(cfg, args)
    except (RuntimeError, ValueError) as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"eval.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        for llm in ENGINES:   # before the process group: its shutdown tears down vLLM's groups (the
            llm.llm_engine.engine_core.shutdown()   # default one too); left to exit, it fails on them
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
