"""
PopuLoRA (populora.py): its ratings, matchmaking and evolution operators as pure functions on
hand-built inputs, and whole runs on the real engines (2 ranks under torchrun, the small world):
a run killed after a round and resumed equals an uninterrupted one; the single-agent baseline.
"""
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import data  # noqa: E402
import populora as pl  # noqa: E402
from soar_runs import ROOT, kill_all, rows, torchrun, wait_for  # noqa: E402

# 2 teachers, 2 students, 4 rounds, evolution every 2: before round 2 (of 0-3), not after round 3
FLAGS = ["--world", "small", "--teachers", "2", "--students", "2", "--rounds", "4",
         "--proposals", "4", "--student_samples", "4", "--evolve_every", "2"]
ROUNDS = 4
TIMING = {"sync", "teacher_generation", "student_rollouts", "student_training", "teacher_update",
          "total"}


# ---- ratings and matchmaking ----
NEWCOMER = [pl.MU0, pl.SIGMA0]


def test_trueskill_moves_by_surprise_and_shrinks_the_players_sigma():
    """a win raises the winner's mu and lowers the loser's, by sigma^2 each (the means' total is
    kept only at equal sigmas); both sigmas shrink; an upset moves more; a draw between equals
    moves no mu"""
    win, loss = pl.trueskill_update(NEWCOMER, NEWCOMER)
    assert win[0] > pl.MU0 > loss[0] and win[0] + loss[0] == pytest.approx(2 * pl.MU0)
    assert win[1] == pytest.approx(loss[1]) and win[1] < pl.SIGMA0
    known = [pl.MU0, 2.0]   # a member of small sigma moves less than the newcomer it beats
    win, loss = pl.trueskill_update(known, NEWCOMER)
    assert 0 < win[0] - pl.MU0 < pl.MU0 - loss[0]
    assert win[0] + loss[0] < 2 * pl.MU0          # unequal sigmas: the total is not kept
    upset = pl.trueskill_update([20.0, 3.0], [30.0, 3.0])[0][0] - 20.0
    expected = pl.trueskill_update([30.0, 3.0], [20.0, 3.0])[0][0] - 30.0
    assert upset > 5 * expected > 0
    a, b = pl.trueskill_update(NEWCOMER, NEWCOMER, draw=True)
    assert a[0] == pytest.approx(pl.MU0) and b[0] == pytest.approx(pl.MU0) and a[1] < pl.SIGMA0
    a, b = pl.trueskill_update([30.0, 3.0], [20.0, 3.0], draw=True)
    assert a[0] < 30.0 and b[0] > 20.0            # a draw pulls the two together


# (winner, loser, draw, winner after, loser after) from the trueskill package 0.4.5 (not a
# dependency: its numbers), TrueSkill(mu=25, sigma=25/3, beta=25/6, tau=0, draw_probability=0.1)
# .rate_1vs1: tau 0 because populora applies the dynamics once a round (grow_sigma), not per match
TRUESKILL_PACKAGE = [
    ((25.0, 25 / 3), (25.0, 25 / 3), False, (29.3955759778, 7.1711412448),
     (20.6044240222, 7.1711412448)),
    ((30.0, 3.0), (20.0, 3.0), False, (30.2439589195, 2.9248706683), (19.7560410805, 2.9248706683)),
    ((20.0, 3.0), (30.0, 3.0), False, (22.3810796697, 2.7741807778), (27.6189203303, 2.7741807778)),
    ((25.0, 25 / 3), (25.0, 25 / 3), True, (25.0, 6.4572399608), (25.0, 6.4572399608)),
    ((30.0, 3.0), (20.0, 3.0), True, (28.2988418559, 2.7329369244), (21.7011581441, 2.7329369244)),
    ((28.0, 2.0), (22.0, 6.0), False, (28.2105686899, 1.9739237449), (20.1048817907, 5.2541765289)),
    ((10.0, 1.0), (40.0, 1.0), False, (10.8674968292, 0.9867308630), (39.1325031708, 0.9867308630)),
]


@pytest.mark.parametrize("winner, loser, draw, want_winner, want_loser", TRUESKILL_PACKAGE)
def test_trueskill_equals_the_package(winner, loser, draw, want_winner, want_loser):
    """golden values: a win, an upset, draws, unequal sigmas (the package's normal cdf is an
    approximation: within 1e-5)"""
    got_winner, got_loser = pl.trueskill_update(list(winner), list(loser), draw=draw)
    assert got_winner == pytest.approx(list(want_winner), abs=1e-5)
    assert got_loser == pytest.approx(list(want_loser), abs=1e-5)


