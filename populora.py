r"""PopuLoRA (METHOD.md "PopuLoRA"): a population of teachers and a population of students, all LoRA
adapters on one frozen base. Each round every teacher is matched with a student by TrueSkill rating
(PFSP), writes problems, and its student solves them; a teacher is rewarded by its student's
failures on its valid problems (Absolute Zero's proposer reward); ratings follow the results; every
--evolve_every rounds, before the round, the lowest-rated member of each population is replaced by
a mutated crossover of the best two of the others. --single_agent is the baseline: one adapter
plays both roles, with the updates and samples of one population member (per adapter).

Launch:
    torchrun --standalone --nproc_per_node 1 populora.py                # CPU: the built-in world
    torchrun --standalone --nproc_per_node 1 populora.py --single_agent --teachers 1 --students 1 \
        --out runs/populora-single
    torchrun --nproc_per_node 8 populora.py --model meta-llama/Llama-3.2-3B-Instruct \
        --out runs/populora --teachers 8 --students 8
Rerunning the same command resumes from the last finished round.

Outputs in --out: metrics.jsonl (one line per round), questions.jsonl (every valid problem with its
round, teacher, student and solve rate), teachers/t<i>/ and students/s<j>/ (PEFT adapter folders
on the base model, every --save_every rounds and at the end), ckpt/ (resume).
"""
import dataclasses
import math
import os
import random
import statistics
import time

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
    # Each flag's default is the paper's; `world=` is its value on the built-in world (without
    # --model): soar.py's sampling, with the LoRA rank and the students' lr chosen on the world's
    # train split (docs/lora.md), the teachers' lr 10x lower: at 3e-3 they lose the format within
    # 20-30 rounds (what they write, docs/populora.md "60 rounds").
    # ---- models and data ----
    model: str = launch.flag("", 'base model (every adapter sits on it); "" = built-in world')
    world: str = launch.flag("default",
        "the built-in world without --model: default, or small (the tests')",
        choices=("default", "small"))
    out: str = launch.flag("runs/populora", "output folder; rerunning on it resumes")
    seed: int = launch.flag(0, "every random draw derives from it (rloo.seed_of)")
    # ---- the populations (METHOD.md "PopuLoRA") ----
    teachers: int = launch.flag(4, "teacher adapters", least=1)
    students: int = launch.flag(4, "student adapters", least=1)
    single_agent: bool = launch.flag(False,
        "the baseline: one adapter writes and solves its own problems, one update a round as a "
        "member takes: a student's (--student_lr) in even rounds, a teacher's in odd (needs 1 + 1)")
    single_agent_update: str = launch.flag("alternate", "--single_agent's update: alternate (as "
        "above: a member's updates, each on one role's samples) or joint (Absolute Zero's: one "
        "update a round on both roles' samples, at --student_lr)", choices=("alternate", "joint"))
    rounds: int = launch.flag(40, "rounds of play", least=1)
    proposals: int = launch.flag(8, "problems a teacher writes a round (its RLOO group)", least=2)
    student_samples: int = launch.flag(32, world=8,
        help="samples per problem (the student's RLOO group)", least=2)
    evolve_every: int = launch.flag(5,
        "every this many rounds, before the round, replace each population's lowest-rated "
        "member (0: never; never after the last round)", least=0)
    crossover: str = launch.flag("layers", "evolution's crossover of the two best: each layer "
                                 "from one parent, an entry-wise uniform crossover of their "
                                 "updates, or a DARE merge of them (METHOD.md \"PopuLoRA\")",
                                 choices=("layers", "uniform", "dare"))
    dare_drop: float = launch.flag(0.5, "--crossover uniform, dare: the share of entries dropped "
                                   "(the rest is rescaled)")
    mutation: str = launch.flag("gaussian", "evolution's mutation of the child: Gaussian noise on "
                                "every entry, or a rescaling of each update's singular values",
                                choices=("gaussian", "svd"))
    mutation_sigma: float = launch.flag(0.1, "the mutation's scale: gaussian, the noise as a share "
                                        "of each tensor's RMS; svd, the std of log(scale)")
    proposer_reward: str = launch.flag("azr", "a teacher's reward for one proposal, s its "
        "student's solve rate: azr (Absolute Zero's code): -1 if it failed a check, -0.5 if valid "
        "with s = 0 or 1, else 1 - s; azr-paper (its paper's formulas): -0.5 if formatted but "
        "invalid, -1 if malformed, 0 for s = 0 or 1, else 1 - s; failure: azr-paper, but 1 for "
        "s = 0", choices=("azr", "azr-paper", "failure"))
    format_penalties: bool = launch.flag(True, "Absolute Zero's format-aware rewards: the "
        "proposer's negative values above; a solution correct 1, boxed but wrong -0.5, unboxed -1 "
        "(--no-format_penalties: 0 in place of every negative proposer reward, and the student "
        "reward 120/20/10/0 of METHOD.md \"Rewards\")")
    # ---- optimisation ----
    teacher_lr: float = launch.flag(1e-4, world=3e-4, help="AdamW, constant: the population "
        "trains while it plays (LoRA: ~10x full fine-tuning's)")
    student_lr: float = launch.flag(1e-4, world=3e-3, help="AdamW, constant")
    kl_coef: float = launch.flag(0.001, "k3 KL to the base (no adapter)")
    lora_rank: int = launch.flag(32, world=8, help="rank of every adapter", least=1)
    lora_alpha: float = launch.flag(32.0, "adapters' scale: the update is (alpha / rank) B A")
    # ---- sampling ----
    teacher_max_tokens: int = launch.flag(512, world=WORLD_MAX_TOKENS,
        help="new tokens per problem written", least=1)
    student_max_tokens: int = launch.flag(1024, world=WORLD_MAX_TOKENS,
        help="new tokens per solution", least=1)
    temperature: float = launch.flag(1.0, "sampling temperature")
    # ---- systems ----
    micro_batch_tokens: int = launch.flag(16384,
        "tokens per forward/backward pass (rows x longest row)")
    prompt_pass: str = launch.flag("auto", "training forward: shared, single or auto "
                                   "(soar.py --help)", choices=("auto", "shared", "single"))
    activation_checkpointing: bool = launch.flag(True, world=False, help="recompute activations")
    gpu_memory_utilization: float = launch.flag(0.3, "the vLLM engine's share of GPU memory")
    save_every: int = launch.flag(10, "write the PEFT folders every this many rounds and at the "
                                  "end", least=1)
    verbose: bool = launch.flag(False, "keep vLLM's warnings and load bars on the console")


