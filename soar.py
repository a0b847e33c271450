"""SOAR, Algorithm 1 (SPEC.md): a teacher learns by RLOO to write question-answer pairs that make
students, trained on them by RLOO, improve on hard problems they could not solve (fail@128).

Launch:
    ./run.sh                                              # set up, then this file with its defaults:
                                                          # CPU: the built-in small world, end to end
    torchrun --standalone --nproc_per_node 2 soar.py --out runs/tiny --steps 4
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 soar.py \\
        --model meta-llama/Llama-3.2-3B-Instruct --train data/math_train.jsonl --out runs/math
Rerunning the same command resumes from the last finished outer step.

Scale layout (SPEC.md "Scale layout"). One rank per GPU, one in-process vLLM engine per rank (TP=1)
that serves whichever weights are needed next. The W ranks form a 2-D mesh (G groups x W/G):
  * the teacher is FSDP-sharded over all W ranks; all W engines sample its g*n pairs;
  * the g*r students of a step are spread round-robin over the G student groups; a group shards
    its student over its W/G ranks, samples its rollouts on its own engines, and runs its
    students in turn when there are more students than groups;
  * students restart from an in-memory copy of theta (rloo.snapshot); a promotion broadcasts the
    chosen student's shards from its group to every other group (rloo.broadcast_snapshot).
At the paper's settings on 32 GPUs: G = 16 groups of 2 GPUs, one student each. One outer step is
256 teacher samples (512 tok), then per student S = 10-20 inner steps of 8 x 32 = 256 rollouts
(<= 1024 tok) plus one greedy pass over M = 64 questions, and one teacher update over 256
completions: about 20 M trained tokens, ~1.5e17 FLOP for Llama-3.2-3B, so ~5 s per step at
full utilisation; the paper's 48-60 h for 200 steps is ~15 min per step (generation-bound).

Outputs in --out: metrics.jsonl (one line per outer step), pq.jsonl (promotion questions),
teacher/ and student/ (HF folders of the current teacher and baseline student), ckpt/ (resume).
"""
import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import data
import rloo


@dataclasses.dataclass
class Config:
    # ---- models and data ----
    model: str = ""             # base model (teacher and students start here); "" = the built-in world
    world: str = "default"      # which built-in world without --model: "default" or "small" (tests)
    train: str = ""             # hard train split (jsonl/parquet, question/answer); "" = the world's
    out: str = "runs/soar"
    seed: int = 0
    # ---- outer loop (SPEC.md Algorithm 1, Table 3) ----
    steps: int = 200            # T outer steps
    # (the paper's g, n, r, M; spelled out because torchrun would take --n, --r, --m as its own)
    num_datasets: int = 4       # g: datasets per step (the teacher's RLOO group size)
    dataset_size: int = 64      # n: pairs per dataset
    students: int = 4           # r: students per dataset
    qr_size: int = 64           # M = |Q_R|: hard train questions per step
    tau: float = 0.01           # promotion threshold on the moving average
    window: int = 3             # moving-average window w
    reward: str = "grounded"    # "grounded" (SOAR) | "learnability" (Intrinsic-T baseline)
    learnability_samples: int = 32
    max_rejection_rounds: int = 8   # teacher sampling rounds before giving up on g*n valid pairs
    # ---- inner loop: S = inner_steps + inner_step_inc * min(promotions, inner_step_cap) ----
    inner_steps: int = 10
    inner_step_inc: int = 5
    inner_step_cap: int = 2
    student_questions: int = 8      # questions per student step
    student_samples: int = 32       # samples per question (student RLOO group)
    # ---- optimisation (Table 3) ----
    teacher_lr: float = 1e-5
    teacher_warmup: int = 20
    student_lr: float = 1e-5
    kl_coef: float = 0.001
    # ---- sampling ----
    teacher_max_tokens: int = 512
    student_max_tokens: int = 1024
    temperature: float = 1.0
    # ---- systems ----
    student_groups: int = 0     # G; 0 = as many as fit (a divisor of W, <= g*r)
    micro_batch_tokens: int = 16384
    activation_checkpointing: bool = False
    gpu_memory_utilization: float = 0.3


