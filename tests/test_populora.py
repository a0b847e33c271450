"""
PopuLoRA (populora.py): its ratings, matchmaking and evolution operators as pure functions on
hand-built inputs, and whole runs on the real engines (2 ranks under torchrun, the small world):
a run killed after a round and resumed equals an uninterrupted one; the single-agent baseline.
"""
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import populora as pl  # noqa: E402
from soar_runs import ROOT, kill_all, rows, torchrun, wait_for  # noqa: E402

# 2 teachers, 2 students, 3 rounds, evolution after round 2
FLAGS = ["--world", "small", "--teachers", "2", "--students", "2", "--rounds", "3",
         "--proposals", "4", "--student_samples", "4", "--evolve_every", "2"]
TIMING = {"sync", "teacher_generation", "student_rollouts", "student_training", "teacher_update",
          "total"}


# ---- ratings and matchmaking ----
def test_elo_is_zero_sum_and_moves_by_surprise():
    assert pl.expected(1000, 1000) == 0.5
    assert pl.expected(1200, 1000) + pl.expected(1000, 1200) == pytest.approx(1.0)
    t, s = pl.elo_update(1000.0, 1000.0, 1.0)         # the student solved everything
    assert s == pytest.approx(1000 + pl.ELO_K / 2) and t + s == pytest.approx(2000)
    t, s = pl.elo_update(1000.0, 1000.0, 0.5)         # as expected: nothing moves
    assert (t, s) == (1000.0, 1000.0)
    t, s = pl.elo_update(1400.0, 1000.0, 0.5)         # a weak student matching a strong teacher
    assert s > 1000.0 and t < 1400.0


def test_matchmaking_favours_even_matches():
    weights = pl.pfsp_weights(1000.0, [1000.0, 1300.0, 700.0, 1600.0])
    assert weights[0] == max(weights) == 0.25 and weights[3] == min(weights)
    assert weights[1] == pytest.approx(weights[2])   # as far above as below
    picks = [pl.match([1000.0], [1000.0, 1600.0], random.Random(i))[0] for i in range(400)]
    assert picks.count(0) > 3 * picks.count(1) > 0   # mostly the level student, not only it
    assert pl.match([1000.0, 1300.0], [900.0, 1300.0], random.Random(5)) == \
        pl.match([1000.0, 1300.0], [900.0, 1300.0], random.Random(5))   # seeded


def test_the_lowest_rated_is_replaced_by_the_two_best():
    assert pl.replacement([1000.0, 1100.0, 950.0, 1050.0]) == (2, 1, 3)
    assert pl.replacement([1000.0, 1000.0]) == (1, 0, 1)   # ties: the first ranks higher
    assert pl.replacement([1000.0]) is None


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


def test_dare_merge_keeps_rank_is_seeded_and_the_mean_in_expectation():
    a, b = adapter(0), adapter(1)
    m1, m3 = seeded_outputs(lambda seed: pl.crossover_dare(a, b, 0.5, seed), a)
    t = "model.layers.3.mlp.up_proj.lora_B"
    assert not torch.equal(m1[t], m3[t])
    # each entry is a (dropped) or b (kept, 0.5 / (1 - 0.5) of the difference): about half each
    from_b = torch.isclose(m1[t], b[t])
    assert torch.isclose(m1[t], a[t])[~from_b].all() and 0.3 < from_b.double().mean() < 0.7
    mean = sum(pl.crossover_dare(a, b, 0.7, seed)[t] for seed in range(2000)) / 2000
    assert torch.allclose(mean, (a[t] + b[t]) / 2, atol=0.2)   # expectation: the parents' mean
    same = pl.crossover_dare(a, a, 0.5, seed=7)
    assert all(torch.equal(same[n], a[n]) for n in a)   # equal parents: the parent


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
    resumed; and the single-agent baseline"""
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
    return d, resumed.stdout


def test_a_resumed_population_run_equals_an_uninterrupted_one(runs):
    d, log = runs
    assert "resuming at round" in log
    whole = rows(d / "whole" / "metrics.jsonl")
    assert without_timing(rows(d / "killed" / "metrics.jsonl")) == without_timing(whole)
    assert rows(d / "killed" / "questions.jsonl") == rows(d / "whole" / "questions.jsonl")
    assert [r["round"] for r in whole] == [0, 1, 2]
    assert set(whole[1]["evolved"]) == {"teachers", "students"}   # after round 2 of 3


def test_outputs_are_adapters_on_one_base(runs):
    d, _ = runs
    out = d / "whole"
    assert sorted(os.listdir(out / "ckpt" / "step-3")) == ["rows", "s0", "s1", "state.json",
                                                           "t0", "t1"]
    for kind, name in (("teachers", "t0"), ("teachers", "t1"), ("students", "s0"),
                       ("students", "s1")):
        folder = out / kind / name
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
        assert json.loads((folder / "populora.json").read_text()) == {"round": 3}
    first = rows(out / "metrics.jsonl")[0]   # before any evolution, matches are zero-sum
    assert sum(first["teacher_ratings"]) + sum(first["student_ratings"]) == \
        pytest.approx(4 * pl.ELO_START, abs=0.05)
    for q in rows(out / "questions.jsonl"):   # the world's checker passed every problem kept
        assert pl.world.describe(q["question"], q["answer"])["correct"]


def test_the_single_agent_baseline_is_one_adapter(runs):
    d, _ = runs
    out = d / "single"
    assert sorted(os.listdir(out / "ckpt" / "step-3")) == ["rows", "state.json", "t0"]
    assert (out / "students" / "s0" / "adapter_config.json").exists()   # for eval.py's row
    assert all(r["pairs"] == [0] and r["evolved"] == {} for r in rows(out / "metrics.jsonl"))


def test_the_default_population_is_four_and_four():
    """the world preset sets the world's sampling and LoRA settings, never the population"""
    cfg = pl.parse_args([])
    assert (cfg.teachers, cfg.students) == (4, 4)
    assert (cfg.lora_rank, cfg.student_lr, cfg.teacher_lr) == (8, 3e-3, 3e-4)


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
    """--crossover dare --mutation svd in a real run: the lowest-rated student is replaced by the
    mutated merge of the two best, as the pure functions compute it from their weights"""
    p = torchrun("populora.py", tmp_path / "evolve", *FLAGS[:4], "--students", "3", "--rounds",
                 "1", *FLAGS[8:12], "--evolve_every", "1", "--crossover", "dare", "--mutation",
                 "svd", "--mutation_sigma", "0.5")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    loser, best, second = rows(tmp_path / "evolve" / "metrics.jsonl")[0]["evolved"]["students"]

    def adapter_of(j):   # a saved PEFT folder's tensors by the adapter's own names
        folder = tmp_path / "evolve" / "students" / f"s{j}"
        tensors = load_file(folder / "adapter_model.safetensors")
        return {n.removeprefix("base_model.model.").removesuffix(".weight"): t
                for n, t in tensors.items()}

    seed = pl.launch.seed_of(0, 0, "students", "crossover")
    child = pl.crossover_dare(adapter_of(best), adapter_of(second), 0.5, seed)
    child = pl.mutate_svd(child, 0.5, pl.launch.seed_of(0, 0, "students", "mutation"))
    saved = adapter_of(loser)
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