# ratings (METHOD.md "PopuLoRA", step 5): TrueSkill for 1-vs-1 games, its usual constants. A
# member's rating is (mu, sigma); a newcomer's (MU0, SIGMA0); BETA: the skill gap that wins 76% of
# games; TAU: sigma's growth a round (dynamics), capped at SIGMA0; DRAW_P: the prior share of draws
MU0 = 25.0
SIGMA0 = MU0 / 3
BETA = SIGMA0 / 2
TAU = SIGMA0 / 100
DRAW_P = 0.10
NORMAL = statistics.NormalDist()
DRAW_MARGIN = NORMAL.inv_cdf((DRAW_P + 1) / 2) * math.sqrt(2) * BETA   # TrueSkill's epsilon
OUTPUTS = ("metrics.jsonl", "questions.jsonl")
MAY_CHANGE = {"rounds", "out", "micro_batch_tokens", "activation_checkpointing", "prompt_pass",
              "gpu_memory_utilization", "save_every", "verbose"}


def parse_args(argv=None) -> Config:
    p = launch.config_parser(Config, description=__doc__)
    return launch.config_from(Config, vars(p.parse_args(argv)))


# ---------------------------------------------------------------------------------------------
# ratings and matchmaking: pure functions (tested on hand-built ratings). A rating is [mu, sigma].


def win_probability(a: list, b: list) -> float:
    """TrueSkill: the chance that a member rated a beats one rated b (draws aside)"""
    return NORMAL.cdf((a[0] - b[0]) / math.sqrt(2 * BETA ** 2 + a[1] ** 2 + b[1] ** 2))


def pfsp_weights(teacher: list, students: list[list]) -> list[float]:
    """Prioritized fictitious self-play's even-match weighting: p (1 - p), p = a student's
    win_probability against the teacher; largest for the students the teacher is level with, and
    for the uncertain (a large sigma pulls p to 1/2)"""
    return [max(p * (1 - p), 1e-12) for p in (win_probability(s, teacher) for s in students)]


def match(teacher_ratings: list, student_ratings: list, rng: random.Random,
          newcomers: tuple = (), can_teach: list | None = None) -> list[int]:
    """each teacher's student this round. Teachers draw in a random order, by pfsp_weights, from
    the students not yet drawn this round (all of them again once each has been drawn): with equal
    populations every student plays exactly once, with more teachers at least once. A newcomer
    (evolution's child, this round its first) is drawn first, by a teacher that can teach it
    (can_teach[i]: wrote a problem this round), so it trains in its first round."""
    order = list(range(len(teacher_ratings)))
    rng.shuffle(order)
    pairs = [0] * len(teacher_ratings)
    free = []
    waiting = set(newcomers)   # newcomers no teacher that can teach them has drawn yet
    for i in order:
        free = free or list(range(len(student_ratings)))
        fresh = [j for j in free if j in waiting]
        if not fresh:
            pool = free
        elif can_teach is None or can_teach[i]:
            pool = fresh
        else:   # a teacher with nothing to teach leaves the newcomers to the others
            pool = [j for j in free if j not in waiting] or free
        weights = pfsp_weights(teacher_ratings[i], [student_ratings[j] for j in pool])
        pairs[i] = pool[rng.choices(range(len(pool)), weights=weights)[0]]
        free.remove(pairs[i])
        if can_teach is None or can_teach[i]:   # it trains this round: no priority any more
            waiting.discard(pairs[i])
    return pairs


