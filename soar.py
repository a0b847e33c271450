r"""SOAR (METHOD.md "Algorithm 1"): a teacher learns by RLOO to write question-answer pairs that
make students, trained on them by RLOO, improve on hard problems they could not solve (fail@128).

Launch:
    ./run.sh                                             # set up, then this file with its defaults:
                                                         # CPU: the built-in small world, end to end
    torchrun --standalone --nproc_per_node 2 soar.py --out runs/tiny --outer_steps 4
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 soar.py \
        --model meta-llama/Llama-3.2-3B-Instruct --train data/math/train.jsonl --out runs/math
Rerunning the same command resumes from the last finished outer step.

Layout (METHOD.md "Scale layout"): the W ranks form a 2-D mesh of G student groups x W/G ranks. The
teacher is sharded over all W ranks and all W engines sample its g*n pairs; the g*r students of a
step go round-robin to the groups, which shard them over their ranks, sample on their own engines
and take their students in turn (with LoRA: all at once, one engine call per inner step). At the
paper's settings on 32 GPUs: 16 groups of 2, a student each.

Outputs in --out: metrics.jsonl (one line per outer step), pq.jsonl (promotion questions),
questions.jsonl (every valid pair the teacher wrote, with its step, dataset k and R_k),
teacher/ and student/ (HF folders of the current teacher and baseline student), ckpt/ (resume);
with --wandb PROJECT, wandb/ (W&B's files) and wandb.json (the W&B run's id).
"""
import dataclasses
import math
import random

import torch
import torch.distributed as dist

import data
import launch
import lora
import rloo
import rloo_extras
import world


WORLD_MAX_TOKENS = world.MAX_TOKENS   # new tokens a completion needs on the built-in world