# The built-in world (world.py) is a tiny model on 2 CPU cores: same algorithm, smaller numbers.
WORLD_DEFAULTS = dict(steps=12, num_datasets=2, dataset_size=8, students=2, qr_size=32, inner_steps=4, inner_step_inc=2, student_questions=4,
                      student_samples=8, teacher_lr=1e-3, student_lr=1e-3, teacher_warmup=2,
                      teacher_max_tokens=48, student_max_tokens=48, learnability_samples=8)
# settings a resumed run may change without invalidating its checkpoint
RESUMABLE = {"steps", "out", "micro_batch_tokens", "gpu_memory_utilization"}


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        if f.type is bool:
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument(f"--{f.name}", type=f.type, default=None)
    args = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    base = {} if args.get("model") else WORLD_DEFAULTS  # paper settings for real models
    cfg = Config(**{**base, **args})
    if cfg.reward not in ("grounded", "learnability"):
        p.error(f"--reward must be grounded or learnability, not {cfg.reward!r}")
    return cfg


# ---------------------------------------------------------------------------------------------
# Algorithm 1's decisions: pure functions of reward tables (tested on hand-built ones)

def inner_steps(cfg: Config, promotions: int) -> int:
    """S = 10, then 15, then 20 after the first and second promotions (SPEC.md)."""
    return cfg.inner_steps + cfg.inner_step_inc * min(promotions, cfg.inner_step_cap)


def moving_average(history: list[float], window: int) -> float | None:
    """MA of the last `window` step rewards; None until the window is full."""
    return sum(history[-window:]) / window if len(history) >= window else None


def promotion(R: list[list[float]], ma: float | None, tau: float) -> tuple[int, int] | None:
    """(k*, j*) if MA > tau: k* = argmax_k R_k, j* = the student of X_k* with the median R_k*j
    (r even: the lower middle). None otherwise."""
    if ma is None or ma <= tau:
        return None
    R_k = [sum(row) / len(row) for row in R]
    k = max(range(len(R)), key=lambda i: R_k[i])  # first maximum on ties
    order = sorted(range(len(R[k])), key=lambda j: R[k][j])
    return k, order[(len(order) - 1) // 2]


def decide(history: list[float], R: list[list[float]], window: int, tau: float):
    """Steps 6-7 on a step's g x r table R: Rhat = mean_k R_k joins the history, MA over the
    window, promotion or not; a promotion clears the window. Returns (Rhat, MA, chosen, history)."""
    reward = sum(sum(row) / len(row) for row in R) / len(R)
    history = history + [reward]
    ma = moving_average(history, window)
    chosen = promotion(R, ma, tau)
    return reward, ma, chosen, ([] if chosen else history)


def teacher_advantages(R_k: list[float]) -> list[float]:
    """A_k = R_k - mean_{l != k} R_l (SPEC.md step 8)."""
    return rloo.rloo_advantages(torch.tensor(R_k, dtype=torch.float64)).tolist()


def learnability(success_rates: list[float]) -> float:
    """Intrinsic-T: r_q = 0 if s = 0 else 1 - s, averaged over the dataset (SPEC.md "Rewards")."""
    return sum(0.0 if s == 0 else 1.0 - s for s in success_rates) / len(success_rates)


# ---------------------------------------------------------------------------------------------
# bookkeeping: timers, seeds, rank-split work

TIMES = defaultdict(float)
_open = []


@contextmanager
def timed(key: str):
    """Exclusive timers: time spent in a nested timed() block counts only for the inner key."""
    t0 = time.perf_counter()
    _open.append(0.0)
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        TIMES[key] += dt - _open.pop()
        if _open:
            _open[-1] += dt


def seed_of(cfg: Config, *keys) -> int:
    """Every random draw is a function of (seed, step, ...): a resumed run replays exactly."""
    return random.Random(f"{cfg.seed}/" + "/".join(map(str, keys))).randrange(2**31)


def split_map(fn, items: list, group) -> list:
    """fn over this rank's contiguous share of items, results gathered on every rank of group.
    Used for grading: one rank decides each item, so ranks never disagree on a timeout."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lo, hi = rloo._chunk(len(items), rank, world)
    parts = [None] * world
    dist.all_gather_object(parts, fn(items[lo:hi]), group=group)
    return [x for part in parts for x in part]


def grade(completions: list[str], golds: list[str], group) -> list[float]:
    return split_map(lambda pairs: data.grade([c for c, _ in pairs], [g for _, g in pairs]),
                     list(zip(completions, golds)), group)


def engine_len(tok, questions: list[str], student_max_tokens: int, teacher_max_tokens: int) -> int:
    """The engines' context: the student prompt around the longest question (a teacher sample may
    be one) plus a completion, or the teacher prompt plus a teacher sample; 16 tokens of slack."""
    longest = max([len(tok(q).input_ids) for q in questions] + [teacher_max_tokens])
    student = len(tok(data.student_prompt("")).input_ids) + longest + student_max_tokens
    teacher = len(tok(data.teacher_prompt(tok)).input_ids) + teacher_max_tokens if teacher_max_tokens else 0
    return max(student, teacher) + 16


def my_rows(rows: list, group) -> list:
    lo, hi = rloo._chunk(len(rows), dist.get_rank(group), dist.get_world_size(group))
    return rows[lo:hi]


# ---------------------------------------------------------------------------------------------
# the pieces of one outer step

def sample_teacher(cfg, teacher, llm, prompt, step, world_group):
    """Rejection sampling (SPEC.md step 1): sample, keep what passes the format filter, sample
    again for the shortfall; exact for RLOO (paper Prop. 1). Returns the first g*n valid samples
    in sampling order, their (q, a) pairs, and the valid rate."""
    with timed("sync"):
        rloo.sync_weights(teacher, llm)
    need, kept, sampled = cfg.num_datasets * cfg.dataset_size, [], 0
    for rnd in range(cfg.max_rejection_rounds):
        todo = need - len(kept)
        # oversample by the valid rate seen so far (at least 1x, at most 8x)
        k = todo if not kept else min(8 * todo, int(todo * sampled / len(kept) * 1.2) + 1)
        outs = rloo.generate(llm, [prompt] * k, temperature=cfg.temperature, max_tokens=cfg.teacher_max_tokens,
                             seed=seed_of(cfg, step, "teacher", rnd), group=world_group)
        samples = [o[0] for o in outs]
        pairs = split_map(data.parse_teacher_batch, [s.text for s in samples], world_group)
        sampled += k
        kept += [(s, p) for s, p in zip(samples, pairs) if p is not None]
        if len(kept) >= need:
            return kept[:need], sampled
    raise RuntimeError(f"the teacher produced only {len(kept)} valid question-answer pairs in {sampled} samples "
                       f"({cfg.max_rejection_rounds} rounds) at step {step}, {need} needed: it no longer follows the "
                       f"format of data.TEACHER_PROMPT (raise --max_rejection_rounds or check the model)")


def accuracy(cfg, llm, questions, fsdp_group) -> float:
    """Greedy accuracy on Q_R (SPEC.md: Acc is binary, greedy), generated on this group's engines."""
    outs = rloo.generate(llm, [data.student_prompt(q["question"]) for q in questions], temperature=0.0,
                         max_tokens=cfg.student_max_tokens, seed=0, group=fsdp_group)
    rewards = grade([o[0].text for o in outs], [q["answer"] for q in questions], fsdp_group)
    return sum(r == data.R_CORRECT for r in rewards) / len(questions)