def outcome(score: float) -> float:
    """a match's result for the student from its solve rate: a win above 1/2, a loss below, a
    draw at 1/2 (1, 0 or 0.5)"""
    return 1.0 if score > 0.5 else 0.0 if score < 0.5 else 0.5


def grow_sigma(rating: list) -> list:
    """TrueSkill's dynamics, once a round for every member, played or not: sigma^2 + TAU^2, at
    most SIGMA0 (absence never makes a member less known than a newcomer)"""
    return [rating[0], min(SIGMA0, math.sqrt(rating[1] ** 2 + TAU ** 2))]


def trueskill_update(winner: list, loser: list, draw: bool = False) -> tuple[list, list]:
    """TrueSkill's two-player update (Herbrich et al. 2006), a draw if `draw`: both means move
    by their own sigma^2 / c times v (so the means' total is kept only when the sigmas are equal),
    both sigmas shrink by their factor (1 - sigma^2 w / c^2)"""
    c = math.sqrt(2 * BETA ** 2 + winner[1] ** 2 + loser[1] ** 2)
    t = (winner[0] - loser[0]) / c
    e = DRAW_MARGIN / c
    if draw:
        mass = NORMAL.cdf(e - t) - NORMAL.cdf(-e - t)
        v = (NORMAL.pdf(-e - t) - NORMAL.pdf(e - t)) / mass
        w = v ** 2 + ((e - t) * NORMAL.pdf(e - t) + (e + t) * NORMAL.pdf(e + t)) / mass
    else:
        mass = NORMAL.cdf(t - e)
        v = NORMAL.pdf(t - e) / mass if mass > 1e-300 else e - t   # (the limit for a big upset)
        w = v * (v + t - e)
    new = []
    for (mu, sigma), sign in ((winner, 1.0), (loser, -1.0)):
        shrink = max(1 - sigma ** 2 / c ** 2 * w, 1e-12)
        new.append([mu + sign * sigma ** 2 / c * v, sigma * math.sqrt(shrink)])
    return new[0], new[1]


def rate_match(teacher: list, student: list, result: float) -> tuple[list, list]:
    """the teacher's and the student's new ratings after a match whose result for the student
    is `result` (outcome: 1, 0 or 0.5)"""
    if result == 0.0:
        return trueskill_update(teacher, student)
    student, teacher = trueskill_update(student, teacher, draw=result == 0.5)
    return teacher, student


# ---------------------------------------------------------------------------------------------
# evolution: pure functions on adapter tensors ({name: tensor}, lora.AdapterModel's names)

def layer_of(name: str) -> str:
    return name.rsplit(".", 1)[0]   # "model.layers.0.self_attn.q_proj.lora_A" -> its layer


def crossover_layers(a: dict, b: dict, seed: int) -> dict:
    """Layer-wise crossover: each layer's A and B together from parent a or parent b, by a fair
    coin per layer. Same rank; equal parents give the parent."""
    rng = random.Random(seed)
    from_a = {layer: rng.random() < 0.5 for layer in sorted({layer_of(n) for n in a})}
    return {n: (a[n] if from_a[layer_of(n)] else b[n]).clone() for n in a}


def mutate_gaussian(adapter: dict, sigma: float, seed: int) -> dict:
    """Gaussian noise on every tensor, sigma times its RMS (a zero B stays zero). Same rank."""
    g = torch.Generator().manual_seed(seed)
    child = {}
    for n in sorted(adapter):
        t = adapter[n]
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device, t.dtype)
        child[n] = t + sigma * t.pow(2).mean().sqrt() * noise
    return child


def crossover_uniform(a: dict, b: dict, drop: float, seed: int, device=None) -> dict:
    """A uniform crossover in update space (merge_updates): U_a + (U_b - U_a) m / (2 (1 - drop)),
    m a Bernoulli(1 - drop) mask per entry, the parents' mean update in expectation; at drop 1/2
    each entry is U_a's or U_b's. Equal parents give the parent's update."""
    def merge(update_a, update_b, g):
        kept = (torch.rand(update_a.shape, generator=g) >= drop).to(update_a.device)
        return update_a + (update_b - update_a) * kept / (2 * (1 - drop))
    return merge_updates(a, b, merge, seed, device)


def crossover_dare(a: dict, b: dict, drop: float, seed: int, device=None) -> dict:
    """DARE (drop and rescale; Yu et al. 2024) of the parents' updates to the frozen base
    (merge_updates): each parent drops every entry of its update with probability `drop` (a mask
    of its own) and rescales the rest by 1 / (1 - drop), then the two are averaged: the parents'
    mean update in expectation. At drop 0, their mean update."""
    def merge(update_a, update_b, g):
        kept_a, kept_b = ((torch.rand(update_a.shape, generator=g) >= drop).to(update_a.device)
                          for _ in range(2))
        return (update_a * kept_a + update_b * kept_b) / (2 * (1 - drop))
    return merge_updates(a, b, merge, seed, device)