@dataclasses.dataclass
class Config:
    # Each flag's default is the paper's; `world=` is its value on the built-in world (without
    # --model): the same algorithm with smaller numbers, for a tiny model on 2 CPU cores. One
    # student per dataset (r = 1): the world's students learn all or nothing, and with r = 2 the
    # promoted median is the lower one. eval.py's flags of the same name have the same values.
    # ---- models and data ----
    model: str = launch.flag("",
        'base model (teacher and students start here); "" = built-in world')
    world: str = launch.flag("default",
        "the built-in world without --model: default, or small (the tests')",
        choices=("default", "small"))
    train: str = launch.flag("",
        "hard train split (jsonl/parquet, question/answer); \"\" = world's")
    out: str = launch.flag("runs/soar", "output folder; rerunning on it resumes")
    seed: int = launch.flag(0, "every random draw derives from it (rloo.seed_of)")
    # ---- outer loop (METHOD.md "Algorithm 1", "Hyperparameters"); the paper's g, n, r, M are
    # spelled out because torchrun would take --n, --r, --m as its own ----
    outer_steps: int = launch.flag(200, world=15, help="T", least=1)
    num_datasets: int = launch.flag(4, "g: datasets per step (the teacher's RLOO group)")
    dataset_size: int = launch.flag(64, world=8, help="n: pairs per dataset", least=1)
    students: int = launch.flag(4, world=1, help="r: students per dataset")
    qr_size: int = launch.flag(64, world=32, help="M = |Q_R|: hard train questions per step")
    tau: float = launch.flag(0.01, "promotion threshold on the moving average")
    window: int = launch.flag(3, "w: moving-average window", least=1)
    promote_every_step: bool = launch.flag(False, "promote at every step, whatever MA and tau (a "
        "step whose reward is not a number excepted; a reward that trains no students never "
        "promotes): tests and ablations, not the method")
    reward: str = launch.flag("grounded", "the teacher's reward (TEACHER_REWARDS): grounded "
        "(SOAR), learnability (Intrinsic-T) or opensir", choices=("grounded", "learnability",
                                                                  "opensir"))
    learnability_samples: int = launch.flag(32, world=8,
        help="learnability, opensir: samples per question for its solve rate", least=1)
    teacher_turns: int = launch.flag(1, "1: the teacher writes a question and its answer in one "
        "reply; 2: the question, then the answer in a second turn (METHOD.md \"Two-turn teacher\")",
        choices=(1, 2))
    answer_prompt: str = launch.flag("chat", world="tag", help="with --teacher_turns 2, the prompt "
        "p' between question and answer (data.answer_prompt)", choices=data.ANSWER_PROMPTS)
    max_rejection_rounds: int = launch.flag(8,
        "teacher sampling rounds before giving up on g*n valid pairs", least=1)
    # ---- inner loop (METHOD.md "Inner loop"): S = inner_steps + inner_step_inc *
    # min(promotions, inner_step_cap) ----
    inner_steps: int = launch.flag(10, world=6, help="S before any promotion", least=1)
    inner_step_inc: int = launch.flag(5, world=1, help="S grows by this per promotion...", least=0)
    inner_step_cap: int = launch.flag(2, "...for at most this many promotions", least=0)
    student_questions: int = launch.flag(8, world=4, help="questions per student step", least=1)
    student_samples: int = launch.flag(32, world=8,
        help="samples per question (the student's RLOO group)")
    # ---- optimisation (METHOD.md "Hyperparameters") ----
    teacher_lr: float = launch.flag(1e-5, world=3e-4, help="AdamW, cosine over outer_steps")
    teacher_warmup: int = launch.flag(20, world=2, help="teacher lr warmup steps")
    student_lr: float = launch.flag(1e-5, world=3e-4, help="AdamW, cosine over S, no warmup")
    kl_coef: float = launch.flag(0.001, "k3 KL to the model the run started from")
    # ---- LoRA (METHOD.md "LoRA"): the teacher and the students as adapters on one frozen base ----
    lora_rank: int = launch.flag(0,
        "rank of the teacher's and students' adapters; 0 = full fine-tuning (the paper's)", least=0)
    lora_alpha: float = launch.flag(32.0, "adapters' scale: the update is (alpha / rank) B A")
    # ---- sampling ----
    teacher_max_tokens: int = launch.flag(512, world=WORLD_MAX_TOKENS,
        help="new tokens per teacher sample", least=1)
    student_max_tokens: int = launch.flag(1024, world=WORLD_MAX_TOKENS,
        help="new tokens per student completion", least=1)
    temperature: float = launch.flag(1.0, "sampling temperature (Acc on Q_R is greedy)")
    # ---- systems ----
    student_groups: int = launch.flag(0,
        "G; 0 = as many as fit (a divisor of the ranks, <= g*r)", least=0)
    micro_batch_tokens: int = launch.flag(16384,
        "tokens per forward/backward pass (rows x longest row)")
    prompt_pass: str = launch.flag("auto",
        "training forward: shared (each distinct prompt once), single (one causal pass per row) "
        "or auto (rloo.SHARED_PROMPTS_BY_DEVICE: shared on CPU, single on GPU)",
        choices=("auto", "shared", "single"))
    activation_checkpointing: bool = launch.flag(True, world=False,
        help="recompute activations: a 3B student fits beside vLLM")
    gpu_memory_utilization: float = launch.flag(0.3, "the vLLM engine's share of GPU memory")
    save_every: int = launch.flag(10,
        "write HF teacher/, student/ every this many steps and at the end", least=1)
    verbose: bool = launch.flag(False, "keep vLLM's warnings and load bars on the console")
    # ---- tracking ----
    wandb: str = launch.flag("", 'W&B project: log every metrics.jsonl row there ("" = no W&B)')
    wandb_name: str = launch.flag("", "the W&B run's name (\"\" = W&B picks one)")


# the error of a teacher that stops writing valid pairs (teacher_samples)
TEACHER_FILTER = ("the format filter at step {step}: the teacher no longer writes valid "
                  "question-answer pairs in the format of data.TEACHER_PROMPT (raise "
                  "--max_rejection_rounds or check the model)")


def parse_args(argv=None) -> Config:
    p = launch.config_parser(Config, description=__doc__)
    return launch.config_from(Config, vars(p.parse_args(argv)))


# ---------------------------------------------------------------------------------------------
# Algorithm 1's decisions: pure functions of reward tables (tested on hand-built ones)

def inner_steps(cfg: Config, promotions: int) -> int:
    """S = 10, then 15, then 20 after the first and second promotions (METHOD.md "Inner loop")."""
    return cfg.inner_steps + cfg.inner_step_inc * min(promotions, cfg.inner_step_cap)


def moving_average(history: list[float], window: int) -> float | None:
    """MA of the last `window` step rewards; None until the window is full."""
    return sum(history[-window:]) / window if len(history) >= window else None


def promotion(R: list[list[float]], ma: float | None, tau: float) -> tuple[int, int] | None:
    """The rule (METHOD.md "Promotion"): the chosen student if MA > tau, else None"""
    if ma is None or not ma > tau:   # (a NaN reward never promotes)
        return None
    return chosen_student(R)