def test_a_match_result_follows_the_solve_rate():
    assert [pl.outcome(s) for s in (1.0, 0.6, 0.5, 0.4, 0.0)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    t, s = pl.rate_match(NEWCOMER, NEWCOMER, 1.0)   # the student won
    assert s[0] > pl.MU0 > t[0]
    t, s = pl.rate_match(NEWCOMER, NEWCOMER, 0.0)
    assert t[0] > pl.MU0 > s[0]
    # --model's agreement rule: a match with formatted problems none of which a sample agreed
    # with (solves' None) is a draw, not a student win
    assert pl.match_results([[None, None], [0.5, 1.0], []], [1.0, 0.75, 1.0]) == [0.5, 1.0, 1.0]


def test_sigma_grows_for_every_member_each_round_up_to_a_newcomers():
    """TrueSkill's dynamics: sigma^2 + TAU^2 a round, played or not, capped at SIGMA0"""
    grown = pl.grow_sigma([30.0, 2.0])
    assert grown == [30.0, pytest.approx(math.sqrt(4.0 + pl.TAU ** 2))]
    rating = [30.0, 2.0]
    for _ in range(100000):
        rating = pl.grow_sigma(rating)
    assert rating == [30.0, pl.SIGMA0]
    assert pl.grow_sigma(NEWCOMER) == NEWCOMER


def test_matchmaking_favours_even_matches_and_the_uncertain():
    teacher = [25.0, 2.0]
    weights = pl.pfsp_weights(teacher, [[25.0, 2.0], [35.0, 2.0], [15.0, 2.0], [45.0, 2.0]])
    assert weights[0] == max(weights) == pytest.approx(0.25) and weights[3] == min(weights)
    assert weights[1] == pytest.approx(weights[2])   # as far above as below
    sure, unsure = pl.pfsp_weights(teacher, [[35.0, 1.0], [35.0, pl.SIGMA0]])
    assert unsure > sure                             # a stale member's p is nearer 1/2
    picks = [pl.match([teacher, teacher], [[25.0, 2.0], [45.0, 2.0], [25.0, 2.0]],
                      random.Random(i)) for i in range(400)]
    drawn = [j for p in picks for j in p]
    assert drawn.count(0) > 3 * drawn.count(1) > 0   # mostly the level students, not only them
    students = [[25.0, 2.0], [24.0, 3.0], [26.0, 1.0]]
    assert pl.match([teacher] * 2, students, random.Random(5)) == \
        pl.match([teacher] * 2, students, random.Random(5))   # seeded


@pytest.mark.parametrize("teachers, students", [(4, 4), (3, 3), (6, 4), (2, 5)])
def test_every_student_plays_each_round_when_it_can(teachers, students):
    """equal populations: a permutation; more teachers: every student at least once and at most
    once more than any other; fewer: no student twice"""
    rng = random.Random(0)
    for _ in range(200):
        ratings = [[rng.gauss(25, 5), rng.uniform(0.5, pl.SIGMA0)] for _ in range(teachers)]
        pool = [[rng.gauss(25, 5), rng.uniform(0.5, pl.SIGMA0)] for _ in range(students)]
        counts = [0] * students
        for j in pl.match(ratings, pool, rng):
            counts[j] += 1
        assert max(counts) - min(counts) <= 1 and sum(counts) == teachers


@pytest.mark.parametrize("teachers, students", [(2, 5), (4, 4), (6, 3)])
def test_a_newcomer_plays_its_first_round_against_a_teacher_with_a_problem(teachers, students):
    """evolution's child is drawn first, by a teacher that can teach it; the rest as before (a
    permutation for equal populations)"""
    rng = random.Random(1)
    for _ in range(200):
        ratings = [[rng.gauss(25, 5), rng.uniform(0.5, pl.SIGMA0)] for _ in range(teachers)]
        pool = [[rng.gauss(25, 5), 0.5] for _ in range(students)]
        newcomer = rng.randrange(students)
        pool[newcomer] = [pl.MU0, pl.SIGMA0]
        can_teach = [rng.random() < 0.5 for _ in range(teachers)]
        can_teach[rng.randrange(teachers)] = True
        pairs = pl.match(ratings, pool, rng, newcomers=(newcomer,), can_teach=can_teach)
        assert any(j == newcomer and can_teach[i] for i, j in enumerate(pairs))
        counts = [pairs.count(j) for j in range(students)]
        assert max(counts) - min(counts) <= 1 and sum(counts) == teachers


def test_a_newcomer_has_no_priority_once_drawn():
    """4 teachers, 3 equally rated students, one of them new: it is drawn first, and once the pool
    refills for the fourth teacher, PFSP draws among all three (so about a third of the time it is
    the newcomer), not the newcomer again"""
    twice = 0
    for seed in range(200):
        rng = random.Random(seed)
        ratings = [[rng.gauss(25, 5), rng.uniform(0.5, pl.SIGMA0)] for _ in range(4)]
        pool = [[pl.MU0, pl.SIGMA0] for _ in range(3)]
        pairs = pl.match(ratings, pool, rng, newcomers=(1,), can_teach=[True] * 4)
        assert pairs.count(1) >= 1
        twice += pairs.count(1) == 2
    assert 30 <= twice <= 110, twice


def test_the_lowest_mu_is_replaced_by_the_two_best_of_the_others():
    assert pl.replacement([25.0, 27.0, 22.0, 26.0]) == (2, 1, 3)
    assert pl.replacement([25.0, 26.0, 24.0]) == (2, 1, 0)       # 3: three distinct members
    assert pl.replacement([25.0, 25.0, 25.0]) == (2, 0, 1)       # ties: the first ranks higher
    assert pl.replacement([24.0, 25.0]) == (0, 1, None)         # 2: the best alone, never the loser
    assert pl.replacement([25.0, 25.0]) == (1, 0, None)
    assert pl.replacement([25.0]) is None


def test_the_proposer_reward_is_absolute_zeros_code():
    """azr (the default): as Absolute Zero's code (rewards/reward_managers.py) gives it: -1 for a
    failed check, formatted or not; -0.5 for a valid problem solved at s = 0 or 1 (its solver
    accuracy reward 1 - s, or 0 for s = 0, is 0); else 1 - s. azr-paper (its paper's formulas, this
    project's default before): 0 for s = 0 or 1, -0.5 formatted but invalid, -1 malformed;
    failure: azr-paper with 1 - s for s = 0 too. Without format penalties, 0 for every negative."""
    azr = pl.parse_args([])
    paper = pl.parse_args(["--proposer_reward", "azr-paper"])
    failure = pl.parse_args(["--proposer_reward", "failure"])
    plain = pl.parse_args(["--no-format_penalties"])
    assert [pl.proposer_reward(azr, s) for s in (0.0, 0.25, 1.0)] == [-0.5, 0.75, -0.5]
    assert [pl.proposer_reward(azr, None, formatted) for formatted in (True, False)] == \
        [-1.0, -1.0]
    assert [pl.proposer_reward(paper, s) for s in (0.0, 0.25, 1.0)] == [0.0, 0.75, 0.0]
    assert [pl.proposer_reward(paper, None, formatted) for formatted in (True, False)] == \
        [-0.5, -1.0]
    assert [pl.proposer_reward(failure, s) for s in (0.0, 0.25, 1.0)] == [1.0, 0.75, 0.0]
    assert [pl.proposer_reward(plain, s) for s in (0.0, 0.25, 1.0, None)] == [0.0, 0.75, 0.0, 0.0]


def test_the_solver_reward_has_absolute_zeros_format_penalties():
    """correct 1, a wrong boxed answer -0.5 (contains the gold or not), no boxed answer -1"""
    rewards = torch.tensor([[data.R_CORRECT, data.R_CONTAINS], [data.R_BOXED, data.R_NONE]],
                           dtype=torch.float64)
    assert pl.solver_reward(rewards).tolist() == [[1.0, -0.5], [-0.5, -1.0]]


def test_the_single_agent_alternates_its_one_update():
    single = pl.parse_args(["--single_agent", "--teachers", "1", "--students", "1"])
    assert [pl.trained_roles(single, r) for r in range(4)] == [{"students"}, {"teachers"}] * 2
    assert pl.trained_roles(pl.parse_args([]), 3) == {"teachers", "students"}
    joint = pl.parse_args(["--single_agent", "--teachers", "1", "--students", "1",
                           "--single_agent_update", "joint"])
    assert [pl.trained_roles(joint, r) for r in range(2)] == [{"teachers", "students"}] * 2


# ---- evolution operators ----
def adapter(seed, layers=6, rank=4):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        out[f"model.layers.{i}.mlp.up_proj.lora_A"] = torch.randn(rank, 8, generator=g)
        out[f"model.layers.{i}.mlp.up_proj.lora_B"] = torch.randn(16, rank, generator=g)
    return out


def layer_from(child, parent, layer):
    return all(torch.equal(child[f"{layer}.lora_{m}"], parent[f"{layer}.lora_{m}"]) for m in "AB")


def seeded_outputs(operator, a):
    """operator(seed) for seeds 1, 1 and 2: a's shapes (the rank kept), finite, equal for equal
    seeds; the outputs of seeds 1 and 2"""
    m1, m2, m3 = (operator(seed) for seed in (1, 1, 2))
    assert all(m1[n].shape == a[n].shape and torch.isfinite(m1[n]).all() for n in a)
    assert all(torch.equal(m1[n], m2[n]) for n in a)
    return m1, m3


def test_crossover_keeps_rank_and_takes_each_layer_whole():
    a, b = adapter(0), adapter(1)
    child = pl.crossover_layers(a, b, seed=3)
    assert {n: t.shape for n, t in child.items()} == {n: t.shape for n, t in a.items()}
    sources = set()
    for i in range(6):
        layer = f"model.layers.{i}.mlp.up_proj"
        from_a = layer_from(child, a, layer)
        assert from_a or layer_from(child, b, layer)   # A and B of a layer from one parent
        sources.add(from_a)
    assert sources == {True, False}        # both parents contribute (6 fair coins, seed 3)
    assert all(torch.equal(child[n], pl.crossover_layers(a, b, seed=3)[n]) for n in a)
    same = pl.crossover_layers(a, a, seed=7)
    assert all(torch.equal(same[n], a[n]) for n in a)   # equal parents: the parent


def test_mutation_keeps_rank_is_finite_and_seeded():
    a = adapter(0)
    a["model.layers.0.mlp.up_proj.lora_B"] = torch.zeros(16, 4)   # a fresh B
    m1, m3 = seeded_outputs(lambda seed: pl.mutate_gaussian(a, 0.1, seed), a)
    assert not torch.equal(m1["model.layers.1.mlp.up_proj.lora_A"],
                           m3["model.layers.1.mlp.up_proj.lora_A"])
    assert torch.equal(m1["model.layers.0.mlp.up_proj.lora_B"], torch.zeros(16, 4))
    t = "model.layers.2.mlp.up_proj.lora_A"
    assert 0 < ((m1[t] - a[t]).pow(2).mean() / a[t].pow(2).mean()).sqrt() < 0.2   # ~sigma of RMS


def update(adapter, layer):
    return adapter[layer + ".lora_B"].double() @ adapter[layer + ".lora_A"].double()


def test_uniform_crossover_merges_the_parents_updates_and_refactors_them_to_the_rank():
    """per layer, on B A: the child's update is the best rank-r approximation of the parents'
    updates merged entry by entry (dropped: a's; kept: a's + (b's - a's) / (2 (1 - p)), so the
    parents' mean update in expectation); equal parents give the parent's update; a fresh layer
    stays zero with a trainable A"""
    a, b = adapter(0), adapter(1)
    a["model.layers.0.mlp.up_proj.lora_B"] = torch.zeros(16, 4)   # fresh in both parents
    b["model.layers.0.mlp.up_proj.lora_B"] = torch.zeros(16, 4)
    m1, m3 = seeded_outputs(lambda seed: pl.crossover_uniform(a, b, 0.5, seed), a)
    layer = "model.layers.3.mlp.up_proj"
    assert not torch.equal(update(m1, layer), update(m3, layer))
    # the merge, rebuilt: each entry of the update is a's (dropped) or the mean's rescale (kept)
    g = torch.Generator().manual_seed(1)
    kept = {}
    for i in range(6):
        name = f"model.layers.{i}.mlp.up_proj"
        kept[name] = torch.rand(16, 8, generator=g) >= 0.5
    ua, ub = update(a, layer), update(b, layer)
    merged = ua + (ub - ua) * kept[layer] / (2 * 0.5)
    u, s, vh = torch.linalg.svd(merged)
    best = u[:, :4] @ torch.diag(s[:4]) @ vh[:4]   # Eckart-Young: the closest rank-4 update
    assert torch.allclose(update(m1, layer), best, atol=1e-5)
    assert torch.linalg.matrix_rank(update(m1, layer)) == 4
    assert torch.allclose(m1[layer + ".lora_A"] @ m1[layer + ".lora_A"].T, torch.eye(4),
                          atol=1e-5)   # orthonormal rows
    # not the per-tensor merge of A and B, whose update holds the cross terms B_a A_b
    tensors = (a[layer + ".lora_B"] + b[layer + ".lora_B"]) @ (a[layer + ".lora_A"] +
                                                              b[layer + ".lora_A"]) / 4
    assert not torch.allclose(update(m1, layer), tensors.double(), atol=1e-2)
    fresh = "model.layers.0.mlp.up_proj"
    assert torch.equal(m1[fresh + ".lora_B"], torch.zeros(16, 4))
    assert m1[fresh + ".lora_A"].abs().sum() > 0   # B's gradient is g A^T: a zero A would stick
    same = pl.crossover_uniform(a, a, 0.5, seed=7)
    assert all(torch.allclose(update(same, f"model.layers.{i}.mlp.up_proj"),
                              update(a, f"model.layers.{i}.mlp.up_proj"), atol=1e-5)
               for i in range(6))   # equal parents: the parent's update


def test_dare_drops_and_rescales_each_parents_update_then_averages():
    """DARE: each parent's update keeps each entry with probability 1 - p, rescaled by 1 / (1 - p),
    by a mask of its own; the child's update is the closest rank-r one to their mean. At p = 0 the
    parents' mean update; equal parents are masked apart, so the child is not the parent."""
    a, b = adapter(0), adapter(1)
    layer = "model.layers.3.mlp.up_proj"
    ua, ub = update(a, layer), update(b, layer)
    # the merge, rebuilt: two masks per layer, in layer order, from the seed's generator
    g = torch.Generator().manual_seed(1)
    masks = {f"model.layers.{i}.mlp.up_proj": [torch.rand(16, 8, generator=g) >= 0.5
                                               for _ in range(2)] for i in range(6)}
    kept_a, kept_b = masks[layer]
    merged = (ua * kept_a + ub * kept_b) / (2 * 0.5)
    u, s, vh = torch.linalg.svd(merged)
    m1, _ = seeded_outputs(lambda seed: pl.crossover_dare(a, b, 0.5, seed), a)
    assert torch.allclose(update(m1, layer), u[:, :4] @ torch.diag(s[:4]) @ vh[:4], atol=1e-5)
    assert not torch.equal(kept_a, kept_b)   # a mask each, not one shared
    u, s, vh = torch.linalg.svd((ua + ub) / 2)
    mean = u[:, :4] @ torch.diag(s[:4]) @ vh[:4]
    assert torch.allclose(update(pl.crossover_dare(a, b, 0.0, seed=3), layer), mean, atol=1e-5)
    same = pl.crossover_dare(a, a, 0.5, seed=7)
    assert not torch.allclose(update(same, layer), ua, atol=1e-3)   # unlike the uniform crossover


def test_svd_mutation_rescales_singular_values_only():
    a = adapter(0)
    a["model.layers.0.mlp.up_proj.lora_B"] = torch.zeros(16, 4)   # a fresh B
    m1, m3 = seeded_outputs(lambda seed: pl.mutate_svd(a, 0.3, seed), a)
    layer = "model.layers.2.mlp.up_proj"
    assert not torch.equal(m1[layer + ".lora_B"], m3[layer + ".lora_B"])
    assert torch.equal(m1[layer + ".lora_A"], a[layer + ".lora_A"])   # only B changes
    assert torch.equal(m1["model.layers.0.mlp.up_proj.lora_B"], torch.zeros(16, 4))
    update = a[layer + ".lora_B"] @ a[layer + ".lora_A"]
    mutated = m1[layer + ".lora_B"] @ m1[layer + ".lora_A"]
    assert torch.linalg.matrix_rank(mutated) == torch.linalg.matrix_rank(update) == 4
    u, s, vh = torch.linalg.svd(update)
    u, s, vh = u[:, :4], s[:4], vh[:4]   # its rank-4 SVD
    core = u.T @ mutated @ vh.T   # in the update's singular vectors: diagonal, s rescaled
    assert torch.allclose(core, torch.diag(core.diag()), atol=1e-4)
    assert torch.allclose(u @ core @ vh, mutated, atol=1e-4)
    assert (core.diag() > 0).all() and not torch.allclose(core.diag(), s, rtol=0.05)
    unchanged = pl.mutate_svd(a, 0.0, seed=1)
    assert all(torch.allclose(unchanged[n], a[n], atol=1e-5) for n in a)   # sigma 0: the adapter


# ---- whole runs ----
def without_timing(metrics):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in metrics]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """a population run to the end; the same run killed once its round-1 checkpoint exists, then
    resumed; and the single-agent baseline, alternating and joint"""
    d = tmp_path_factory.mktemp("populora")
    whole = torchrun("populora.py", d / "whole", *FLAGS)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    p = torchrun("populora.py", d / "killed", *FLAGS, wait=False)
    wait_for(d / "killed" / "ckpt" / "step-1", p, delay=0.3)
    kill_all(p)
    resumed = torchrun("populora.py", d / "killed", *FLAGS)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    single = torchrun("populora.py", d / "single", *FLAGS, "--single_agent", "--teachers", "1",
                      "--students", "1")
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    # round 1: rank 1's share of the update made empty (tests/skewed_populora.py)
    joint = torchrun("tests/skewed_populora.py", d / "joint", *FLAGS, "--single_agent",
                     "--teachers", "1", "--students", "1", "--single_agent_update", "joint")
    assert joint.returncode == 0, joint.stdout[-3000:] + joint.stderr[-3000:]
    return d, resumed.stdout