def merge_updates(a: dict, b: dict, merge, seed: int, device=None) -> dict:
    """A crossover in update space: per layer, the parents' updates U_a = B_a A_a and U_b = B_b A_b
    are merged (merge(U_a, U_b, generator), full rank in general), then refactored to the adapters'
    rank r by the merge's truncated SVD U S V^T: A = V_r^T (orthonormal rows, as a fresh A's
    scale), B = U_r S_r, the closest rank-r update. The LoRA scale alpha / r is the same for both
    parents and the child, so it cancels. The SVDs run on `device` (a GPU's: a 7B layer's take
    seconds there, minutes on a CPU); the child comes back where the parents are."""
    g = torch.Generator().manual_seed(seed)
    child = {}
    for layer in sorted({layer_of(n) for n in a}):
        A = a[layer + ".lora_A"]
        rank = A.shape[0]
        on = device or A.device
        update_a = a[layer + ".lora_B"].to(on, torch.float64) @ A.to(on, torch.float64)
        update_b = (b[layer + ".lora_B"].to(on, torch.float64) @
                    b[layer + ".lora_A"].to(on, torch.float64))
        u, s, vh = torch.linalg.svd(merge(update_a, update_b, g), full_matrices=False)
        child[layer + ".lora_A"] = vh[:rank].to(A.device, A.dtype)
        child[layer + ".lora_B"] = (u[:, :rank] * s[:rank]).to(A.device, A.dtype)
    return child


def mutate_svd(adapter: dict, sigma: float, seed: int) -> dict:
    """SVD-structured scaling: each layer's update B A keeps its singular vectors and gets its
    singular values scaled by exp(sigma z), z ~ N(0, 1). Only B changes: with B = Q R (QR) and
    R A = U S V^T (SVD), B A = (Q U) S V^T, and B' = Q U diag(exp(sigma z)) U^T R gives
    B' A = (Q U) S diag(exp(sigma z)) V^T. Same rank; a zero B stays zero; sigma 0 gives B."""
    g = torch.Generator().manual_seed(seed)
    child = dict(adapter)
    for layer in sorted({layer_of(n) for n in adapter}):
        A = adapter[layer + ".lora_A"]
        B = adapter[layer + ".lora_B"]
        q, r = torch.linalg.qr(B.double())
        u, _, _ = torch.linalg.svd(r @ A.double(), full_matrices=False)
        scale = torch.exp(sigma * torch.randn(u.shape[1], generator=g, dtype=torch.float64))
        child[layer + ".lora_B"] = (q @ (u * scale) @ u.T @ r).to(B.dtype)
    return child


def replacement(mus: list[float]) -> tuple[int, int, int | None] | None:
    """(loser, best, second) of a population by its members' mu (first on ties): the lowest, and
    the two best of the others. With 2 members there is no second (None: the child is the best,
    mutated; the loser is never its own parent). None below 2 members."""
    if len(mus) < 2:
        return None
    order = sorted(range(len(mus)), key=lambda i: (-mus[i], i))
    second = order[1] if len(mus) > 2 else None
    return order[-1], order[0], second


# ---------------------------------------------------------------------------------------------
# one round