def student_step(policy, llm, batch, *, samples, temperature, max_tokens, seed, group, micro_batch_tokens) -> dict:
    """One student RLOO step on a batch of (question, answer) pairs: sync, sample `samples` per
    question on the group's engines, grade (SPEC.md rewards), leave-one-out advantages within each
    question, one update. Also the step of eval.py's fresh students."""
    with timed("sync"):
        rloo.sync_weights(policy, llm)
    outs = rloo.generate(llm, [data.student_prompt(q) for q, _ in batch], n=samples, temperature=temperature,
                         max_tokens=max_tokens, seed=seed, group=group)
    flat = [(smp, a) for o, (_, a) in zip(outs, batch) for smp in o]
    rewards = grade([smp.text for smp, _ in flat], [a for _, a in flat], group)
    adv = rloo.rloo_advantages(torch.tensor(rewards).view(len(batch), samples)).flatten().tolist()
    rows = my_rows([(smp, a) for (smp, _), a in zip(flat, adv)], group)
    stats = rloo.train_step(policy, [smp.prompt_token_ids for smp, _ in rows], [smp.token_ids for smp, _ in rows],
                            [a for _, a in rows], micro_batch_tokens=micro_batch_tokens)
    return {**stats, "reward": sum(rewards) / len(rewards),
            "accuracy": sum(r == data.R_CORRECT for r in rewards) / len(rewards)}