def test_a_resumed_population_run_equals_an_uninterrupted_one(runs):
    d, log = runs
    assert "resuming at round" in log
    whole = rows(d / "whole" / "metrics.jsonl")
    assert without_timing(rows(d / "killed" / "metrics.jsonl")) == without_timing(whole)
    assert rows(d / "killed" / "questions.jsonl") == rows(d / "whole" / "questions.jsonl")
    assert [r["round"] for r in whole] == [0, 1, 2, 3]
    assert [sorted(r["evolved"]) for r in whole] == [[], [], ["students", "teachers"], []]


def updates_since_made(out, name, rounds=ROUNDS):
    """the optimizer steps a member of the run's last checkpoint took since it was made (its
    AdamW schedule restarts when evolution replaces it)"""
    state = torch.load(out / "ckpt" / f"step-{rounds}" / name / "adapter.pt", weights_only=True)
    return state["sched"]["last_epoch"]


def test_a_child_made_before_the_last_round_trains_in_it(tmp_path):
    """fewer teachers than students, and rounds = 1 mod evolve_every: evolution comes before the
    last round, whose draw leaves a student out; the children play it all the same, the student
    against a teacher with a valid problem, and take their update. (A member that never met a
    valid problem, here s0, has nothing to train on: that no draw can change.)"""
    out = tmp_path / "late"
    p = torchrun("populora.py", out, *FLAGS[:2], "--teachers", "2", "--students", "3",
                 "--rounds", "3", *FLAGS[8:12], "--evolve_every", "2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = rows(out / "metrics.jsonl")
    last = metrics[-1]
    assert [sorted(r["evolved"]) for r in metrics] == [[], [], ["students", "teachers"]]
    child = last["evolved"]["students"][0]
    assert len(set(last["pairs"])) == 2   # one student sat out, not the child
    assert any(j == child and v > 0 for j, v in zip(last["pairs"], last["valid"]))
    assert updates_since_made(out, f"s{child}", rounds=3) == 1
    assert updates_since_made(out, f"t{last['evolved']['teachers'][0]}", rounds=3) == 1


def test_the_evaluated_population_holds_no_untrained_child(runs):
    """evolution happens before a round, never after the last: every member the run ends with
    (its PEFT folders, which eval.py reads) played since it was made, and took its one update in
    each round since (a student: each round its teacher wrote a valid problem)"""
    d, _ = runs
    out = d / "whole"
    metrics = rows(out / "metrics.jsonl")
    assert metrics[-1]["evolved"] == {}
    made = {"t": {}, "s": {}}   # member -> the round it was made in
    for r in metrics:
        for population, (loser, _, _) in r["evolved"].items():
            made[population[0]][loser] = r["round"]
    assert made["t"] and made["s"]
    for name in ("t0", "t1", "s0", "s1"):
        since = metrics[made[name[0]].get(int(name[1]), 0):]
        assert len(since) >= ROUNDS - 2
        if name[0] == "t":
            expected = len(since)
        else:   # its rounds with a valid problem from a teacher it played
            expected = sum(any(j == int(name[1]) and v > 0 for j, v in zip(r["pairs"], r["valid"]))
                           for r in since)
        assert updates_since_made(out, name) == expected
        assert json.loads((out / ("teachers" if name[0] == "t" else "students") / name /
                           "populora.json").read_text()) == {"round": ROUNDS}


def test_ratings_replay_from_the_rows_as_documented(runs):
    """the rows' ratings are TrueSkill's, replayed from the rows' matches: every sigma grows by TAU
    a round (to SIGMA0 at most), each match a win, loss or draw by its score, an evolved member a
    newcomer (MU0, SIGMA0). The means' total: 4 MU0 while every sigma is equal (round 0, all
    newcomers), and each evolution moves it by MU0 - the loser's mu."""
    d, _ = runs
    metrics = rows(d / "whole" / "metrics.jsonl")
    ratings = {"teachers": [NEWCOMER] * 2, "students": [NEWCOMER] * 2}
    for r in metrics:
        for population, (loser, _, _) in r["evolved"].items():
            ratings[population][loser] = NEWCOMER
        ratings = {k: [pl.grow_sigma(x) for x in v] for k, v in ratings.items()}
        for i, (j, score) in enumerate(zip(r["pairs"], r["scores"])):
            ratings["teachers"][i], ratings["students"][j] = pl.rate_match(
                ratings["teachers"][i], ratings["students"][j], pl.outcome(score))
        for population in ratings:
            assert r[population[:-1] + "_ratings"] == [
                [pytest.approx(x, abs=1e-3) for x in m] for m in ratings[population]]
    first = metrics[0]
    assert sorted(first["pairs"]) == [0, 1]   # equal populations: each student once
    assert sum(m[0] for m in first["teacher_ratings"] + first["student_ratings"]) == \
        pytest.approx(4 * pl.MU0, abs=2e-3)


def test_outputs_are_adapters_on_one_base(runs):
    d, _ = runs
    out = d / "whole"
    assert sorted(os.listdir(out / "ckpt" / f"step-{ROUNDS}")) == ["rows", "s0", "s1",
                                                                   "state.json", "t0", "t1"]
    for kind, name in (("teachers", "t0"), ("teachers", "t1"), ("students", "s0"),
                       ("students", "s1")):
        folder = out / kind / name
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
    for q in rows(out / "questions.jsonl"):   # the world's checker passed every problem kept
        assert pl.world.describe(q["question"], q["answer"])["correct"]


def test_the_single_agent_takes_one_update_a_round_alternating_roles(runs):
    """compute-matched per adapter (METHOD.md "PopuLoRA"): one adapter, one update a round as a
    population member takes, as a student in even rounds and a teacher in odd"""
    d, _ = runs
    out = d / "single"
    assert sorted(os.listdir(out / "ckpt" / f"step-{ROUNDS}")) == ["rows", "state.json", "t0"]
    assert (out / "students" / "s0" / "adapter_config.json").exists()   # for eval.py's row
    metrics = rows(out / "metrics.jsonl")
    assert all(r["pairs"] == [0] and r["evolved"] == {} for r in metrics)
    assert [r["trained"] for r in metrics] == [["students"], ["teachers"]] * (ROUNDS // 2)
    # one update a round (as a student only with a valid problem, as the population's students)
    assert updates_since_made(out, "t0") == sum(r["trained"] == ["teachers"] or r["valid"][0] > 0
                                                for r in metrics) >= ROUNDS // 2
    assert [r["teacher_loss"][0] is None for r in metrics] == [True, False] * (ROUNDS // 2)


def test_the_joint_single_agent_takes_one_update_a_round_on_both_roles(runs):
    """--single_agent_update joint (Absolute Zero's): every round, one update of its one adapter
    on its proposals and its solutions together; on every rank, also in a round where one rank's
    share is empty (tests/skewed_populora.py: rank 1's rows of round 1 dropped)"""
    d, _ = runs
    metrics = rows(d / "joint" / "metrics.jsonl")
    assert [r["trained"] for r in metrics] == [["students", "teachers"]] * ROUNDS
    assert updates_since_made(d / "joint", "t0") == ROUNDS
    assert all(r["teacher_loss"][0] is not None for r in metrics)
    assert metrics != rows(d / "single" / "metrics.jsonl")   # the alternating one's differ


def test_the_default_population_is_four_and_four():
    """the world preset sets the world's sampling and LoRA settings, never the population"""
    cfg = pl.parse_args([])
    assert (cfg.teachers, cfg.students) == (4, 4)
    assert (cfg.lora_rank, cfg.student_lr, cfg.teacher_lr) == (8, 3e-3, 3e-4)
    assert cfg.proposer_reward == "azr"


def test_with_a_model_a_problem_is_valid_when_a_student_agrees(runs, tmp_path):
    """--model (real math: no world checker): a problem stays valid only if one of its student's
    samples reaches the teacher's answer (METHOD.md "PopuLoRA", the agreement rule)"""
    model = pl.world.build_world(small=True)["model"]   # built by the runs fixture
    tokens = str(pl.world.MAX_TOKENS)
    # two rounds of 8 samples a problem: in one round of 4, this tiny model's students may agree on
    # none of the 8 problems (seen: 0 kept; 2 rounds of 8: 5)
    p = torchrun("populora.py", tmp_path / "agree", *FLAGS[2:], "--rounds", "2", "--model", model,
                 "--student_samples", "8", "--student_max_tokens", tokens,
                 "--teacher_max_tokens", tokens,
                 "--lora_rank", "8", "--teacher_lr", "3e-3", "--student_lr", "3e-3")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    kept = rows(tmp_path / "agree" / "questions.jsonl")
    assert kept and all(q["solve_rate"] > 0 for q in kept)


def test_evolution_runs_the_operators_its_flags_name(tmp_path):
    """--crossover dare --mutation svd in a real run of 3 students: before round 1 the lowest-rated
    is replaced by the mutated merge of the two best others, as the pure functions compute it from
    their round-0 weights (student lr 0: round 1 leaves the child as made)"""
    p = torchrun("populora.py", tmp_path / "evolve", *FLAGS[:4], "--students", "3", "--rounds",
                 "2", *FLAGS[8:12], "--evolve_every", "1", "--crossover", "dare", "--mutation",
                 "svd", "--mutation_sigma", "0.5", "--student_lr", "0")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = rows(tmp_path / "evolve" / "metrics.jsonl")
    assert metrics[0]["evolved"] == {}
    loser, best, second = metrics[1]["evolved"]["students"]
    assert len({loser, best, second}) == 3
    assert metrics[0]["student_ratings"][loser][0] == min(m[0] for m in
                                                          metrics[0]["student_ratings"])

    def adapter_at(step, j):   # a checkpoint's adapter tensors
        path = tmp_path / "evolve" / "ckpt" / f"step-{step}" / f"s{j}" / "adapter.pt"
        return torch.load(path, weights_only=True)["adapter"]

    seed = pl.rloo.seed_of(0, 1, "students", "crossover")
    child = pl.crossover_dare(adapter_at(1, best), adapter_at(1, second), 0.5, seed)
    child = pl.mutate_svd(child, 0.5, pl.rloo.seed_of(0, 1, "students", "mutation"))
    saved = adapter_at(2, loser)
    assert all(torch.allclose(saved[n], child[n], atol=1e-6) for n in child)


@pytest.mark.parametrize("flags, message", [
    (["--single_agent"], "populora.py: error: --single_agent plays one adapter in both roles"),
    (["--dare_drop", "1"], "populora.py: error: these settings cannot work:\n"
                           "  --dare_drop 1.0: the share dropped is in [0, 1)"),
])
def test_settings_that_cannot_work_are_usage_errors(tmp_path, flags, message):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "populora.py"), "--world", "small",
                        *flags, "--out", str(tmp_path / "x")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-2000:]
    assert message in p.stderr


def test_eval_rows_of_a_population_and_its_baseline(runs, tmp_path):
    """eval.py row populora: each student adapter's pass@k and their mean; populora-single; the
    report's population table (mean, best, worst student beside the single agent) and rounds"""
    d, _ = runs
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", os.path.join(ROOT, "eval.py"), "row", "populora",
                        "populora-single", "--populora", str(d / "whole"), "--populora_single",
                        str(d / "single"), "--runs", str(tmp_path), "--world", "small",
                        "--seeds", "0", "--passk_samples", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "populora" / "seed0" / "result.json").read_text())
    assert sorted(res["members"]) == ["s0", "s1"]
    for k, v in res["passk"].items():
        assert v == pytest.approx(sum(m[k] for m in res["members"].values()) / 2)
    single = json.loads((tmp_path / "populora-single" / "seed0" / "result.json").read_text())
    assert "members" not in single and set(single["passk"]) == {"pass@1", "pass@4"}
    report = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "report", "--runs",
                             str(tmp_path), "--soar", "", "--world", "small", "--populora",
                             str(d / "whole"), "--populora_single", str(d / "single")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    members = [100 * m["pass@4"] for m in res["members"].values()]
    best_worst = "{:.1f} ± 0.0 | {:.1f} ± 0.0".format(max(members), min(members))
    assert best_worst in report.stdout   # the population table's best and worst columns
    per_run = [line for line in report.stdout.splitlines() if line.startswith("| populora")]
    assert len(per_run) == 2 + 2   # a pass@k row and a rounds row for each of the two runs
    assert (tmp_path / "populations.png").stat().st_size > 0