def main(cfg: Config):
    # without --model: the built-in world's model (cached), and its checker as the verifier
    checker = None if cfg.model else world.describe
    cfg = world.resolve(cfg)
    run = setup(cfg, checker)
    if run is None:
        return
    state = run.state
    bar = tqdm(range(state["round"], cfg.rounds), initial=state["round"], total=cfg.rounds,
               disable=not rloo.rank0(), desc="PopuLoRA", dynamic_ncols=True)
    for rnd in bar:
        launch.METER.reset()   # the round's seconds by phase (launch.METER)
        t_round = time.perf_counter()
        # 0. evolution, every evolve_every rounds, before the round: the lowest-rated member of
        # each population is replaced. Never after the last round, so every member a run ends
        # with (saved, evaluated) has trained since it was made.
        evolved = {}
        if cfg.evolve_every and rnd and rnd % cfg.evolve_every == 0:
            evolved = evolve(cfg, run, rnd)
        # 2. every teacher writes its problems (one engine call); the format filter and the
        # verifier say which are valid. Before the draw (1.), which it does not depend on
        for policy in unique(run.teachers + run.students):
            with rloo.timed("sync"):
                rloo.sync_weights(policy, run.llm)
        proposals, formatted = propose(cfg, run, rnd)
        # 1. matchmaking: every rating's sigma grows (TrueSkill's dynamics); each teacher draws
        # a student, favouring even matches, every student drawn once before any twice, a new
        # student first by a teacher with a valid problem (with --model: before agreement)
        for name in ("teacher_ratings", "student_ratings"):
            state[name] = [grow_sigma(r) for r in state[name]]
        can_teach = [any(v is not None for _, v in p) for p in proposals]
        pairs = match(state["teacher_ratings"], state["student_ratings"],
                      random.Random(rloo.seed_of(cfg.seed, rnd, "match")),
                      newcomers=tuple(evolved["students"][:1]) if "students" in evolved else (),
                      can_teach=can_teach)
        # 3. the matched students solve them (one engine call) and learn from the valid ones
        roles = trained_roles(cfg, rnd)
        solves = solve_and_learn(cfg, run, rnd, pairs, proposals, "students" in roles)
        # 4. each teacher learns from its student's failures on its valid problems
        teacher_stats = teach(cfg, run, proposals, formatted, solves, "teachers" in roles)
        # 5. ratings: a match's score is the student's solve rate (1 where nothing was valid),
        # its result a win, a loss or a draw (match_results)
        scores = [sum(s) / len(s) if s else 1.0 for s in valid_solves(solves)]
        for i, (j, result) in enumerate(zip(pairs, match_results(solves, scores))):
            state["teacher_ratings"][i], state["student_ratings"][j] = rate_match(
                state["teacher_ratings"][i], state["student_ratings"][j], result)
        # rank 0's ratings on every rank: the draw and evolution they decide say which adapters
        # train (collectives), so they must not differ in a float's last bit between hosts
        state["teacher_ratings"], state["student_ratings"] = rloo.all_gather(
            (state["teacher_ratings"], state["student_ratings"]))[0]
        state["round"] = rnd + 1
        row = dict(round=rnd, pairs=pairs, scores=scores,
                   valid=[sum(v is not None for _, v in p) / len(p) for p in proposals],
                   teacher_ratings=[[round(x, 3) for x in r] for r in state["teacher_ratings"]],
                   student_ratings=[[round(x, 3) for x in r] for r in state["student_ratings"]],
                   trained=sorted(roles),
                   teacher_loss=[s and s["loss"] for s in teacher_stats], evolved=evolved,
                   **{k: round(v, 3) for k, v in launch.METER.seconds.items()},
                   total=round(time.perf_counter() - t_round, 3))
        questions = []   # the curriculum: every problem that passed every check
        for i, p in enumerate(proposals):
            valid = [v for _, v in p if v is not None]
            questions += [{"question": q, "answer": a, "round": rnd, "teacher": i,
                           "student": pairs[i], "solve_rate": rate}
                          for (q, a), rate in zip(valid, solves[i]) if rate is not None]
        commit(cfg, run, {"metrics.jsonl": [row], "questions.jsonl": questions})
        if rloo.rank0():
            bar.write(f"round {rnd + 1}/{cfg.rounds}  solved {sum(scores) / len(scores):.2f}  "
                      f"valid {sum(row['valid']) / len(row['valid']):.0%}  "
                      f"{row['total']:.0f} s" + (f"  evolved {evolved}" if evolved else ""))
    rloo.print0(f"done: {cfg.out}/metrics.jsonl, {cfg.out}/teachers, {cfg.out}/students")


def trained_roles(cfg: Config, rnd: int) -> set[str]:
    """the roles whose adapters take their update this round. A population: both, each member one
    update a round. --single_agent, matched per adapter (METHOD.md "PopuLoRA", the baseline): its
    one adapter takes one update a round too, as a student in even rounds and as a teacher in odd,
    each on samples it drew this round, before the update."""
    if not cfg.single_agent or cfg.single_agent_update == "joint":
        return {"teachers", "students"}
    return {"students"} if rnd % 2 == 0 else {"teachers"}


def match_results(solves: list[list], scores: list[float]) -> list[float]:
    """each match's result for the student (outcome of its score). A match whose problems were
    all formatted but none valid is a draw: only --model's agreement rule leaves a problem
    unverified (solves' None), and a problem no sample agrees with is too hard or wrong, no one can
    say which, so the match moves ratings toward neither side."""
    results = [outcome(s) for s in scores]
    for i, rates in enumerate(solves):
        if rates and all(r is None for r in rates):
            results[i] = 0.5
    return results


def unique(policies: list) -> list:
    """each policy once (--single_agent: the teacher is the student)"""
    return list({id(p): p for p in policies}.values())