def train_student(cfg, student, llm, dataset, n_steps, step, k, j, fsdp_group):
    """Inner loop (SPEC.md step 5): RLOO on X_k for S steps, from whatever weights `student` holds."""
    rloo.reset_optimizer(student, lr=cfg.student_lr, warmup_steps=0, total_steps=n_steps)
    order = list(range(len(dataset)))
    random.Random(seed_of(cfg, step, "order", k, j)).shuffle(order)
    for s in range(n_steps):
        batch = [dataset[order[(s * cfg.student_questions + i) % len(order)]] for i in range(cfg.student_questions)]
        student_step(student, llm, batch, samples=cfg.student_samples, temperature=cfg.temperature,
                     max_tokens=cfg.student_max_tokens, seed=seed_of(cfg, step, "student", k, j, s),
                     group=fsdp_group, micro_batch_tokens=cfg.micro_batch_tokens)


def learnability_rewards(cfg, llm, datasets, step, world_group) -> list[float]:
    """Intrinsic-T: each dataset's learnability under the baseline student (already in the engines)."""
    flat = [qa for X in datasets for qa in X]
    outs = rloo.generate(llm, [data.student_prompt(q) for q, _ in flat], n=cfg.learnability_samples,
                         temperature=cfg.temperature, max_tokens=cfg.student_max_tokens,
                         seed=seed_of(cfg, step, "learnability"), group=world_group)
    comps = [(s.text, a) for o, (_, a) in zip(outs, flat) for s in o]
    correct = [r == data.R_CORRECT for r in grade([c for c, _ in comps], [a for _, a in comps], world_group)]
    rates = [sum(correct[i * cfg.learnability_samples:(i + 1) * cfg.learnability_samples]) / cfg.learnability_samples
             for i in range(len(flat))]
    return [learnability(rates[k * cfg.dataset_size:(k + 1) * cfg.dataset_size]) for k in range(cfg.num_datasets)]


# ---------------------------------------------------------------------------------------------
# checkpoints: out/ckpt/step-N holds everything a restart needs; it appears atomically (rename)

def ckpt_dirs(out: str) -> list[str]:
    root = os.path.join(out, "ckpt")
    done = [d for d in os.listdir(root) if d.startswith("step-") and not d.endswith(".tmp")] if os.path.isdir(root) else []
    return [os.path.join(root, d) for d in sorted(done, key=lambda d: int(d[5:]))]


