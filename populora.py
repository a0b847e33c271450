r"""PopuLoRA (METHOD.md "PopuLoRA"): a population of teachers and a population of students, all LoRA
adapters on one frozen base. Each round every teacher is matched with a student by rating, writes
problems, and its student solves them; a teacher is rewarded by its student's failure rate on its
valid problems (zero-sum); ratings follow the results; every --evolve_every rounds the lowest-rated
member of each population is replaced by a mutated crossover of its two best. --single_agent is
the baseline: one adapter plays both roles, with the same updates.

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
import os
import random
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import data
import launch
import rloo
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
    seed: int = launch.flag(0, "every random draw derives from it (launch.seed_of)")
    # ---- the populations (METHOD.md "PopuLoRA") ----
    teachers: int = launch.flag(4, "teacher adapters", least=1)
    students: int = launch.flag(4, "student adapters", least=1)
    single_agent: bool = launch.flag(False,
        "the baseline: one adapter writes and solves its own problems, at --teacher_lr "
        "(needs 1 + 1)")
    rounds: int = launch.flag(40, "rounds of play", least=1)
    proposals: int = launch.flag(8, "problems a teacher writes a round (its RLOO group)", least=2)
    student_samples: int = launch.flag(32, world=8,
        help="samples per problem (the student's RLOO group)", least=2)
    evolve_every: int = launch.flag(5,
        "every this many rounds, replace each population's lowest-rated member (0: never)",
        least=0)
    crossover: str = launch.flag("layers", "evolution's crossover of the two best: each layer "
                                 "from one parent, or a DARE merge", choices=("layers", "dare"))
    dare_drop: float = launch.flag(0.5, "--crossover dare: the share of the parents' difference "
                                   "dropped (the rest is rescaled)")
    mutation: str = launch.flag("gaussian", "evolution's mutation of the child: Gaussian noise on "
                                "every entry, or a rescaling of each update's singular values",
                                choices=("gaussian", "svd"))
    mutation_sigma: float = launch.flag(0.1, "the mutation's scale: gaussian, the noise as a share "
                                        "of each tensor's RMS; svd, the std of log(scale)")
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


# ratings (METHOD.md "PopuLoRA"): Elo, every member starting level
ELO_START = 1000.0
ELO_K = 32.0
OUTPUTS = ("metrics.jsonl", "questions.jsonl")
MAY_CHANGE = {"rounds", "out", "micro_batch_tokens", "activation_checkpointing", "prompt_pass",
              "gpu_memory_utilization", "save_every", "verbose"}


def parse_args(argv=None) -> Config:
    p = launch.config_parser(Config, description=__doc__)
    return launch.config_from(Config, vars(p.parse_args(argv)))


# ---------------------------------------------------------------------------------------------
# ratings and matchmaking: pure functions (tested on hand-built ratings)

def expected(r_a: float, r_b: float) -> float:
    """Elo: the score a member rated r_a expects against one rated r_b"""
    return 1.0 / (1.0 + 10.0 ** ((r_b - r_a) / 400.0))


def pfsp_weights(teacher: float, students: list[float]) -> list[float]:
    """Prioritized fictitious self-play's even-match weighting: p (1 - p), p = a student's expected
    score against the teacher; largest for the students the teacher is level with"""
    return [expected(s, teacher) * (1.0 - expected(s, teacher)) for s in students]


def match(teacher_ratings: list[float], student_ratings: list[float],
          rng: random.Random) -> list[int]:
    """each teacher's student this round, drawn by pfsp_weights (a student may get several)"""
    return [rng.choices(range(len(student_ratings)), weights=pfsp_weights(t, student_ratings))[0]
            for t in teacher_ratings]


def elo_update(teacher: float, student: float, score: float) -> tuple[float, float]:
    """the two new ratings after a match in which the student scored `score` in [0, 1] (its solve
    rate) and the teacher 1 - score: zero-sum, ELO_K per full upset"""
    delta = ELO_K * (score - expected(student, teacher))
    return teacher - delta, student + delta