def propose(cfg: Config, run, rnd: int) -> list[list]:
    """Step 2: per teacher, its `proposals` samples of the teacher prompt, each with its
    (question, answer) if valid, else None; and per teacher, whether each passed the format filter
    (METHOD.md "Format filter"). Valid: past the format filter and the verifier: on the built-in
    world its own checker (well-posed, the answer right); with --model, checked after solving
    (valid_solves)."""
    prompt = data.teacher_prompt(run.tok)
    n = cfg.proposals
    with rloo.timed("teacher_generation"):
        outs = rloo.generate(run.llm, [prompt] * (n * len(run.teachers)), n=1,
                             temperature=cfg.temperature, max_tokens=cfg.teacher_max_tokens,
                             seed=rloo.seed_of(cfg.seed, rnd, "teachers"), group=dist.group.WORLD,
                             adapters=[t.model.served for t in run.teachers for _ in range(n)])
        samples = [o[0] for o in outs]
        pairs = rloo.split_map(data.parse_teacher_batch, [s.text for s in samples],
                               dist.group.WORLD)
    formatted = [p is not None for p in pairs]
    if run.checker is not None:
        pairs = [p if p is not None and run.checker(*p)["correct"] else None for p in pairs]
    return ([list(zip(samples[i * n:(i + 1) * n], pairs[i * n:(i + 1) * n]))
             for i in range(len(run.teachers))],
            [formatted[i * n:(i + 1) * n] for i in range(len(run.teachers))])


def solve_and_learn(cfg: Config, run, rnd: int, pairs: list[int], proposals: list[list],
                    learn: bool = True) -> list[list[float]]:
    """Step 3: each student samples student_samples solutions of every valid problem of the
    teachers matched with it, all students in one engine call; then, if `learn`, one RLOO update
    each on the problems that stay valid (METHOD.md "Inner loop": the student's reward and
    advantages). Returns per teacher the solve rate of each of its formatted problems, in order,
    None for one that failed the agreement rule."""
    k = cfg.student_samples
    work = []   # (teacher, question, answer) of every valid problem
    for i, p in enumerate(proposals):
        work += [(i, *v) for _, v in p if v is not None]
    policies = [run.students[pairs[i]] for i, _, _ in work]
    with rloo.timed("student_rollouts"):
        outs = rloo.generate(run.llm, [data.student_prompt(q) for _, q, _ in work], n=k,
                             temperature=cfg.temperature, max_tokens=cfg.student_max_tokens,
                             seed=rloo.seed_of(cfg.seed, rnd, "students"), group=dist.group.WORLD,
                             adapters=[p.model.served for p in policies] if work else None)
        flat = [(s, a) for o, (_, _, a) in zip(outs, work) for s in o]
        rewards = rloo.split_map(lambda share: data.grade([s.text for s, _ in share],
                                                          [a for _, a in share]),
                                 flat, dist.group.WORLD)
    table = torch.tensor(rewards, dtype=torch.float64).view(len(work), k)
    rates = (table == data.R_CORRECT).double().mean(1).tolist()
    if cfg.format_penalties:
        table = solver_reward(table)
    # with --model the verifier is agreement: a problem stays valid if a solution reaches its answer
    keep = [run.checker is not None or r > 0 for r in rates]
    adv = rloo.rloo_advantages(table)
    with rloo.timed("student_training"):
        for policy in unique(run.students) if learn else []:
            rows = [(s, adv[w, c].item()) for w, o in enumerate(outs) for c, s in enumerate(o)
                    if policies[w] is policy and keep[w]]
            if rows:   # (the same on every rank) a student without a valid problem sits out
                train(cfg, run, policy, rloo.my_share(rows), cfg.student_lr)
    solves = [[] for _ in proposals]
    for (i, _, _), rate, ok in zip(work, rates, keep):
        solves[i].append(rate if ok else None)
    return solves


def valid_solves(solves: list[list]) -> list[list[float]]:
    """per teacher, the solve rates of its problems that passed every check"""
    return [[r for r in rates if r is not None] for rates in solves]


def proposer_reward(cfg: Config, rate: float | None, formatted: bool = True) -> float:
    """a teacher's reward for one proposal (METHOD.md "PopuLoRA", step 4), s = rate, its student's
    solve rate on it, None if it failed a check (the format filter, the verifier). --proposer_reward
    azr, as Absolute Zero's code gives it (absolute_zero_reasoner/rewards/reward_managers.py): -1
    for a failed check, formatted or not; -0.5 for a valid one whose solver accuracy reward is 0
    (s = 0, or s = 1 so 1 - s = 0); else 1 - s. azr-paper, its paper's formulas: -0.5 if formatted
    but invalid, -1 if not formatted; 0 for s = 0 or 1; else 1 - s. failure: as azr-paper but
    1 - s for s = 0 too. --no-format_penalties: 0 in place of every negative value."""
    if cfg.proposer_reward == "azr":
        value = -1.0 if rate is None else -0.5 if rate in (0.0, 1.0) else 1.0 - rate
    elif rate is None:
        value = -0.5 if formatted else -1.0
    elif rate == 0.0 and cfg.proposer_reward == "azr-paper":
        value = 0.0
    else:
        value = 1.0 - rate
    return value if cfg.format_penalties else max(value, 0.0)


def solver_reward(rewards: torch.Tensor) -> torch.Tensor:
    """Absolute Zero's format-aware solver reward from the student reward (METHOD.md "Rewards"):
    1 correct, -0.5 a boxed answer that is wrong, -1 no boxed answer"""
    return torch.where(rewards == data.R_CORRECT, 1.0,
                       torch.where(rewards == data.R_NONE, -1.0, -0.5)).to(rewards.dtype)