def chosen_student(R: list[list[float]]) -> tuple[int, int]:
    """(k*, j*): k* = argmax_k R_k, j* = the student of X_k* with the median R_k*j (r even: the
    lower middle)"""
    R_k = [sum(row) / len(row) for row in R]
    k = max(range(len(R)), key=lambda i: R_k[i])  # first maximum on ties
    order = sorted(range(len(R[k])), key=lambda j: R[k][j])
    return k, order[(len(order) - 1) // 2]


def decide(history: list[float], R: list[list[float]], window: int, tau: float,
           every_step: bool = False):
    """Steps 6-7 on a step's g x r table R: Rhat = mean_k R_k joins the history, MA over the
    window, promotion or not (every_step: --promote_every_step); a promotion clears the window.
    Returns (Rhat, MA, chosen, history)."""
    reward = sum(sum(row) / len(row) for row in R) / len(R)
    history = history + [reward]
    ma = moving_average(history, window)
    if every_step and not math.isnan(reward):
        chosen = chosen_student(R)
    else:
        chosen = promotion(R, ma, tau)
    return reward, ma, chosen, ([] if chosen else history)


def teacher_advantages(R_k: list[float]) -> list[float]:
    """A_k = R_k - mean_{l != k} R_l (METHOD.md "Teacher update")."""
    return rloo.rloo_advantages(torch.tensor(R_k, dtype=torch.float64)).tolist()


def can_promote(cfg: Config, history: list[float]) -> bool:
    """Can this step promote? Only with a reward that trains students, once the window is full, and
    if MA can still pass tau with the best step reward (1): else no student needs keeping."""
    if not TEACHER_REWARDS[cfg.reward].trains_students:
        return False
    if cfg.promote_every_step:
        return True
    prev = history[len(history) + 1 - cfg.window:] if cfg.window > 1 else []
    return len(history) + 1 >= cfg.window and (sum(prev) + 1) / cfg.window > cfg.tau


# ---------------------------------------------------------------------------------------------
# The teacher's reward: a function of what step 5 measured of one dataset. SOAR's is grounded;
# the baselines' and the table --reward chooses from (TEACHER_REWARDS) are further down.

@dataclasses.dataclass
class Measured:
    """What step 5 measured of one dataset X_k: a teacher reward (TEACHER_REWARDS) is a function
    of this alone. A reward that trains students reads solved and solved0 (or their means, accs
    and acc0s); the others read solve_rates and novelty."""
    dataset: list               # X_k: n (question, answer) pairs
    solved: list[list]          # per student trained on X_k (r): did it solve each question of Q_R
    solved0: list[list]         # the baseline's, measured by the group that trained each of them
                                # (its own engines: Acc0 can differ between groups)
    solve_rates: list[float]    # the baseline's solve rate on each question of X_k
    novelty: list[float]        # each question's novelty against the archive (data.novelty)

    @property
    def accs(self) -> list[float]:   # Acc on Q_R of each student
        return [mean(s) for s in self.solved]

    @property
    def acc0s(self) -> list[float]:  # Acc0 on Q_R where each student was measured
        return [mean(s) for s in self.solved0]


def mean(values: list) -> float:
    """the mean of a list (of outcomes: True counts 1)"""
    return sum(values) / len(values)


def grounded(m: Measured) -> list[float]:
    """SOAR's reward (METHOD.md "Inner loop"): R_kj = Acc(student j trained on X_k) - Acc0, both
    measured on the engines of the group that trained student j"""
    return [acc - acc0 for acc, acc0 in zip(m.accs, m.acc0s)]


@dataclasses.dataclass(frozen=True)
class TeacherReward:
    measure: object         # step 5: (cfg, run, Step, GroupStudents) -> (a Measured per X_k,
                            # the promotion candidates this group kept, the most any rank keeps)
    score: object           # (Measured) -> X_k's row of R: one reward per student, or one
    trains_students: bool   # step 5 trains r students per X_k, so a step can promote one
                            # (METHOD.md "Promotion"); else it measures the baseline's solve rates


# ---------------------------------------------------------------------------------------------
# Algorithm 1

@dataclasses.dataclass
class Step:
    """What step 5 (measure) is given: the g datasets, Q_R, what the baseline solves of it (Acc0's
    outcomes, this student group's) and S."""
    index: int
    datasets: list          # g lists of n (question, answer) pairs: X_1..X_g
    q_r: list[dict]         # M hard train problems
    solved0: list[list]     # for each of this group's students (my_students' order): does the
                            # baseline solve each question of Q_R, where that student is measured
    inner_steps: int        # S: each student's RLOO steps


def main(cfg: Config):
    """Algorithm 1 on cfg (without --model, world.resolve has filled in the built-in world's model
    and hard set: see the end of this file)"""
    teacher_reward = TEACHER_REWARDS[cfg.reward]
    # the harness (launch.py): ranks, meshes, engine, teacher, student, theta, from the checkpoint
    # when there is one; None if the run is finished
    run = launch.start(cfg, teacher_reward.trains_students)
    if run is None:
        return
    state = run.state
    # how the teacher writes a pair: one reply; with --teacher_turns 2, two (end of this file)
    teacher_draw = (two_turns if cfg.teacher_turns == 2 else one_reply)(cfg, run)
    # steps 4-5 on a group's students: one at a time; with LoRA all side by side (end of this file)
    group_students = SIDE_BY_SIDE if cfg.lora_rank else ONE_AT_A_TIME
    for step in launch.steps(cfg, run):
        S = inner_steps(cfg, state["promotions"])   # this step's inner loop (a promotion: next's)
        # 1-2. the teacher samples g*n valid pairs (by rejection), split in order into X_1..X_g
        with rloo.timed("teacher_generation"):
            kept, sampled = teacher_samples(cfg, run, step, teacher_draw)
        datasets = split_datasets([pair for _, pair in kept], cfg.num_datasets)
        # 3-4. a fresh Q_R and what the baseline solves of it, greedy (Acc0 is its mean): once for
        # each of this group's students (with LoRA, where that student's adapter is measured)
        q_r = sample_q_r(cfg, run, step)
        solved0 = group_students.baseline_outcomes(cfg, run, q_r)
        # 5. the g x r table R: grounded, R_kj = Acc(a student trained on X_k from theta) - Acc0
        # (measure_students -> trained_outcomes -> train_student); the intrinsic baselines, one
        # column: X_k's mean reward (TEACHER_REWARDS)
        measured, candidates, held = teacher_reward.measure(
            cfg, run, Step(step, datasets, q_r, solved0, S), group_students)
        # rank 0's R on every rank: one decision, whatever the last bits of per-rank floats
        R = rloo.all_gather([teacher_reward.score(m) for m in measured])[0]
        R_k = [sum(row) / len(row) for row in R]
        # 6-7. Rhat, MA, promotion (intrinsic baselines train no students, so they never promote)
        tau = cfg.tau if teacher_reward.trains_students else float("inf")
        every_step = cfg.promote_every_step and teacher_reward.trains_students
        reward, ma, chosen, state["history"] = decide(state["history"], R, cfg.window, tau,
                                                      every_step)
        # every rank must decide alike (a promotion is a collective): else stop, naming the ranks
        launch.check_same(dict(R=R, reward=reward, ma=ma, chosen=chosen), f"step {step}'s decision")
        if chosen:
            run.theta = promote(cfg, run, chosen, candidates)
            state["promotions"] += 1
            state["pq"] += cfg.dataset_size
        del candidates
        # 8. teacher RLOO update: every completion of X_k gets A_k
        with rloo.timed("teacher_update"):
            stats = teacher_update(cfg, run, kept, R_k)
        state["step"] = step + 1
        acc0 = mean(solved0[0])   # each group's first student's (group 0's: the row's acc0)
        row = dict(step=step, acc0=acc0,
                   acc0_groups=rloo.all_gather(acc0)[::run.mesh["fsdp"].size()],
                   R=R, R_k=R_k, reward=reward, ma=ma, promoted=bool(chosen),
                   promoted_k=chosen[0] if chosen else None,
                   promoted_j=chosen[1] if chosen else None, promotions=state["promotions"],
                   inner_steps=S,
                   teacher_valid_rate=len(kept) / sampled, teacher_samples=sampled,
                   teacher_loss=stats["loss"], teacher_kl=stats["kl"], snapshots=held)
        pq_rows, q_rows = question_rows(step, datasets, R_k, chosen)
        # the harness: checkpoint (the step's commit), rows, W&B, HF folders, the console line
        launch.commit(cfg, run, {"metrics.jsonl": [row], "pq.jsonl": pq_rows,
                                 "questions.jsonl": q_rows}, promoted=bool(chosen),
                      line=lambda row: console_line(row, cfg.outer_steps))
    launch.finish(cfg, run)


# ---------------------------------------------------------------------------------------------
# the pieces of one outer step, in the order of Algorithm 1

def teacher_samples(cfg: Config, run, step: int, draw) -> tuple[list, int]:
    """Steps 1-2: g*n valid pairs from the teacher, by rejection sampling on all W engines
    (METHOD.md "Format filter"): draw(k, seed) (one_reply) writes k samples, round i from
    seed_of(seed, step, "teacher", i). Returns the kept (sample, (question, answer)) in sampling
    order and the number of samples drawn."""
    with rloo.timed("sync"):
        rloo.sync_weights(run.teacher, run.llm)
    seeds = [rloo.seed_of(cfg.seed, step, "teacher", i) for i in range(cfg.max_rejection_rounds)]
    return rloo.sample_until(draw, need=cfg.num_datasets * cfg.dataset_size,
                             parse=data.parse_teacher_batch, round_seeds=seeds,
                             what=TEACHER_FILTER.format(step=step), group=dist.group.WORLD)


def one_reply(cfg: Config, run):
    """how the teacher writes (rloo.sample_until's draw): a question and its answer in one reply
    to the teacher prompt, sampled on all W engines"""
    return rloo.samples_of(run.llm, data.teacher_prompt(run.tok), max_tokens=cfg.teacher_max_tokens,
                           temperature=cfg.temperature, group=dist.group.WORLD)


def split_datasets(pairs: list, g: int) -> list[list]:
    """X_1..X_g: the pairs (or what was measured of each) split in order into g equal parts"""
    n = len(pairs) // g
    return [pairs[k * n:(k + 1) * n] for k in range(g)]


def sample_q_r(cfg: Config, run, step: int) -> list[dict]:
    """Step 3: a fresh Q_R of M hard train problems"""
    rng = random.Random(rloo.seed_of(cfg.seed, step, "q_r"))
    return data.sample_questions(run.hard, cfg.qr_size, rng)


def baseline_outcomes(cfg: Config, run, q_r: list[dict]) -> list[list[bool]]:
    """Step 4: what the baseline student solves of Q_R, greedy (Acc0 is its mean), once per step
    and student group: on the group's own engines, as its trained students are measured (greedy
    bf16 decoding is not batch-invariant: Acc0 from other engines or batches could differ by more
    than tau). The same for each of the group's students (one at least: the step's row logs it)."""
    rloo_extras.restore(run.student, run.theta)
    return [outcomes(cfg, run, q_r, run.student)] * max(len(my_students(cfg, run)), 1)


def outcomes(cfg: Config, run, questions: list[dict], policy) -> list[bool]:
    """Does a policy solve each question, greedy (METHOD.md "Rewards": Acc is their mean), on the
    group's engines"""
    with rloo.timed("sync"):
        rloo.sync_weights(policy, run.llm)
    with rloo.timed("evaluation"):
        counts = rloo.count_correct(run.llm, questions, prompt=data.student_prompt,
                                    correct=data.solved, n=1, temperature=0.0,
                                    max_tokens=cfg.student_max_tokens, seed=0,
                                    group=run.mesh["fsdp"].get_group())
    return [count > 0 for count in counts]


def measure_students(cfg: Config, run, step: Step, group_students) -> tuple[list, dict, int]:
    """Step 5 of SOAR's reward: each group trains and measures its share of the g*r students
    (group_students.trained_outcomes: one at a time, or LoRA's side by side). Returns, on every
    rank, what was measured of each X_k (what its students solve of Q_R, and what the baseline
    solves where each was measured: its step.solved0 there), the promotion candidates this group
    kept and the most any rank keeps."""
    solved, candidates = group_students.trained_outcomes(cfg, run, step)
    held = sum(snap is not None for snap in candidates.values())
    parts = rloo.all_gather(({kj: (solved[kj], solved0) for kj, solved0 in
                              zip(my_students(cfg, run), step.solved0)}, held))
    table = {kj: pair for part, _ in parts for kj, pair in part.items()}
    measured = [Measured(X, [table[k, j][0] for j in range(cfg.students)],
                         [table[k, j][1] for j in range(cfg.students)], [], [])
                for k, X in enumerate(step.datasets)]
    return measured, candidates, max(n for _, n in parts)


def trained_outcomes(cfg: Config, run, step: Step) -> tuple[dict, dict]:
    """This group's students (my_students), one at a time in run.student: each trained
    (train_student), then what it solves of Q_R measured. Returns {(k, j): its outcomes} and the
    promotion candidates kept, only if this step can promote (can_promote): a snapshot in host RAM
    of each student but the last, which stays in run.student until the decision (None)."""
    keep = can_promote(cfg, run.state["history"])
    mine = my_students(cfg, run)
    solved = {}
    candidates = {}
    for k, j in mine:
        with rloo.timed("student_training"):
            train_student(cfg, run, step, k, j)
        solved[k, j] = outcomes(cfg, run, step.q_r, run.student)
        if keep:
            candidates[k, j] = rloo_extras.snapshot(run.student) if (k, j) != mine[-1] else None
    return solved, candidates


def train_student(cfg: Config, run, step: Step, k: int, j: int) -> None:
    """Student j of X_k (METHOD.md "Inner loop"): run.student trained from theta with a fresh
    optimizer (cosine over S, no warmup), one RLOO step per batch of student_batches, sampled on
    the group's engines"""
    batches = student_batches(cfg, step, k, j)
    how = student_rl(cfg, run)
    rloo_extras.restore(run.student, run.theta)
    rloo.reset_optimizer(run.student, lr=cfg.student_lr, warmup_steps=0,
                         total_steps=len(batches) * how["updates"])
    for batch, seed in batches:
        rloo.rl_step(run.student, run.llm, batch, seed=seed, **how)


def student_batches(cfg: Config, step: Step, k: int, j: int) -> list[tuple[list, int]]:
    """What student (k, j) trains on in each of its S inner steps: Q pairs of X_k, taken in a
    shuffled order (again from the start when it runs out), and the seed of the step's rollouts"""
    X = step.datasets[k]
    order = list(range(len(X)))
    random.Random(rloo.seed_of(cfg.seed, step.index, "order", k, j)).shuffle(order)
    Q = cfg.student_questions
    return [([X[order[(s * Q + i) % len(order)]] for i in range(Q)],
             rloo.seed_of(cfg.seed, step.index, "student", k, j, s))
            for s in range(step.inner_steps)]


def student_rl(cfg: Config, run) -> dict:
    """how a student's RL step samples, scores and learns (rloo.rl_step): the student prompt, graded
    by data.grade, student_samples a question, RLOO, one on-policy update per batch"""
    return dict(prompt=data.student_prompt, reward=data.grade, samples=cfg.student_samples,
                temperature=cfg.temperature, max_tokens=cfg.student_max_tokens,
                group=run.mesh["fsdp"].get_group(), micro_batch_tokens=cfg.micro_batch_tokens,
                advantages=rloo.rloo_advantages, loss=rloo.rloo_loss, updates=1)


def students(cfg: Config) -> list[tuple[int, int]]:
    """the (k, j) of every student of a step; group i trains students[i::G]"""
    return [(k, j) for k in range(cfg.num_datasets) for j in range(cfg.students)]


def my_students(cfg: Config, run) -> list[tuple[int, int]]:
    """the (k, j) this rank's student group trains"""
    return students(cfg)[run.mesh.get_local_rank("group")::run.mesh["group"].size()]


@dataclasses.dataclass(frozen=True)
class GroupStudents:
    """how a student group measures Acc0's outcomes (step 4) and trains and measures its students
    (step 5)"""
    baseline_outcomes: object   # (cfg, run, q_r) -> the baseline's, for each student of the group
    trained_outcomes: object    # (cfg, run, step) -> ({(k, j): its outcomes}, promotion candidates)


ONE_AT_A_TIME = GroupStudents(baseline_outcomes, trained_outcomes)


def promote(cfg: Config, run, chosen, candidates: dict) -> dict:
    """theta := the chosen student (METHOD.md "Promotion"): its group broadcasts its shards to all.
    Its group kept it as a snapshot, or (None) it is still in run.student."""
    src = students(cfg).index(chosen) % run.mesh["group"].size()   # the group that trained it
    theta = run.theta
    mine = run.mesh.get_local_rank("group") == src
    # every rank raises, not the chosen group alone: the others would wait in the broadcast
    if not all(rloo.all_gather(chosen in candidates or not mine)):
        err = RuntimeError(f"promote: student {chosen} was not kept (can_promote assumed a step "
                           f"reward of at most 1; --reward {cfg.reward} gave more)")
        err.from_rank0 = not rloo.rank0()   # rank 0 alone prints it (launch.main)
        raise err
    if mine:
        theta = candidates[chosen]
        if theta is None:   # the group's last student: still in run.student
            theta = rloo_extras.snapshot(run.student)
    with rloo.timed("sync"):
        rloo_extras.broadcast_snapshot(theta, src, run.mesh["group"].get_group())
    return theta


def teacher_update(cfg: Config, run, kept: list, R_k: list[float]) -> dict:
    """Step 8 (METHOD.md "Teacher update"): one RLOO update of the teacher, every completion of X_k
    with A_k (a two-turn sample: both turns, so its log-prob is the sum of theirs), each rank on
    its share of the g*n samples"""
    n = cfg.dataset_size
    adv = teacher_advantages(R_k)
    rows = rloo.my_share([(turn, adv[i // n]) for i, (s, _) in enumerate(kept)
                          for turn in rloo_extras.turns(s)])
    return rloo.train_step(run.teacher, [s.prompt_token_ids for s, _ in rows],
                           [s.token_ids for s, _ in rows], [a for _, a in rows],
                           loss=rloo.rloo_loss, temperature=cfg.temperature,
                           micro_batch_tokens=cfg.micro_batch_tokens)


def question_rows(step: int, datasets: list[list], R_k: list[float], chosen) -> tuple[list, list]:
    """The step's rows of pq.jsonl (the promoted dataset's pairs) and of questions.jsonl (the
    curriculum: every pair, with its dataset k and R_k)"""
    pq_rows = []
    if chosen:
        pq_rows = [{"question": q, "answer": a, "step": step} for q, a in datasets[chosen[0]]]
    q_rows = [{"question": q, "answer": a, "step": step, "k": k, "R_k": R_k[k]}
              for k, X in enumerate(datasets) for q, a in X]
    return pq_rows, q_rows


def console_line(row: dict, outer_steps: int) -> str:
    """the step's line on the console, from its metrics row"""
    ma = "-" if row["ma"] is None else f"{row['ma']:+.3f}"
    return (f"step {row['step'] + 1}/{outer_steps}  reward {row['reward']:+.3f}  MA {ma}  "
            f"promotions {row['promotions']}  valid {row['teacher_valid_rate']:.0%}  "
            f"{row['total']:.0f} s")


# ---------------------------------------------------------------------------------------------
# The baselines' teacher rewards (METHOD.md "Intrinsic-T", "OpenSIR-style reward"): no students are
# trained; step 5 measures the baseline student's solve rates on X_k instead. Then the table of
# every teacher reward, SOAR's among them, that --reward chooses from.

# the OpenSIR-style teacher reward (METHOD.md "OpenSIR-style reward")
OPENSIR_BAND = (0.1, 0.9)   # calibrated: the baseline student's solve rate is inside this band
OPENSIR_DIVERSITY = 0.5     # weight of novelty, 1 - max cosine similarity to an archived question
OPENSIR_ARCHIVE = 1024      # novelty compares to the teacher's latest valid questions (past steps)


def measure_baseline(cfg: Config, run, step: Step, group_students=None) -> tuple[list, dict, int]:
    """Step 5 for a baseline's reward: the baseline student's solve rate on each question of X_k,
    and its novelty against the archive (which is in the run's state, and so in the checkpoint,
    and then takes this step's questions). No students are trained, so none are kept."""
    questions, rates = solve_rates(cfg, run, step)
    novelties = data.novelty(questions, run.state["archive"])
    run.state["archive"] = (run.state["archive"] + questions)[-OPENSIR_ARCHIVE:]
    g = cfg.num_datasets
    measured = [Measured(X, [], [], X_rates, X_novelties) for X, X_rates, X_novelties
                in zip(step.datasets, split_datasets(rates, g), split_datasets(novelties, g))]
    return measured, {}, 0


def solve_rates(cfg: Config, run, step: Step) -> tuple[list[str], list[float]]:
    """the questions of the g datasets, flat, and the baseline student's solve rate on each (its
    weights are in the engines already): what the intrinsic rewards are made of"""
    flat = [{"question": q, "answer": a} for X in step.datasets for q, a in X]
    with rloo.timed("evaluation"):
        counts = rloo.count_correct(run.llm, flat, prompt=data.student_prompt, correct=data.solved,
                                    n=cfg.learnability_samples, group=dist.group.WORLD,
                                    temperature=cfg.temperature, max_tokens=cfg.student_max_tokens,
                                    seed=rloo.seed_of(cfg.seed, step.index, "learnability"))
    return [q["question"] for q in flat], [c / cfg.learnability_samples for c in counts]


def learnability(success_rates: list[float]) -> float:
    """r_q = 0 if s = 0 else 1 - s, averaged over the dataset (METHOD.md "Intrinsic-T")."""
    return sum(0.0 if s == 0 else 1.0 - s for s in success_rates) / len(success_rates)


def learnability_reward(m: Measured) -> list[float]:
    """Intrinsic-T (METHOD.md "Intrinsic-T"): R_k = X_k's mean learnability"""
    return [learnability(m.solve_rates)]


def opensir(success_rates: list[float], novelty: list[float]) -> list[float]:
    """Per question (METHOD.md "OpenSIR-style reward"): 1 if the baseline's solve rate s is inside
    OPENSIR_BAND, plus OPENSIR_DIVERSITY * its novelty."""
    lo, hi = OPENSIR_BAND
    return [float(lo <= s <= hi) + OPENSIR_DIVERSITY * v for s, v in zip(success_rates, novelty)]


def opensir_reward(m: Measured) -> list[float]:
    """R_k = X_k's mean OpenSIR-style reward (METHOD.md "OpenSIR-style reward")"""
    per_question = opensir(m.solve_rates, m.novelty)
    return [sum(per_question) / len(per_question)]


# --reward: how the teacher's datasets are scored (step 5). A new reward is one entry here and its
# name in Config.reward's choices (argparse checks the flag before this table exists; a test checks
# that the two agree).
TEACHER_REWARDS = {
    "grounded": TeacherReward(measure_students, grounded, trains_students=True),
    "learnability": TeacherReward(measure_baseline, learnability_reward, trains_students=False),
    "opensir": TeacherReward(measure_baseline, opensir_reward, trains_students=False)}


# ---------------------------------------------------------------------------------------------
# LoRA (METHOD.md "LoRA"): a group's students are adapters on one frozen base (run.adapters, the
# first is run.student), trained side by side: each inner step samples all their rollouts in one
# engine call, with the seeds of the group's first student (request i: seed + i * samples).

def side_by_side_baseline_outcomes(cfg: Config, run, q_r: list[dict]) -> list[list[bool]]:
    """Step 4 with LoRA: Acc0's outcomes measured as the group's students are, all its adapters at
    theta in one engine call (the same batch shape and order): each student's are its adapter's"""
    policies = run.adapters[:len(my_students(cfg, run))]
    for policy in policies:
        rloo_extras.restore(policy, run.theta)
    return adapter_outcomes(cfg, run, q_r, policies)


def side_by_side_trained_outcomes(cfg: Config, run, step: Step) -> tuple[dict, dict]:
    """trained_outcomes with LoRA: the group's students trained side by side, then measured in
    one engine call; the first stays in run.student"""
    keep = can_promote(cfg, run.state["history"])
    mine = my_students(cfg, run)
    policies = run.adapters[:len(mine)]
    plans = [student_batches(cfg, step, k, j) for k, j in mine]
    how = student_rl(cfg, run)
    with rloo.timed("student_training"):
        for policy in policies:
            rloo_extras.restore(policy, run.theta)
            rloo.reset_optimizer(policy, lr=cfg.student_lr, warmup_steps=0,
                                 total_steps=len(plans[0]) * how["updates"])
        for s in range(len(plans[0])):
            lora.rl_steps(policies, run.llm, [plan[s][0] for plan in plans], seed=plans[0][s][1],
                          **how)
    solved = adapter_outcomes(cfg, run, step.q_r, policies)
    candidates = {}
    if keep:
        candidates = {kj: rloo_extras.snapshot(policy) if i else None
                      for i, (kj, policy) in enumerate(zip(mine, policies))}
    return dict(zip(mine, solved)), candidates


def adapter_outcomes(cfg: Config, run, questions: list[dict], policies: list) -> list[list[bool]]:
    """outcomes of several adapters, in one engine call"""
    with rloo.timed("evaluation"):
        counts = lora.correct_counts(policies, run.llm, questions, prompt=data.student_prompt,
                                     correct=data.solved, n=1, temperature=0.0,
                                     max_tokens=cfg.student_max_tokens, seed=0,
                                     group=run.mesh["fsdp"].get_group())
    return [[count > 0 for count in policy_counts] for policy_counts in counts]


SIDE_BY_SIDE = GroupStudents(side_by_side_baseline_outcomes, side_by_side_trained_outcomes)


# ---------------------------------------------------------------------------------------------
# The two-turn teacher (METHOD.md "Two-turn teacher", --teacher_turns 2): the question, then its
# answer in a second turn after the prompt p' (data.answer_prompt); a sample is its two turns,
# filtered as one text, and the teacher update trains both (rloo_extras.turns)

def two_turns(cfg: Config, run):
    """one_reply in two turns: turn 1 ends where its question does (data.question_end)"""
    return rloo_extras.turns_of(run.llm, data.teacher_prompt(run.tok),
                         answer_prompt=data.answer_prompt(run.tok, cfg.answer_prompt),
                         stop=data.QUESTION_STOP, turn_end=data.question_end,
                         max_tokens=cfg.teacher_max_tokens, temperature=cfg.temperature,
                         group=dist.group.WORLD)


if __name__ == "__main__":
    launch.main("soar.py", lambda: main(world.resolve(parse_args())))