def save_checkpoint(out: str, step: int, policies: dict, state: dict, rank: int) -> None:
    """out/ckpt/step-N: each policy's training state and state.json, appearing at once (a rename);
    older checkpoints go. Shared with eval.py's fresh-student runs."""
    final = os.path.join(out, "ckpt", f"step-{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    for name, policy in policies.items():
        rloo.save_state(policy, os.path.join(tmp, name))
    if rank == 0:
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump(state, f)
        os.rename(tmp, final)
        for old in ckpt_dirs(out)[:-1]:
            shutil.rmtree(old)
    dist.barrier()


def truncate_jsonl(path: str, step: int) -> None:
    """Drop lines of steps >= step: written by a run killed before that step's checkpoint landed.
    Creates the file if missing (an empty pq.jsonl: no promotion yet)."""
    data.write_jsonl(path, [r for r in data.read_jsonl(path) if r["step"] < step])


def append_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_hf_atomic(policy, path, tokenizer, rank):
    rloo.save_hf(policy, path + ".tmp", tokenizer)
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.rename(path + ".tmp", path)
    dist.barrier()


# ---------------------------------------------------------------------------------------------

def main(cfg: Config):
    rank, world, device = rloo.init_distributed()
    world_group = dist.group.WORLD
    if not cfg.model:  # the built-in world (cached)
        import world as tiny_world
        paths = tiny_world.build_world_all_ranks(small=cfg.world == "small")
        cfg.model, cfg.train = paths["model"], cfg.train or paths["train"]
    if not cfg.train:
        raise SystemExit("--train is required with --model: the hard train split (jsonl/parquet, question/answer)")
    hard = data.load_problems(cfg.train)
    if len(hard) < cfg.qr_size:
        raise SystemExit(f"{cfg.train} has {len(hard)} problems but each step samples M={cfg.qr_size} of them (--qr_size)")
    if cfg.dataset_size < 1 or cfg.num_datasets < 2 or (cfg.reward == "grounded" and cfg.students < 1):
        raise SystemExit("need g >= 2 (RLOO over datasets), n >= 1 and r >= 1")

    # ---- resume? ----
    os.makedirs(cfg.out, exist_ok=True)
    ckpts = ckpt_dirs(cfg.out)
    state = dict(step=0, history=[], promotions=0, pq=0)
    if ckpts:
        with open(os.path.join(ckpts[-1], "state.json")) as f:
            saved = json.load(f)
        diff = {k: (v, getattr(cfg, k)) for k, v in saved.pop("config").items()
                if k not in RESUMABLE and getattr(cfg, k) != v}
        if diff:
            raise SystemExit(f"{ckpts[-1]} was written with other settings (saved, now): {diff}; "
                             f"use another --out or the same settings")
        state = saved
    if state["step"] >= cfg.steps:
        if rank == 0:
            print(f"{cfg.out}: all {cfg.steps} steps are done already; nothing to do")
        return

    # ---- meshes, engine, policies ----
    G = cfg.student_groups or max(d for d in range(1, world + 1) if world % d == 0 and d <= cfg.num_datasets * cfg.students)
    if world % G:
        raise SystemExit(f"--student_groups {G} does not divide the {world} ranks")
    mesh = init_device_mesh(device.type, (G, world // G), mesh_dim_names=("group", "fsdp"))
    teacher_mesh = init_device_mesh(device.type, (world,))
    fsdp_group, my_group = mesh["fsdp"].get_group(), rank // (world // G)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model)
    prompt = data.teacher_prompt(tok)
    llm = rloo.build_engine(cfg.model, seed=cfg.seed, gpu_memory_utilization=cfg.gpu_memory_utilization,
                            max_model_len=engine_len(tok, [q["question"] for q in hard], cfg.student_max_tokens,
                                                     cfg.teacher_max_tokens))
    teacher = rloo.load_policy(cfg.model, teacher_mesh, lr=cfg.teacher_lr, warmup_steps=cfg.teacher_warmup,
                               total_steps=cfg.steps, kl_coef=cfg.kl_coef,
                               activation_checkpointing=cfg.activation_checkpointing)
    student = rloo.load_policy(cfg.model, mesh["fsdp"], lr=cfg.student_lr, warmup_steps=0, total_steps=1,
                               kl_coef=cfg.kl_coef, activation_checkpointing=cfg.activation_checkpointing)
    if ckpts:
        rloo.load_state(teacher, os.path.join(ckpts[-1], "teacher"))
        rloo.load_state(student, os.path.join(ckpts[-1], "student"))
    theta = rloo.snapshot(student)  # the baseline student; only a promotion changes it
    metrics_path, pq_path = os.path.join(cfg.out, "metrics.jsonl"), os.path.join(cfg.out, "pq.jsonl")
    if rank == 0:
        truncate_jsonl(metrics_path, state["step"])
        truncate_jsonl(pq_path, state["step"])
        print(f"SOAR: {world} ranks, {G} student groups of {world // G}; model {cfg.model}; out {cfg.out}; "
              f"{'resuming at' if ckpts else 'starting at'} step {state['step']} of {cfg.steps}", flush=True)
    bar = tqdm(range(state["step"], cfg.steps), initial=state["step"], total=cfg.steps, disable=rank != 0,
               desc="SOAR", dynamic_ncols=True)
    students = [(k, j) for k in range(cfg.num_datasets) for j in range(cfg.students)]
    first_step = state["step"]

    for step in bar:
        TIMES.clear()
        t_step = time.perf_counter()
        S = inner_steps(cfg, state["promotions"])
        # 1-2. teacher samples g*n valid pairs, split in order into X_1..X_g
        with timed("teacher_generation"):
            kept, sampled = sample_teacher(cfg, teacher, llm, prompt, step, world_group)
        datasets = [[p for _, p in kept[k * cfg.dataset_size:(k + 1) * cfg.dataset_size]] for k in range(cfg.num_datasets)]
        # 3-4. fresh Q_R; the baseline's greedy accuracy on it, once per step
        q_r = data.sample_questions(hard, cfg.qr_size, random.Random(seed_of(cfg, step, "q_r")))
        rloo.restore(student, theta)
        with timed("sync"):
            rloo.sync_weights(student, llm)
        with timed("evaluation"):
            acc0 = accuracy(cfg, llm, q_r, world_group)
        # 5. every student from theta, on its group's ranks; R_kj = Acc(trained) - Acc0
        R, snaps = {}, {}
        if cfg.reward == "learnability":
            with timed("evaluation"):
                R = {(k, 0): v for k, v in enumerate(learnability_rewards(cfg, llm, datasets, step, world_group))}
        else:
            for k, j in students[my_group::G]:
                rloo.restore(student, theta)
                with timed("student_training"):
                    train_student(cfg, student, llm, datasets[k], S, step, k, j, fsdp_group)
                with timed("sync"):
                    rloo.sync_weights(student, llm)
                with timed("evaluation"):
                    R[k, j] = accuracy(cfg, llm, q_r, fsdp_group) - acc0
                snaps[k, j] = rloo.snapshot(student)
            parts = [None] * world
            dist.all_gather_object(parts, R)
            R = {kj: v for part in parts for kj, v in part.items()}
        cols = cfg.students if cfg.reward == "grounded" else 1
        R_table = [[R[k, j] for j in range(cols)] for k in range(cfg.num_datasets)]
        R_k = [sum(row) / cols for row in R_table]
        # 6-7. Rhat, MA, promotion (Intrinsic-T trains no students, so it never promotes)
        reward, ma, chosen, state["history"] = decide(state["history"], R_table, cfg.window,
                                                      cfg.tau if cfg.reward == "grounded" else float("inf"))
        if chosen:                                                     # 7. promotion
            k, j = chosen
            src = students.index(chosen) % G                           # the group that trained it
            theta = snaps[chosen] if my_group == src else theta
            with timed("sync"):
                rloo.broadcast_snapshot(theta, src, mesh["group"].get_group())
            state["promotions"] += 1
            if rank == 0:
                append_jsonl(pq_path, [{"question": q, "answer": a, "step": step} for q, a in datasets[k]])
            state["pq"] += len(datasets[k])
        del snaps
        # 8. teacher RLOO update: every completion of X_k gets A_k
        with timed("teacher_update"):
            adv = teacher_advantages(R_k)
            rows = my_rows([(s, adv[i // cfg.dataset_size]) for i, (s, _) in enumerate(kept)], world_group)
            stats = rloo.train_step(teacher, [s.prompt_token_ids for s, _ in rows], [s.token_ids for s, _ in rows],
                                    [a for _, a in rows], micro_batch_tokens=cfg.micro_batch_tokens)
        state["step"] = step + 1
        # metrics first, then the checkpoint that commits the step (a resume drops rows of
        # uncommitted steps); `total` excludes the checkpoint writing
        row = dict(step=step, acc0=acc0, R=R_table, R_k=R_k, reward=reward, ma=ma, promoted=bool(chosen),
                   promoted_k=chosen[0] if chosen else None, promoted_j=chosen[1] if chosen else None,
                   promotions=state["promotions"], inner_steps=S, teacher_valid_rate=len(kept) / sampled,
                   teacher_samples=sampled, teacher_loss=stats["loss"], teacher_kl=stats["kl"],
                   **{k: round(v, 3) for k, v in TIMES.items()}, total=round(time.perf_counter() - t_step, 3))
        if rank == 0:
            append_jsonl(metrics_path, [row])
        save_hf_atomic(teacher, os.path.join(cfg.out, "teacher"), tok, rank)
        rloo.restore(student, theta)   # the outputs hold the baseline, not the last student trained
        if chosen or step == first_step:  # theta changes only on promotion
            save_hf_atomic(student, os.path.join(cfg.out, "student"), tok, rank)
        save_checkpoint(cfg.out, state["step"], {"teacher": teacher, "student": student},
                        {**state, "config": dataclasses.asdict(cfg)}, rank)
        bar.set_postfix(reward=f"{reward:+.3f}", ma="-" if ma is None else f"{ma:+.3f}",
                        promotions=state["promotions"])
    if rank == 0:
        print(f"done: {cfg.out}/metrics.jsonl, {cfg.out}/pq.jsonl ({state['pq']} promotion questions), "
              f"{cfg.out}/teacher, {cfg.out}/student")


if __name__ == "__main__":
    cfg = parse_args()
    try:
        main(cfg)
    except (RuntimeError, ValueError) as e:  # a clear message on rank 0, a clean non-zero exit
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"soar.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    # no destroy_process_group(): vLLM's exit handler tears the groups down with its engine