def teach(cfg: Config, run, proposals: list[list], formatted: list[list], solves: list[list],
          learn: bool = True) -> list[dict | None]:
    """Step 4: if `learn`, one RLOO update per teacher over its proposals, rewarded by
    proposer_reward; its stats per teacher (None where none took place)."""
    stats = []
    with rloo.timed("teacher_update"):
        for i, teacher in enumerate(run.teachers if learn else []):
            rates = iter(solves[i])
            rewards = [proposer_reward(cfg, next(rates) if v is not None else None, f)
                       for (_, v), f in zip(proposals[i], formatted[i])]
            adv = rloo.rloo_advantages(torch.tensor(rewards, dtype=torch.float64)).tolist()
            rows = rloo.my_share([(s, a) for (s, _), a in zip(proposals[i], adv)])
            stats.append(train(cfg, run, teacher, rows, cfg.teacher_lr))
    # --single_agent_update joint: both roles' rows, one update. Decided on every rank's rows: a
    # rank whose share is empty takes the update too, or the others wait in its all-reduces
    if any(rloo.all_gather(bool(run.pending))):
        rows, run.pending = run.pending, []
        stats = [train(cfg, run, run.teachers[0], rows, cfg.student_lr, joint=True)]
    return stats or [None] * len(run.teachers)


def train(cfg: Config, run, policy: rloo.Policy, rows: list, lr: float,
          joint: bool = False) -> dict | None:
    """one rloo.train_step on this rank's (Sample, advantage) rows at the role's learning rate `lr`
    (the single agent's one adapter alternates roles, so its lr follows the role). The joint
    single agent's rows of each role wait in run.pending for its one update on both (teach)."""
    if cfg.single_agent and cfg.single_agent_update == "joint" and not joint:
        run.pending += rows
        return None
    for group in policy.optimizer.param_groups:
        group["lr"] = lr
    policy.scheduler.base_lrs = [lr] * len(policy.optimizer.param_groups)   # constant schedule
    return rloo.train_step(policy, [s.prompt_token_ids for s, _ in rows],
                           [s.token_ids for s, _ in rows], [a for _, a in rows],
                           loss=rloo.rloo_loss, temperature=cfg.temperature,
                           micro_batch_tokens=cfg.micro_batch_tokens)


def evolve(cfg: Config, run, rnd: int) -> dict:
    """Step 0 of round rnd: in each population of 2 or more, the member of lowest mu becomes a
    mutated crossover of the two best of the others (--crossover, --mutation; of 2, the best
    mutated), rated as a newcomer (MU0, SIGMA0), with a fresh optimizer. Returns {population:
    [loser, best, second or None]}."""
    done = {}
    for name, members, ratings in (("teachers", run.teachers, run.state["teacher_ratings"]),
                                   ("students", run.students, run.state["student_ratings"])):
        chosen = replacement([mu for mu, _ in ratings])
        if chosen is None:   # (--single_agent: populations of 1)
            continue
        loser, best, second = chosen
        child = rloo_extras.snapshot(members[best])
        seed = rloo.seed_of(cfg.seed, rnd, name, "crossover")
        if second is not None and cfg.crossover in ("uniform", "dare"):
            merge = crossover_dare if cfg.crossover == "dare" else crossover_uniform
            child = merge(child, rloo_extras.snapshot(members[second]), cfg.dare_drop, seed,
                          members[best].device)
        elif second is not None:
            child = crossover_layers(child, rloo_extras.snapshot(members[second]), seed)
        seed = rloo.seed_of(cfg.seed, rnd, name, "mutation")
        if cfg.mutation == "svd":
            child = mutate_svd(child, cfg.mutation_sigma, seed)
        else:
            child = mutate_gaussian(child, cfg.mutation_sigma, seed)
        # one child, whatever LAPACK does
        rloo_extras.broadcast_snapshot(child, 0, dist.group.WORLD)
        rloo_extras.restore(members[loser], child)
        lr = cfg.teacher_lr if name == "teachers" else cfg.student_lr
        rloo.reset_optimizer(members[loser], lr=lr, warmup_steps=0, total_steps=None)
        ratings[loser] = [MU0, SIGMA0]
        done[name] = [loser, best, second]
    return done


# ---------------------------------------------------------------------------------------------
# set-up and saving

@dataclasses.dataclass
class Run:
    tok: object
    llm: object            # this rank's engine, serving every adapter
    teachers: list         # rloo.Policy adapters on one base
    students: list         # --single_agent: the teacher itself
    checker: object        # the built-in world's verifier (world.describe); None with --model
    state: dict            # round, ratings: what a checkpoint holds besides the adapters
    pending: list = dataclasses.field(default_factory=list)   # the joint single agent's rows