# ---------------------------------------------------------------------------------------------
# evolution: pure functions on adapter tensors ({name: tensor}, rloo.Policy.adapter's names)

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


def crossover_dare(a: dict, b: dict, drop: float, seed: int) -> dict:
    """DARE-style merge: a plus half of the difference b - a, after dropping each entry of that
    difference with probability `drop` and rescaling the rest by 1 / (1 - drop), so that the
    child is the parents' mean in expectation. Per tensor (A and B apart, as a merge of adapter
    tensors does). Same rank; equal parents give the parent."""
    g = torch.Generator().manual_seed(seed)
    child = {}
    for n in sorted(a):
        kept = (torch.rand(a[n].shape, generator=g) >= drop).to(a[n].device, a[n].dtype)
        child[n] = a[n] + 0.5 * (b[n] - a[n]) * kept / (1.0 - drop)
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


def replacement(ratings: list[float]) -> tuple[int, int, int] | None:
    """(loser, best, second) of a population by rating (first on ties); None below 2 members"""
    if len(ratings) < 2:
        return None
    order = sorted(range(len(ratings)), key=lambda i: (-ratings[i], i))
    return order[-1], order[0], order[1]


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
        meter = rloo.Meter()
        t_round = time.perf_counter()
        # 1. matchmaking: each teacher draws a student, favouring even matches
        pairs = match(state["teacher_ratings"], state["student_ratings"],
                      random.Random(launch.seed_of(cfg.seed, rnd, "match")))
        # 2. every teacher writes its problems (one engine call); the format filter and the
        # verifier say which are valid
        for policy in unique(run.teachers + run.students):
            with meter.timed("sync"):
                rloo.sync_weights(policy, run.llm)
        proposals = propose(cfg, run, rnd, meter)
        # 3. the matched students solve them (one engine call) and learn from the valid ones
        solves = solve_and_learn(cfg, run, rnd, pairs, proposals, meter)
        # 4. each teacher learns from its student's failure rate on its valid problems
        teacher_stats = teach(cfg, run, proposals, solves, meter)
        # 5. ratings: a match's score is the student's solve rate (1 where nothing was valid)
        scores = [sum(s) / len(s) if s else 1.0 for s in valid_solves(solves)]
        for i, j in enumerate(pairs):
            state["teacher_ratings"][i], state["student_ratings"][j] = elo_update(
                state["teacher_ratings"][i], state["student_ratings"][j], scores[i])
        # 6. evolution: the lowest-rated member of each population is replaced
        evolved = evolve(cfg, run, rnd) if cfg.evolve_every and \
            (rnd + 1) % cfg.evolve_every == 0 else {}
        state["round"] = rnd + 1
        row = dict(round=rnd, pairs=pairs, scores=scores,
                   valid=[sum(v is not None for _, v in p) / len(p) for p in proposals],
                   teacher_ratings=[round(r, 2) for r in state["teacher_ratings"]],
                   student_ratings=[round(r, 2) for r in state["student_ratings"]],
                   teacher_loss=[s["loss"] for s in teacher_stats], evolved=evolved,
                   **{k: round(v, 3) for k, v in meter.seconds.items()},
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


def unique(policies: list) -> list:
    """each policy once (--single_agent: the teacher is the student)"""
    return list({id(p): p for p in policies}.values())


def propose(cfg: Config, run, rnd: int, meter: rloo.Meter) -> list[list]:
    """Step 2: per teacher, its `proposals` samples of the teacher prompt, each with its
    (question, answer) if valid, else None. Valid: past the format filter (METHOD.md "Format
    filter") and the verifier: on the built-in world its own checker (well-posed, the answer
    right); with --model, checked after solving (valid_solves)."""
    prompt = data.teacher_prompt(run.tok)
    n = cfg.proposals
    with meter.timed("teacher_generation"):
        outs = rloo.generate(run.llm, [prompt] * (n * len(run.teachers)), n=1,
                             temperature=cfg.temperature, max_tokens=cfg.teacher_max_tokens,
                             seed=launch.seed_of(cfg.seed, rnd, "teachers"), group=dist.group.WORLD,
                             adapters=[t.served for t in run.teachers for _ in range(n)],
                             meter=meter)
        samples = [o[0] for o in outs]
        pairs = rloo.split_map(data.parse_teacher_batch, [s.text for s in samples],
                               dist.group.WORLD)
    if run.checker is not None:
        pairs = [p if p is not None and run.checker(*p)["correct"] else None for p in pairs]
    return [list(zip(samples[i * n:(i + 1) * n], pairs[i * n:(i + 1) * n]))
            for i in range(len(run.teachers))]


def solve_and_learn(cfg: Config, run, rnd: int, pairs: list[int], proposals: list[list],
                    meter: rloo.Meter) -> list[list[float]]:
    """Step 3: each student samples student_samples solutions of every valid problem of the
    teachers matched with it, all students in one engine call; then one RLOO update each on the
    problems that stay valid (METHOD.md "Inner loop": the student's reward and advantages).
    Returns per teacher the solve rate of each of its valid problems, in order."""
    k = cfg.student_samples
    work = []   # (teacher, question, answer) of every valid problem
    for i, p in enumerate(proposals):
        work += [(i, *v) for _, v in p if v is not None]
    policies = [run.students[pairs[i]] for i, _, _ in work]
    with meter.timed("student_rollouts"):
        outs = rloo.generate(run.llm, [data.student_prompt(q) for _, q, _ in work], n=k,
                             temperature=cfg.temperature, max_tokens=cfg.student_max_tokens,
                             seed=launch.seed_of(cfg.seed, rnd, "students"), group=dist.group.WORLD,
                             adapters=[p.served for p in policies] if work else None, meter=meter)
        flat = [(s, a) for o, (_, _, a) in zip(outs, work) for s in o]
        rewards = rloo.split_map(lambda share: data.grade([s.text for s, _ in share],
                                                          [a for _, a in share]),
                                 flat, dist.group.WORLD)
    table = torch.tensor(rewards, dtype=torch.float64).view(len(work), k)
    rates = (table == data.R_CORRECT).double().mean(1).tolist()
    # with --model the verifier is agreement: a problem stays valid if a solution reaches its answer
    keep = [run.checker is not None or r > 0 for r in rates]
    adv = rloo.rloo_advantages(table)
    with meter.timed("student_training"):
        for policy in unique(run.students):
            rows = [(s, adv[w, c].item()) for w, o in enumerate(outs) for c, s in enumerate(o)
                    if policies[w] is policy and keep[w]]
            if rows:   # (the same on every rank) a student without a valid problem sits out
                train(cfg, policy, rloo.my_share(rows), meter)
    solves = [[] for _ in proposals]
    for (i, _, _), rate, ok in zip(work, rates, keep):
        solves[i].append(rate if ok else None)
    return solves


def valid_solves(solves: list[list]) -> list[list[float]]:
    """per teacher, the solve rates of its problems that passed every check"""
    return [[r for r in rates if r is not None] for rates in solves]


def teach(cfg: Config, run, proposals: list[list], solves: list[list], meter: rloo.Meter):
    """Step 4: one RLOO update per teacher over its proposals: reward 1 - solve rate of a valid
    problem (zero-sum with its student), 0 for one that failed a check (METHOD.md "PopuLoRA")."""
    stats = []
    with meter.timed("teacher_update"):
        for i, teacher in enumerate(run.teachers):
            rates = iter(solves[i])
            rewards = []
            for _, v in proposals[i]:
                rate = next(rates) if v is not None else None
                rewards.append(0.0 if rate is None else 1.0 - rate)
            adv = rloo.rloo_advantages(torch.tensor(rewards, dtype=torch.float64)).tolist()
            rows = rloo.my_share([(s, a) for (s, _), a in zip(proposals[i], adv)])
            stats.append(train(cfg, teacher, rows, meter))
    return stats


def train(cfg: Config, policy: rloo.Policy, rows: list, meter: rloo.Meter) -> dict:
    """one rloo.train_step on this rank's (Sample, advantage) rows"""
    return rloo.train_step(policy, [s.prompt_token_ids for s, _ in rows],
                           [s.token_ids for s, _ in rows], [a for _, a in rows],
                           loss=rloo.rloo_loss, temperature=cfg.temperature,
                           micro_batch_tokens=cfg.micro_batch_tokens, meter=meter)


def evolve(cfg: Config, run, rnd: int) -> dict:
    """Step 6: in each population of 2 or more, the lowest-rated member becomes a mutated
    crossover of the two best (--crossover, --mutation), rated at their mean, with a fresh
    optimizer. Returns {population: [loser, best, second]}."""
    done = {}
    for name, members, ratings in (("teachers", run.teachers, run.state["teacher_ratings"]),
                                   ("students", run.students, run.state["student_ratings"])):
        chosen = replacement(ratings)
        if chosen is None:   # (--single_agent: populations of 1)
            continue
        loser, best, second = chosen
        parents = [rloo.snapshot(members[best]), rloo.snapshot(members[second])]
        seed = launch.seed_of(cfg.seed, rnd, name, "crossover")
        if cfg.crossover == "dare":
            child = crossover_dare(*parents, cfg.dare_drop, seed)
        else:
            child = crossover_layers(*parents, seed)
        seed = launch.seed_of(cfg.seed, rnd, name, "mutation")
        if cfg.mutation == "svd":
            child = mutate_svd(child, cfg.mutation_sigma, seed)
        else:
            child = mutate_gaussian(child, cfg.mutation_sigma, seed)
        rloo.broadcast_snapshot(child, 0, dist.group.WORLD)   # one child, whatever LAPACK does
        rloo.restore(members[loser], child)
        lr = cfg.teacher_lr if name == "teachers" else cfg.student_lr
        rloo.reset_optimizer(members[loser], lr=lr, warmup_steps=0, total_steps=None)
        ratings[loser] = (ratings[best] + ratings[second]) / 2
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
    state = state or dict(round=0, teacher_ratings=[ELO_START] * cfg.teachers,
                          student_ratings=[ELO_START] * cfg.students)
    launch.restore_rows(cfg.out, ckpt, OUTPUTS)
    # the students' questions are teacher samples: at most teacher_max_tokens long
    seq_len = data.engine_len(tok, [], cfg.student_max_tokens, cfg.teacher_max_tokens)
    llm = rloo.build_engine(cfg.model, seed=cfg.seed, max_model_len=seq_len, verbose=cfg.verbose,
                            gpu_memory_utilization=cfg.gpu_memory_utilization,
                            lora_rank=cfg.lora_rank, max_loras=cfg.teachers + cfg.students)
    mesh = init_device_mesh(device.type, (world_size,))
    opts = dict(warmup_steps=0, total_steps=None, lora_rank=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha, kl_coef=cfg.kl_coef, prompts=cfg.prompt_pass,
                activation_checkpointing=cfg.activation_checkpointing)
    first = rloo.load_policy(cfg.model, mesh, lr=cfg.teacher_lr, **opts,
                             seed=launch.seed_of(cfg.seed, "adapter", "teacher", 0))
    teachers = [first] + [rloo.load_policy(cfg.model, mesh, lr=cfg.teacher_lr, base=first.model,
                                           seed=launch.seed_of(cfg.seed, "adapter", "teacher", i),
                                           **opts) for i in range(1, cfg.teachers)]
    students = teachers if cfg.single_agent else [
        rloo.load_policy(cfg.model, mesh, lr=cfg.student_lr, base=first.model,
                         seed=launch.seed_of(cfg.seed, "adapter", "student", j), **opts)
        for j in range(cfg.students)]
    if ckpt:
        for name, policy in members(teachers, students).items():
            rloo.load_state(policy, os.path.join(ckpt, name))
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
        rloo.save_hf(policy, os.path.join(cfg.out, folder), run.tok, run.state["round"], tag)


if __name__ == "__main__":
    launch.main("populora.py", lambda: main(parse_args()))