def setup(cfg: Config, checker) -> Run | None:
    """the folder, the checkpoint, the engine and the adapters; None if the run is finished"""
    _, world_size, device = rloo.init_distributed()
    if cfg.single_agent and (cfg.teachers, cfg.students) != (1, 1):
        raise launch.UsageError(f"--single_agent plays one adapter in both roles: it needs "
                                f"--teachers 1 --students 1, not {cfg.teachers} and {cfg.students}")
    problems = launch.too_small(cfg)
    if not 0 <= cfg.dare_drop < 1:
        problems.append(f"--dare_drop {cfg.dare_drop}: the share dropped is in [0, 1)")
    if problems:
        raise launch.UsageError("these settings cannot work:\n  " + "\n  ".join(problems))
    tok = launch.tokenizer(cfg.model)
    launch.lock_folder(cfg.out)
    ckpt, state = launch.resume(cfg.out, dataclasses.asdict(cfg), MAY_CHANGE)
    newcomers = [[MU0, SIGMA0] for _ in range(cfg.teachers + cfg.students)]
    state = state or dict(round=0, teacher_ratings=newcomers[:cfg.teachers],
                          student_ratings=newcomers[cfg.teachers:])
    launch.restore_rows(cfg.out, ckpt, OUTPUTS)
    # the students' questions are teacher samples: at most teacher_max_tokens long
    seq_len = data.engine_len(tok, [], cfg.student_max_tokens, cfg.teacher_max_tokens)
    llm = rloo.build_engine(cfg.model, seed=cfg.seed, max_model_len=seq_len, verbose=cfg.verbose,
                            gpu_memory_utilization=cfg.gpu_memory_utilization,
                            **lora.engine_args(cfg.lora_rank, cfg.teachers + cfg.students))
    mesh = init_device_mesh(device.type, (world_size,))
    opts = dict(warmup_steps=0, total_steps=None, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                kl_coef=cfg.kl_coef, prompts=cfg.prompt_pass,
                activation_checkpointing=cfg.activation_checkpointing)
    first = lora.load_policy(cfg.model, mesh, lr=cfg.teacher_lr, **opts,
                             seed=rloo.seed_of(cfg.seed, "adapter", "teacher", 0))
    base = lora.base_of(first)   # every adapter on one base
    teachers = [first] + [lora.load_policy(cfg.model, mesh, lr=cfg.teacher_lr, base=base,
                                           seed=rloo.seed_of(cfg.seed, "adapter", "teacher", i),
                                           **opts) for i in range(1, cfg.teachers)]
    students = teachers if cfg.single_agent else [
        lora.load_policy(cfg.model, mesh, lr=cfg.student_lr, base=base,
                         seed=rloo.seed_of(cfg.seed, "adapter", "student", j), **opts)
        for j in range(cfg.students)]
    if ckpt:
        for name, policy in members(teachers, students).items():
            rloo_extras.load_state(policy, os.path.join(ckpt, name))
    who = f"{cfg.teachers} teachers, {cfg.students} students"
    if cfg.single_agent:
        who = "one agent in both roles"
    rloo.print0(f"PopuLoRA: {world_size} ranks, model {cfg.model}, {who}, LoRA rank "
                f"{cfg.lora_rank}; out {cfg.out}; {'resuming at' if ckpt else 'starting at'} "
                f"round {state['round']} of {cfg.rounds}")
    run = Run(tok, llm, teachers, students, checker, state)
    if state["round"] >= cfg.rounds:
        save_folders(cfg, run)
        return None
    return run


def members(teachers: list, students: list) -> dict:
    """each adapter by its checkpoint name: t0, t1, ..., s0, ... (--single_agent: t0 alone)"""
    named = {f"t{i}": p for i, p in enumerate(teachers)}
    if students is not teachers:
        named |= {f"s{j}": p for j, p in enumerate(students)}
    return named


def commit(cfg: Config, run: Run, rows: dict) -> None:
    """the checkpoint commits the round with its rows; then, every save_every rounds and at the
    end, the PEFT folders"""
    state = run.state
    launch.save_checkpoint(cfg.out, state["round"],
                           {n: (p, True) for n, p in members(run.teachers, run.students).items()},
                           {**state, "config": dataclasses.asdict(cfg)}, rows=rows)
    if state["round"] % cfg.save_every == 0 or state["round"] >= cfg.rounds:
        save_folders(cfg, run)


def save_folders(cfg: Config, run: Run) -> None:
    """teachers/t<i>/ and students/s<j>/, PEFT folders (--single_agent: its one adapter in both)"""
    tag = {"populora.json": {"round": run.state["round"]}}
    folders = {f"teachers/t{i}": p for i, p in enumerate(run.teachers)}
    folders |= {f"students/s{j}": p for j, p in enumerate(run.students)}
    for folder, policy in folders.items():
        rloo_extras.save_hf(policy, os.path.join(cfg.out, folder), run.tok, run.state["round"], tag)


if __name__ == "__main__":
    launch.main("populora.py", lambda: main(parse_args()))
