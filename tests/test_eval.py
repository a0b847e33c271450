"""eval.py: the statistics against brute force and known answers (no engine), the report on
hand-made run folders, and one short end-to-end evaluation with the real engine on the small
world."""
import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
import torch

import data
import eval as ev
import launch
from soar_runs import kill_all, wandb_history, wandb_records
import rloo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- pass@k ----
def brute_pass_at_k(n, c, k):
    """the fraction of k-subsets of n samples (c of them correct) holding a correct one"""
    subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert ev.pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)),
                                                          abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    for c in (0, 1, 3, 50, 127, 128):
        for k in (1, 4, 32, 128):
            exact = 1 - Fraction(math.comb(128 - c, k), math.comb(128, k))
            assert ev.pass_at_k(128, c, k) == pytest.approx(float(exact), abs=1e-12)
    assert ev.pass_at_k(32, 1, 1) == pytest.approx(1 / 32)


def test_mean_passk_over_problems():
    res = ev.mean_passk([0, 32, 1], 32)
    assert list(res) == ["pass@1", "pass@4", "pass@8", "pass@16", "pass@32"]
    assert res["pass@1"] == pytest.approx((0 + 1 + 1 / 32) / 3) and \
        res["pass@32"] == pytest.approx(2 / 3)
    assert list(ev.mean_passk([1, 2], 8)) == ["pass@1", "pass@4", "pass@8"]   # k <= n only



def test_count_correct_on_scripted_samples(monkeypatch):
    """the counting and filtering around the engine, with rloo.generate scripted: per problem, the
    samples are its script's texts in turn (what the chunking and the dedup grading must not
    change)"""
    from rloo import Sample
    problems = [{"question": "q0", "answer": "4"}, {"question": "q1", "answer": "1/2"},
                {"question": "q2", "answer": "7"}, {"question": "q3", "answer": "10"}]
    script = {"q0": ["\\boxed{4}", "no box", "\\boxed{5}", "so \\boxed{4}"],   # 2 correct
              "q1": ["\\boxed{0.5}"] * 4,                                          # 4 (equal forms)
              "q2": ["\\boxed{17}", "\\boxed{", "", "\\boxed{71}"],        # 0 (contains, truncated)
              "q3": ["\\boxed{10}", "x", "x", "x"]}                                 # 1
    calls = []

    def fake_generate(llm, prompts, *, n, temperature, max_tokens, seed, group=None,
                      adapters=None):
        calls.append((len(prompts), seed, adapters))
        qs = [p.rsplit("User: ", 1)[1].rsplit(" Assistant:", 1)[0] for p in prompts]
        return [[Sample(script[q][i], [], []) for i in range(n)] for q in qs]

    monkeypatch.setattr(rloo, "generate", fake_generate)
    def counts(**chunking):
        return rloo.count_correct(None, problems, prompt=data.student_prompt, correct=data.solved,
                                  n=4, max_tokens=8, seed=100, **chunking)

    assert counts() == [2, 4, 0, 1]
    assert counts(chunk_prompts=3) == [2, 4, 0, 1]
    # request i keeps seed + i * n across chunks
    assert calls[-2:] == [(3, 100, None), (1, 100 + 3 * 4, None)]
    # LoRA: each problem's adapter goes with it into its chunk
    assert counts(chunk_prompts=3, adapters=["a", "a", "b", "b"]) == [2, 4, 0, 1]
    assert calls[-2:] == [(3, 100, ["a", "a", "b"]), (1, 112, ["b"])]

def test_the_filters_samples_never_share_a_seed(monkeypatch):
    """cmd_filter's seeds (filter_seed) through count_correct's chunks, as cmd_filter calls it: each
    sample of each problem of each pool (here 640 and 37 problems, n = 128) has its own seed"""
    from rloo import Sample
    drawn = []

    def fake_generate(llm, prompts, *, n, seed, **kwargs):
        drawn.extend(seed + i * n + j for i in range(len(prompts)) for j in range(n))   # generate's
        return [[Sample("", [], [])] * n for _ in prompts]

    monkeypatch.setattr(rloo, "generate", fake_generate)
    cfg = ev.Config(filter_samples=128)
    sizes = [640, 37]
    chunk = max(1, 8192 // cfg.filter_samples)   # cmd_filter's
    for pool, size in enumerate(sizes):
        problems = [{"question": "q", "answer": "1"}] * size
        for lo in range(0, size, chunk):
            rloo.count_correct(None, problems[lo:lo + chunk], prompt=str, n=cfg.filter_samples,
                               correct=lambda completions, answers: [False] * len(completions),
                               max_tokens=1, seed=ev.filter_seed(cfg, sizes, pool, lo))
    assert len(drawn) == sum(sizes) * 128 == len(set(drawn))


# ---- the early-stopping rule ----
def test_early_stop_exponential_saturation():
    # r = 1 - exp(-t/100): smoothed slope at centre step t is proportional to exp(-(t-12)/100) from
    # the first full window (centre 12) on; it drops below 15% of max where t - 12 > 100 ln(1/0.15)
    r = [1 - math.exp(-t / 100) for t in range(600)]
    assert ev.early_stop(r) == 12 + math.ceil(100 * math.log(1 / 0.15))   # 202
    assert ev.early_stop([120 * x + 7 for x in r]) == 202           # scale-free (normalised slopes)


def test_early_stop_sigmoid_counts_from_the_steepest_step():
    # flat start, rise around 300, plateau: 4 s (1 - s) < 0.15 first at t = 300 + 30 ln(s/(1-s))
    s = (1 + math.sqrt(0.85)) / 2
    expected = 300 + 30 * math.log(s / (1 - s))                             # 396.1
    r = [1 / (1 + math.exp(-(t - 300) / 30)) for t in range(800)]
    assert abs(ev.early_stop(r) - expected) <= 1.5
    # noisy rewards: the MA copes with mild noise (the rule fires early when the noise in the
    # smoothed slopes, ~ sigma * sqrt(2) / 25, nears 15% of the max slope)
    noise = np.random.default_rng(0).normal(0, 0.005, 800)
    assert abs(ev.early_stop([x + e for x, e in zip(r, noise)]) - expected) <= 10


def test_early_stop_none_while_rising_or_flat():
    assert ev.early_stop([t / 100 for t in range(300)]) is None            # linear: never flattens
    assert ev.early_stop([0.0] * 300) is None                              # no signal at all
    assert ev.early_stop([1.0] * 10) is None                               # shorter than the window


def test_select_and_finished():
    cfg = ev.Config(es_window=5, es_average=20)
    rewards = [min(t, 30) / 30 for t in range(80)]           # rises linearly, flat from step 30
    stop = ev.early_stop(rewards, 5)
    assert stop == 32            # the first window wholly on the plateau: i = 30, centred 2 later
    evals = [{"step": s, "pass@1": s / 100, "pass@4": 2 * s / 100} for s in range(0, 81, 10)]
    res = ev.select(evals, rewards, cfg)
    assert res["rule"] == "early-stop" and res["window"] == [stop, stop + 20]
    used = [s for s in range(0, 81, 10) if stop <= s <= stop + 20]
    assert res["evals_used"] == used and \
        res["passk"]["pass@1"] == pytest.approx(sum(used) / len(used) / 100)
    assert not ev.finished(rewards[:40], 40, cfg) and ev.finished(rewards, stop + 20, cfg)
    assert not ev.finished(rewards, stop + 19, cfg)
    # curriculum: the rule sees the rewards after the switch only, steps keep their numbering
    shifted = [0.9] * 10 + rewards
    assert ev.select(evals, shifted, cfg, offset=10)["stop_step"] == stop + 10
    fixed = ev.select(evals, rewards, ev.Config(fixed_step=50))
    assert fixed["rule"] == "fixed" and fixed["evals_used"] == [50] and \
        fixed["passk"]["pass@4"] == 1.0
    assert ev.finished([], 50, ev.Config(fixed_step=50)) and \
        not ev.finished([], 49, ev.Config(fixed_step=50))
    flat = ev.select(evals, [0.0] * 80, cfg)                # never stops: the last es_average steps
    assert flat["rule"] == "last" and flat["evals_used"] == [60, 70, 80]


def batch(step, syn, real, cfg, seed):
    source, pool, idx = ev.batch_at(step, syn, real, cfg, seed)
    return source, [pool[i] for i in idx]


def test_leeps_exploits_informative_questions_and_explores_their_neighbours():
    """4 clusters of questions (one-hot embeddings); cluster 0 gave non-trivial groups, cluster 1
    trivial ones: LEEPS re-draws cluster 0's informative questions, then prefers cluster 0's undrawn
    ones"""
    import random
    emb = np.repeat(np.eye(4), 5, axis=0)          # questions 0-4: cluster 0, 5-9: cluster 1, ...
    history = [{"questions": [0, 1, 5, 6], "portfolio": ["explore"] * 4,
                "nontrivial": [True, True, False, False]}]
    idx, portfolio = ev.leeps(20, emb, history, 4, random.Random(0))
    assert len(set(idx)) == 4 and set(idx[:portfolio.count("exploit")]) <= {0, 1}
    assert portfolio.count("exploit") >= 1
    explored = idx[portfolio.count("exploit"):]
    assert explored and all(i in (2, 3, 4) for i in explored[:2])   # cluster 0's undrawn ones first
    assert not {5, 6} & set(idx)                                    # known-trivial ones last
    first, _ = ev.leeps(20, emb, [], 4, random.Random(0))        # no history: uniform over the pool
    assert len(set(first)) == 4


def test_batches_mixed_and_curriculum():
    syn = [{"question": f"s{i}", "answer": "1"} for i in range(5)]
    real = [{"question": f"r{i}", "answer": "1"} for i in range(7)]
    cfg = ev.Config(student_questions=3, mode="mixed")
    epoch = [q["question"] for s in range(4)
             for q in batch(s, syn, real, cfg, 4)[1]]   # 12 = one epoch
    assert sorted(epoch) == sorted(q["question"] for q in syn + real)
    assert batch(2, syn, real, cfg, 4) == batch(2, syn, real, cfg, 4)            # replayable
    assert batch(2, syn, real, cfg, 4) != batch(2, syn, real, cfg, 5)
    cur = ev.Config(student_questions=3, mode="curriculum", switch_step=2)
    assert [batch(s, syn, real, cur, 0)[0] for s in range(4)] == \
        ["synthetic", "synthetic", "real", "real"]
    assert all(q in syn for q in batch(1, syn, real, cur, 0)[1])
    assert all(q in real for q in batch(3, syn, real, cur, 0)[1])


def test_serl_keeps_the_questions_whose_majority_share_is_in_the_bounds():
    cfg = ev.Config(serl_low=0.25, serl_high=0.75)
    questions = ["q0", "q1", "q2", "q3", "q4", "q5"]
    votes = [("3", 0.25), ("4", 0.75), ("5", 0.125), ("6", 1.0), (None, 0.0), ("7", 0.5)]
    assert ev.serl_kept(questions, votes, cfg) == [
        {"question": "q0", "answer": "3", "share": 0.25},   # the bounds are kept
        {"question": "q1", "answer": "4", "share": 0.75},
        {"question": "q5", "answer": "7", "share": 0.5}]
    # majority labels of hand-built samples, through the difficulty filter
    groups = [["\\boxed{3}"] * 3 + ["\\boxed{4}"],   # share 0.75: kept
              ["\\boxed{3}"] * 4,                      # all agree: too easy
              ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}"]]   # 0.25: kept
    kept = ev.serl_kept(["a", "b", "c"], data.majority_labels(groups), cfg)
    assert [(q["question"], q["answer"]) for q in kept] == [("a", "3"), ("c", "1")]


def test_serl_returns_carry_the_kl_penalty_of_later_tokens_and_are_whitened(monkeypatch):
    """SeRL's per-token return (OpenRLHF's, gamma 1): the rollout's RLOO value less kl_coef times
    the KL of this token and every later one; then whitened over the batch's tokens"""
    returns = ev.kl_returns(1.0, [-1.0, -2.0, -3.0], [-1.5, -2.0, -2.0], kl_coef=0.1)
    # KL per token: 0.5, 0, -1; penalties -0.05, 0, +0.1
    assert returns == pytest.approx([1.0 - 0.05 + 0.1, 1.0 + 0.1, 1.0 + 0.1])
    rows = [[1.0, 2.0], [3.0], [4.0, 5.0, 6.0]]
    flat = [x for r in rows for x in r]
    mean = sum(flat) / len(flat)
    std = (sum((x - mean) ** 2 for x in flat) / len(flat)) ** 0.5
    monkeypatch.setattr(ev.dist, "all_reduce", lambda t, group=None: None)   # one rank
    white = ev.whiten(rows, None, "cpu")
    assert [len(r) for r in white] == [2, 1, 3]
    assert [x for r in white for x in r] == pytest.approx([(x - mean) / std for x in flat])


def test_serl_rewards_are_its_own_one_and_zero_and_the_whitening_has_openrlhfs_floor(monkeypatch):
    """SeRL trains on 1 (the answer verifies against the label) or 0, not the harness's 120/20/10/0,
    so its KL penalty keeps SeRL's weight beside the RLOO value; the RLOO value is clipped to +-10;
    a batch whose values are all alike (every group trivial: only KL noise) is divided by at most
    1e4 (OpenRLHF's variance floor 1e-8), not blown up to unit size"""
    table = ev.serl_rewards([data.R_CORRECT, data.R_CONTAINS, data.R_BOXED, data.R_NONE] * 2, 4)
    assert table.tolist() == [[1.0, 0.0, 0.0, 0.0]] * 2
    assert ev.serl_advantages(table)[0].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert ev.serl_advantages(torch.tensor([[400.0, 0.0]])).tolist() == [[10.0, -10.0]]
    monkeypatch.setattr(ev.dist, "all_reduce", lambda t, group=None: None)   # one rank
    noise = [[1e-6, -1e-6, 2e-6], [0.0, -2e-6]]   # KL penalties of trivial groups
    assert max(abs(x) for row in ev.whiten(noise, None, "cpu") for x in row) < 0.05


def test_serl_kl_0_needs_no_reference(monkeypatch):
    """--serl_kl 0: the row loads no reference (fresh_student: kl_coef 0), so serl_update must not
    ask for its log-probs; its returns are the whitened RLOO values alone. (rloo's engine and
    trainer calls are stand-ins here: this checks serl_update's own logic.)"""
    class Sample:
        prompt_token_ids, token_ids = [1, 2], [3, 4]

    def logprobs(model, prompts, completions, **_):
        assert model is not None, "asked for the log-probs of a reference that was not loaded"
        return [[-1.0, -1.0] for _ in prompts]

    trained = []
    monkeypatch.setattr(ev.rloo, "sync_weights", lambda policy, llm: None)
    monkeypatch.setattr(ev.rloo, "rollouts", lambda llm, batch, samples, **_: (
        [(Sample(), a) for _, a in batch for _ in range(samples)],
        [data.R_CORRECT, data.R_NONE] * len(batch)))
    monkeypatch.setattr(ev.rloo, "my_share", lambda items, group=None: items)
    monkeypatch.setattr(ev.rloo, "sequence_logprobs", logprobs)
    monkeypatch.setattr(ev.dist, "all_reduce", lambda t, group=None: None)
    monkeypatch.setattr(ev.rloo, "train_step", lambda policy, p, c, adv, **_: trained.append(adv)
                        or dict(loss=0.0, pg_loss=0.0, kl=0.0, grad_norm=0.0, lr=0.0, tokens=4,
                                skipped=False))
    mesh = type("Mesh", (), dict(get_group=lambda self: None))()
    policy = type("Policy", (), dict(model="model", ref=None, device="cpu", shared_prompts=False,
                                     mesh=mesh))()
    cfg = ev.Config(student_samples=2, serl_kl=0.0, serl_train_batch=2)
    stats = ev.serl_update(cfg, policy, None, [("q1", "1"), ("q2", "2")], seed=0)
    assert stats["updates"] == 2 and stats["reward"] == (data.R_CORRECT + data.R_NONE) / 2
    # RLOO of (1, 0) is (1, -1) per question, the same on every token: whitened, +-1
    assert sorted(x for adv in trained for row in adv for x in row) == \
        pytest.approx([-1.0] * 4 + [1.0] * 4)


def test_serl_writing_prompts_hold_seed_and_own_examples():
    """SeRL's few-shot prompts (its --serl_shots 8): 2 of its own kept questions once it has them,
    the rest from the seed set; with --serl_shots 0 (the world's), SOAR's teacher prompt"""
    import random
    from test_data import llama_like_tokenizer
    tok = llama_like_tokenizer()
    seed_set = [{"question": f"Seed question number {i}?", "answer": str(i)} for i in range(20)]
    kept = ["Own question alpha?", "Own question beta?", "Own question gamma?"]
    cfg = ev.Config(serl_shots=8, serl_prompts=3)
    for own, prompts in ((0, ev.writing_prompts(cfg, tok, seed_set, [], random.Random(0))),
                         (2, ev.writing_prompts(cfg, tok, seed_set, kept, random.Random(0)))):
        assert len(prompts) == 3
        for ids in prompts:
            text = tok.decode(ids)
            assert text.count("Seed question") == 8 - own and text.count("Own question") == own
            assert "\n9." in text and "\n10." not in text
    world = ev.Config(serl_shots=0, serl_prompts=2)
    assert ev.writing_prompts(world, tok, seed_set, kept, random.Random(0)) == \
        [data.teacher_prompt(tok)] * 2


def test_paired_ci_and_pooled_slope():
    lo, hi = ev.paired_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert 1.0 <= lo < 3.0 < hi <= 5.0
    assert ev.paired_ci([2.0] * 5) == (2.0, 2.0)                          # no spread, no width
    assert ev.paired_ci([-1.0, 1.0, -1.0, 1.0, 0.5])[0] < 0 < \
        ev.paired_ci([-1.0, 1.0, -1.0, 1.0, 0.5])[1]
    rising = [[0.1 * t + e for t, e in enumerate(noise)]
              for noise in np.random.default_rng(0).normal(0, 0.2, (5, 40))]
    slope, lo, hi = ev.slope_ci(rising)
    assert 0 < lo < slope < hi and slope == pytest.approx(0.1, abs=0.02)
    assert ev.slope_ci([[0.0] * 40] * 5) == (pytest.approx(0.0), pytest.approx(0.0),
                                              pytest.approx(0.0))


def test_population_table_pairs_students_with_the_single_agent_by_seed():
    """mean, best and worst student per seed; a population of one student (1T-1S) has no
    `members` in its result and is its own mean, best and worst"""
    def res(method, seed, passk, members=None):
        r = {"method": method, "test": "t.jsonl", "seed": seed, "passk": {"pass@4": passk}}
        return {**r, "members": members} if members else r
    four = [res("populora", s, 0.5, {f"s{j}": {"pass@4": p} for j, p in enumerate(ps)})
            for s, ps in enumerate([(0.25, 0.75), (0.5, 0.5)])]
    singles = [res("populora-single", s, p) for s, p in enumerate([0.25, 0.0])]
    line = ev.population_table(four + singles)[4]
    assert line == ("| t.jsonl | 2 | 50.0 ± 0.0 | 62.5 ± 17.7 | 37.5 ± 17.7 | 12.5 ± 17.7 | "
                    "+37.5 [+25.0, +50.0] | +25.0 [+0.0, +50.0] |")
    one = [res("populora", 0, 0.5), res("populora-single", 0, 0.25)]
    assert ev.population_table(one)[4] == ("| t.jsonl | 1 | 50.0 ± 0.0 | 50.0 ± 0.0 | 50.0 ± 0.0 "
                                           "| 25.0 ± 0.0 | +25.0 [+25.0, +25.0] "
                                           "| +25.0 [+25.0, +25.0] |")


def test_pq_subsets_from_the_world_or_labels(tmp_path):
    word = "Tom has 5 apples. He gives away 2. How many apples does he have now?"
    pq = [{"question": word, "answer": "3"}, {"question": word.replace("5", "6"), "answer": "9"},
          {"question": "Find x if x^2 = 4.", "answer": "2"}]
    cfg = ev.Config()
    assert ev.pq_subset(pq, "correct", cfg) == pq[:1] and \
        ev.pq_subset(pq, "wellposed", cfg) == pq[:2]
    write(str(tmp_path / "labels.jsonl"), [{"question": q["question"], "correct": i == 2,
                                            "well_posed": i > 0} for i, q in enumerate(pq)])
    cfg = ev.Config(labels=str(tmp_path / "labels.jsonl"))
    assert ev.pq_subset(pq, "correct", cfg) == pq[2:] and \
        ev.pq_subset(pq, "wellposed", cfg) == pq[1:]
    with pytest.raises(ValueError, match="no 'correct' label for 1 promotion questions"):
        ev.pq_subset(pq + [{"question": "new", "answer": "1"}], "correct", cfg)


# ---- Vendi ----
def test_filter_counts_keep_their_sound_prefix(tmp_path, capsys):
    path = tmp_path / "counts.jsonl"
    path.write_text('{"index": 0, "correct": 3}\n{"index": 1, "correct": 0}\n'
                    '{"index": 5, "correct": 1}\n{"ind')   # a row out of place, a cut line
    assert [r["index"] for r in ev.counted(str(path))] == [0, 1]
    assert path.read_text().count("\n") == 2 and "2 lines from line 3 on" in capsys.readouterr().err


def test_vendi_known_cases():
    assert data.vendi(np.ones((6, 4))) == pytest.approx(1.0)
    assert data.vendi(np.eye(7)) == pytest.approx(7.0)
    # two clusters
    assert data.vendi(np.array([[1, 0], [1, 0], [0, 1], [0, 1]])) == pytest.approx(2.0)
    X = data.embed_ngram(["What is 2 + 2?"] * 10)
    assert data.vendi(X) == pytest.approx(1.0)
    varied = data.embed_ngram([f"Find the {w} of {i} and {i * 7 + 3}." for i, w in enumerate(
        ["sum", "product", "gcd", "lcm", "difference", "ratio"] * 3)])
    assert 1.5 < data.vendi(varied) < 18
    m, s = data.vendi_bootstrap(np.eye(200), subset=128, draws=5)
    assert m == pytest.approx(128.0) and s == pytest.approx(0.0, abs=1e-9)
    # small set: one draw
    assert data.vendi_bootstrap(np.eye(5), subset=128) == (pytest.approx(5.0), 0.0)


# ---- the report, on hand-made run folders ----
def write(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows if isinstance(rows, list) else [rows]:
            f.write(json.dumps(r) + "\n")


def test_report_table_and_plots(tmp_path):
    runs, soar_dir = tmp_path / "runs", tmp_path / "soar"
    for seed, p1 in ((0, 0.01), (1, 0.03)):
        d = runs / "pq" / f"seed{seed}"
        write(str(d / "result.json"), dict(method="pq", test="t.jsonl", seed=seed,
                                           rule="early-stop", stop_step=10,
                                           passk={"pass@1": p1, "pass@32": 0.2}))
        write(str(d / "evals.jsonl"), [{"step": s, "pass@1": p1 * s / 10, "pass@32": 0.1}
                                       for s in (0, 10, 20)])
        write(str(runs / "grounded-t" / f"seed{seed}" / "questions.jsonl"),
              [{"question": f"What is {i} + {seed}?", "answer": "1"} for i in range(20)])
    write(str(runs / "base" / "seed0" / "result.json"),
          dict(method="base", test="t.jsonl", seed=0, passk={"pass@1": 0.005, "pass@32": 0.05}))
    for seed, p32 in ((0, 0.1), (1, 0.1)):
        write(str(runs / "hard-only" / f"seed{seed}" / "result.json"),
              dict(method="hard-only", test="t.jsonl", seed=seed,
                   passk={"pass@1": 0.0, "pass@32": p32}))
    write(str(runs / "base-t" / "seed1" / "result.json"),   # one seed: pq pairs with it once
          dict(method="base-t", test="t.jsonl", seed=1, passk={"pass@1": 0.0, "pass@32": 0.15}))
    away, gets = ("Tom has 9 apples. He gives away {}. How many apples does he have now?",
                  "Tom has 9 apples. He gets {} more. How many apples does he have now?")
    for d, reward in ((soar_dir, "grounded"), (tmp_path / "soar-s1", "grounded"),
                      (tmp_path / "int", "learnability")):
        # SOAR runs of two seeds (a plot panel and a PQ set each) and a learnability run; their
        # teachers write more "gives away" problems over the steps (grounded), fewer (learnability)
        write(str(d / "pq.jsonl"), [{"question": "Q one", "answer": "1", "step": 0}])
        write(str(d / "metrics.jsonl"), [dict(step=s, reward=0.01 * s, ma=None if s < 2 else 0.01,
                                              R_k=[0.0, 0.01 * (s < 2)], promoted=s == 3,
                                              promotions=int(s >= 3)) for s in range(5)])
        write(str(d / "ckpt" / "step-5" / "state.json"), {"step": 5, "config": {"reward": reward}})
        up = reward == "grounded"
        write(str(d / "questions.jsonl"),
              [{"question": (away if (i < s) == up else gets).format(i + 1), "answer": "1",
                "step": s, "k": 0, "R_k": 0.0} for s in range(5) for i in range(4)])
    write(str(tmp_path / "soar-new" / "metrics.jsonl"), [])  # a run before its first step: left out
    old = tmp_path / "soar-old"   # a run from before questions.jsonl: in the teacher table, no (c)
    write(str(old / "metrics.jsonl"), [dict(step=0, reward=0.0, ma=None, R_k=[0.0, 0.0],
                                            promoted=False, promotions=0)])
    write(str(old / "ckpt" / "step-1" / "state.json"), {"step": 1, "config": {"reward": "opensir"}})
    cfg = ev.Config(runs=str(runs), soar=f"{soar_dir},{tmp_path / 'soar-s1'},"
                                         f"{tmp_path / 'soar-new'}",
                    vendi_draws=3, intrinsic=str(tmp_path / "int"), opensir=str(old),
                    wandb="eval-tests")
    with mock.patch.dict(os.environ):   # (W&B leaves its service's address there: not for later
        text = ev.cmd_report(cfg)       # tests' processes)
        import wandb
        wandb.teardown()   # the service writes a finished run's .wandb file when it closes the run,
        #                    which may come after finish() returns: teardown waits for it
    lines = text.splitlines()
    assert ("| method | pass@1 | pass@32 | pass@32 - Hard-Only [95% CI] "
            "| pass@32 - Base-T [95% CI] | seeds | step | non-trivial |") in lines
    rows = [x for x in lines if x.startswith("| base") or x.startswith("| pq")]
    # the paper's order; each row paired by seed with Hard-Only and with Base-T (where a seed
    # has both)
    assert rows[0].startswith("| base | 0.5 ± 0.0 | 5.0 ± 0.0 | -5.0 [-5.0, -5.0] | - | 1 |")
    assert rows[1].startswith("| base-t | 0.0 ± 0.0 | 15.0 ± 0.0 | +5.0 [+5.0, +5.0] | - | 1 |")
    assert rows[2].startswith(f"| pq | 2.0 ± {100 * np.std([0.01, 0.03], ddof=1):.1f} "
                              "| 20.0 ± 0.0 | +10.0 [+10.0, +10.0] | +5.0 [+5.0, +5.0] | 2 | 10")
    # the teacher learning: 3 steps before the promotion at step 3, 2 of them with different R_k
    assert ("| grounded | 2 | 5 | 67% of 6 | +0.0100 [+0.0100, +0.0100] "
            "| 0% ± 0% -> 100% ± 0% |") in lines
    assert any(x.startswith("| learnability | 1 | 5 |") and x.endswith("| 100% ± 0% -> 0% ± 0% |")
               for x in lines)
    assert "| opensir | 1 | 1 | 0% of 1 | +0.0000 [+0.0000, +0.0000] | - |" in lines
    assert any(x.startswith("| grounded-t |") and x.endswith("| 2 | 40 |")
               for x in lines)   # Vendi per seed's set
    assert "| pq | 1.00 ± 0.00 | 2 | 2 |" in lines and \
        f"- {soar_dir}: 5 outer steps, 1 promotions" in lines
    assert not any("soar-new" in x for x in lines)
    for png in ("curves.png", "soar.png", "curriculum.png"):
        assert (runs / png).stat().st_size > 1000
    assert (runs / "report.md").read_text() == text
    # --wandb (offline: conftest): a table per method, and the plots
    assert {k[:-6]: v for r in wandb_history(runs) for k, v in r.items() if k.endswith("/_type")} \
        == {"base": "table-file", "hard-only": "table-file", "base-t": "table-file",
            "pq": "table-file", "curves": "image-file", "soar": "image-file",
            "curriculum": "image-file"}


def test_parse_args_world_defaults_and_paper_settings(tmp_path):
    cmd, args, cfg = ev.parse_args(["row", "base", "pq", "--seeds", "0,1"])
    assert (cmd, args, cfg.model, cfg.student_steps) == ("row", ["base", "pq"], "",
                                                          launch.world_values(ev.Config)["student_steps"])
    _, _, paper = ev.parse_args(["row", "pq", "--model", "m", "--mode", "curriculum"])
    assert (paper.student_steps, paper.student_lr, paper.student_samples, paper.student_questions,
            paper.student_warmup, paper.switch_step) == (1500, 1e-5, 32, 8, 20, 64)
    assert (paper.es_window, paper.es_fraction, paper.es_average, paper.passk_samples) == \
        (25, 0.15, 200, 32)
    # SeRL's own settings (its Llama-3.2-3B RLOO script)
    assert (paper.serl_shots, paper.serl_samples, paper.serl_low, paper.serl_high,
            paper.serl_lr, paper.serl_similarity) == (8, 16, 0.2, 0.8, 5e-7, 0.7)
    assert (paper.serl_kl, paper.serl_train_batch, paper.serl_clip, paper.serl_max_tokens,
            paper.serl_prompts, paper.serl_questions) == (1e-4, 16, 0.2, 1024, 4, 16)
    cmd, _, cfg = ev.parse_args(["train", "--synthetic", "q.jsonl", "--name", "mine"])
    assert (cmd, cfg.synthetic, cfg.name) == ("train", "q.jsonl", "mine")
    for bad in (["row", "nonsense"], ["row"], ["row", "pq", "--mode", "random"],
                ["train", "--name", "x"], ["train", "--synthetic", "q.jsonl", "--name", "pq"],
                ["row", "serl", "--serl_low", "0.9", "--serl_high", "0.8"]):
        with pytest.raises(SystemExit):
            ev.parse_args(bad)
    # fails fast, before any world or engine; --runs not ./runs, where rows the README's commands
    # finished are not run again and need no inputs
    with pytest.raises(launch.UsageError, match="missing inputs"):
        ev.main(["row", "pq", "ps", "--soar", "/nonexistent", "--runs", str(tmp_path / "runs")])


def test_a_two_turn_teacher_is_sampled_in_two_turns(tmp_path):
    """answer_form: the p' of a soar.py run's teacher trained with --teacher_turns 2 (its run's
    config), which teacher_questions samples it with; None for one turn and for any other model"""
    for turns, out in ((2, "tag"), (1, None)):
        run = tmp_path / f"turns{turns}"
        data.write_json(str(run / "ckpt" / "step-3" / "state.json"),
                        {"config": {"teacher_turns": turns, "answer_prompt": "tag"}})
        assert ev.answer_form(str(run / "teacher")) == out
        assert ev.answer_form(str(run / "teacher") + "/") == out
        assert ev.answer_form(str(run / "student")) is None
    assert ev.answer_form(str(tmp_path / "model")) is None
    # a teacher/ copied elsewhere: its soar.json (launch.save_soar_folders) says how it samples
    copy = tmp_path / "copied-teacher"
    data.write_json(str(copy / "soar.json"), {"step": 3, "promotions": 0, "teacher_turns": 2,
                                              "answer_prompt": "chat"})
    assert ev.answer_form(str(copy)) == "chat"


def test_soar_output_of_another_base_model_is_refused(tmp_path):
    write(str(tmp_path / "soar" / "pq.jsonl"), {"question": "q", "answer": "1", "step": 0})
    write(str(tmp_path / "soar" / "ckpt" / "step-1" / "state.json"),
          {"step": 1, "config": {"model": "/other/model"}})
    with pytest.raises(launch.UsageError, match="was run from /other/model"):
        ev.main(["row", "pq", "--model", str(tmp_path / "m"), "--train", "h", "--test", "t",
                 "--soar", str(tmp_path / "soar"), "--runs", str(tmp_path / "runs")])


@pytest.mark.parametrize("row, flag", [("populora", "--populora"), ("intrinsic-t", "--intrinsic"),
                                       ("opensir-t", "--opensir"), ("ps", "--soar")])
def test_an_adapter_of_another_base_model_is_refused(tmp_path, row, flag):
    """every adapter folder a row reads names its base (adapter_config.json): another base than
    --model is a usage error, before any engine (the engine would serve it on --model's weights)"""
    model = tmp_path / "m"
    model.mkdir()
    folder = {"populora": "students/a0", "ps": "student"}.get(row, "teacher")
    write(str(tmp_path / "run" / folder / "adapter_config.json"),
          {"r": 8, "base_model_name_or_path": "/other/model"})
    if row == "ps":   # a soar.py run's folder: its config names --model, its adapter does not
        write(str(tmp_path / "run" / "ckpt" / "step-1" / "state.json"),
              {"step": 1, "promotions": 0, "config": {"model": str(model)}})
        write(str(tmp_path / "run" / folder / "soar.json"), {"step": 1, "promotions": 0})
    with pytest.raises(launch.UsageError, match=r"adapter of /other/model, not of --model"):
        ev.main(["row", row, "--model", str(model), "--train", "h", "--test", "t",
                 flag, str(tmp_path / "run"), "--runs", str(tmp_path / "runs")])
    write(str(tmp_path / "run" / folder / "adapter_config.json"),
          {"r": 8, "base_model_name_or_path": str(model)})
    ev.check_adapter_bases([str(tmp_path / "run" / folder)], ev.Config(model=str(model)))


# ---- end to end: the real engine on the small world, torchrun with 2 ranks ----
STEPS = 4   # a fresh student's steps: two on the synthetic set, two on the hard split (curriculum)
SMALL = ["--world", "small", "--seeds", "0", "--student_steps", str(STEPS), "--eval_every", "2",
         "--ckpt_every", "2", "--student_samples", "4", "--student_questions", "2",
         "--passk_samples", "8", "--teacher_questions", "8", "--mode", "curriculum",
         "--switch_step", "2", "--es_window", "3", "--es_average", "2"]


def eval_py(*args, wait=True, script=os.path.join(ROOT, "eval.py")):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           script, *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def rows(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.fixture(scope="module")
def small_world():
    import world
    return world.build_world(small=True)


# eval.py with a row of the user's own, added by one entry: pq's questions, SePT's rule, group 6
MY_EVAL = """import sys
sys.path.insert(0, {root!r})
import eval as ev
import rloo
ev.ROWS["pq-sept6"] = ev.Row("mine", file="{{soar}}/pq.jsonl", group="big_group",
                             advantages=ev.sept_advantages, kl=False)
if __name__ == "__main__":
    ev.main()
"""


# the two rows of test_leeps_finds_the_informative_questions on --synthetic: one names its sampler,
# the other takes --sampler's
POOL_ROWS = """import sys
sys.path.insert(0, {root!r})
import eval as ev
ev.ROWS["pool"] = ev.Row("the pool, shuffled epochs", file="{{synthetic}}", sampler="uniform")
ev.ROWS["pool-leeps"] = ev.Row("the pool, --sampler's", file="{{synthetic}}")
if __name__ == "__main__":
    ev.main()
"""


@pytest.fixture(scope="module")
def rows_run(small_world, tmp_path_factory):
    """a stand-in SOAR output (the world model as promoted student, 8 hard train problems as PQ),
    then the rows base, ps, hard-only, pq (curriculum), base-t, sept, serl and MY_EVAL's pq-sept6 on
    it, in one torchrun call"""
    import shutil
    tmp = tmp_path_factory.mktemp("eval")
    soar_dir, runs = tmp / "soar", tmp / "runs"
    shutil.copytree(small_world["model"], soar_dir / "student")
    write(str(soar_dir / "pq.jsonl"), [{**q, "step": 0} for q in rows(small_world["train"])[:8]])
    write(str(soar_dir / "metrics.jsonl"), [dict(step=s, reward=0.01 * s, ma=0.01, promoted=s == 1,
                                                 promotions=int(s >= 1)) for s in range(3)])
    (tmp / "my_eval.py").write_text(MY_EVAL.format(root=ROOT))
    p = eval_py("row", "base", "ps", "hard-only", "pq", "base-t", "sept", "serl", "pq-sept6",
                "--soar", str(soar_dir), "--runs", str(runs), *SMALL, "--big_group", "6",
                "--wandb", "eval-tests", script=str(tmp / "my_eval.py"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return soar_dir, runs, p


def test_a_new_row_is_one_entry(rows_run):
    _, runs, _ = rows_run
    d = runs / "pq-sept6" / "seed0"
    res, metrics = json.loads((d / "result.json").read_text()), rows(d / "metrics.jsonl")
    assert (res["method"], res["samples"], res["n_synthetic"]) == ("pq-sept6", 6, 8)
    assert [m["source"] for m in metrics][:2] == ["synthetic", "synthetic"]   # pq's questions first
    assert all(m["pg_loss"] == -1.0 and m["kl"] == 0.0 for m in metrics)       # SePT's advantages


def test_rows_end_to_end(rows_run, small_world):
    soar_dir, runs, _ = rows_run
    n_test = len(rows(small_world["test"]))
    for method in ("base", "ps", "hard-only", "pq", "base-t"):
        res = json.loads((runs / method / "seed0" / "result.json").read_text())
        assert res["method"] == method and list(res["passk"]) == ["pass@1", "pass@4", "pass@8"]
        p = list(res["passk"].values())
        assert all(0 <= x <= 1 for x in p) and p == sorted(p)                # pass@k grows with k
    # ps is a copy of the base model, served from its folder after the base's row
    # (rloo_extras.serve_hf): the same samples, the same pass@k
    assert json.loads((runs / "ps" / "seed0" / "result.json").read_text())["passk"] == \
        json.loads((runs / "base" / "seed0" / "result.json").read_text())["passk"]
    for method in ("hard-only", "pq", "base-t", "sept"):
        d = runs / method / "seed0"
        metrics, evals = rows(d / "metrics.jsonl"), rows(d / "evals.jsonl")
        res = json.loads((d / "result.json").read_text())
        assert [m["step"] for m in metrics] == list(range(res["steps_done"])) and \
            res["steps_done"] <= STEPS
        end = res["steps_done"]      # evals every 2 steps, and at --steps if the run got there
        assert [e["step"] for e in evals] == sorted(set(range(0, end + 1, 2)) |
                                                    ({end} if end == STEPS else set()))
        assert all(0 <= e["solved"] <= n_test for e in evals)
        assert all(m["grad_norm"] >= 0 and 0 <= m["accuracy"] <= 1 for m in metrics)
        assert not (d / "ckpt").exists()   # a finished run keeps no optimizer state
        assert set(res["evals_used"]) <= {e["step"] for e in evals}
    # SePT: NLL on its own samples, advantage 1 on every token: its policy-gradient term is exactly
    # -1 a token, whatever the rewards; RLOO's advantages average 0 within a question
    assert all(m["pg_loss"] == -1.0 and m["kl"] == 0.0 and m["grad_norm"] > 0
               for m in rows(runs / "sept" / "seed0" / "metrics.jsonl"))
    assert all(m["pg_loss"] != -1.0 for m in rows(runs / "hard-only" / "seed0" / "metrics.jsonl"))
    # every fresh-student step logs which question groups carried a reward signal
    assert all(0 <= m["nontrivial_share"] <= 1 and len(m["nontrivial"]) == 2
               for m in rows(runs / "hard-only" / "seed0" / "metrics.jsonl"))
    # hard-only has no synthetic set: mixed over the hard split; pq: curriculum, synthetic first
    assert {m["source"] for m in rows(runs / "hard-only" / "seed0" / "metrics.jsonl")} == {"mixed"}
    sources = [m["source"] for m in rows(runs / "pq" / "seed0" / "metrics.jsonl")]
    assert sources[:2] == ["synthetic", "synthetic"] and set(sources[2:]) <= {"real"}
    # sampled with the teacher prompt + filter
    qs = rows(runs / "base-t" / "seed0" / "questions.jsonl")
    assert len(qs) == 8 and all(q["question"] and q["answer"] for q in qs)
    # --wandb (offline: conftest): the rows' tables, each with its result.json's numbers
    (folder,) = {d for d, _ in wandb_records(runs)}   # one W&B run
    tables = {k[:-5]: v for r in wandb_history(runs) for k, v in r.items() if k.endswith("/path")}
    assert set(tables) == {"base", "ps", "hard-only", "pq", "base-t", "sept", "serl", "pq-sept6"}
    for method, path in tables.items():
        res = json.loads((runs / method / "seed0" / "result.json").read_text())
        table = json.loads((runs / "wandb" / folder / "files" / path).read_text())
        assert table["columns"] == ["test", "seed", *res["passk"], "step"]
        assert table["data"] == [[res["test"], 0, *res["passk"].values(), res.get("stop_step")]]


def test_serl_row(rows_run):
    """SeRL on the small world: each step the student writes questions (teacher prompt and format
    filter: the world's value of --serl_shots) in rounds until it keeps --serl_questions or has
    run --serl_rounds, keeps them by quality, diversity and its majority vote's share, and trains
    on them with its labels beside the hard split's questions: one PPO update per
    --serl_train_batch rollouts"""
    _, runs, _ = rows_run
    d = runs / "serl" / "seed0"
    res, metrics = json.loads((d / "result.json").read_text()), rows(d / "metrics.jsonl")
    world = launch.world_values(ev.Config)
    assert (res["samples"], res["n_synthetic"], res["mode"]) == (world["serl_samples"], 0, "mixed")
    generated = [q for m in metrics for q in m["generated"]]
    assert generated and rows(d / "questions.jsonl") == generated
    for m in metrics:
        n = m["serl"]
        assert n["written"] >= n["quality"] >= n["diverse"] >= n["difficulty"] >= \
            len(m["generated"]) and len(m["generated"]) <= world["serl_questions"]
        assert len(m["nontrivial"]) == 2 + len(m["generated"])   # --student_questions 2 + these
        assert 1 <= n["rounds"] <= world["serl_rounds"]
        assert n["rounds"] == world["serl_rounds"] or n["difficulty"] >= world["serl_questions"]
        rollouts = len(m["nontrivial"]) * world["serl_samples"]
        assert m["updates"] == -(-rollouts // ev.Config().serl_train_batch) and m["kl"] == 0
        assert m["tokens/generated/self_instruct"] > 0   # its writing and votes: a phase of its own
    assert all(0.2 <= q["share"] <= 0.8 and q["answer"] for q in generated)
    assert len({q["question"] for q in generated}) == len(generated)   # the diversity filter


def test_rerun_does_nothing_and_report(rows_run):
    soar_dir, runs, _ = rows_run
    before = {p: p.read_text() for p in runs.rglob("*.json*")}
    p = eval_py("row", "base", "ps", "hard-only", "pq", "base-t", "--soar", str(soar_dir),
                "--runs", str(runs), *SMALL)
    assert p.returncode == 0 and "nothing to do" in p.stdout
    assert {p: p.read_text() for p in runs.rglob("*.json*")} == before
    text = ev.cmd_report(ev.Config(runs=str(runs), soar=str(soar_dir), vendi_subset=8,
                                   vendi_draws=2))
    for method in ("base", "ps", "hard-only", "pq", "base-t"):
        assert any(x.startswith(f"| {method} | ") for x in text.splitlines())
    assert (runs / "curves.png").exists() and (runs / "soar.png").exists()


def test_kill_and_resume_gives_the_same_run(rows_run, tmp_path):
    """kill -9 every process of a hard-only run after its first checkpoint (torchrun's workers live
    in sessions of their own, so killing torchrun's group is not enough), rerun: same metrics,
    evals, result"""
    import time
    soar_dir, runs_a, _ = rows_run
    runs = tmp_path / "runs"
    d = runs / "hard-only" / "seed0"
    p = eval_py("row", "hard-only", "--soar", str(soar_dir), "--runs", str(runs), *SMALL,
                wait=False)
    deadline = time.time() + 600
    while not (d / "ckpt" / "step-2").exists():
        assert p.poll() is None and time.time() < deadline, \
            p.stdout.read()[-3000:] if p.poll() is not None else ""
        time.sleep(0.2)
    kill_all(p)   # a process may die with its parent between the listing and its kill
    assert not (d / "result.json").exists()
    q = eval_py("row", "hard-only", "--soar", str(soar_dir), "--runs", str(runs), *SMALL)
    assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
    assert "resuming at step" in q.stdout
    a = runs_a / "hard-only" / "seed0"
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rs]   # noqa: E731
    assert strip(rows(d / "metrics.jsonl")) == strip(rows(a / "metrics.jsonl"))
    assert rows(d / "evals.jsonl") == rows(a / "evals.jsonl")
    assert json.loads((d / "result.json").read_text()) == \
        json.loads((a / "result.json").read_text())


def test_leeps_finds_the_informative_questions(small_world, tmp_path):
    """A pool where most question groups carry no reward signal (sums whose gold answer no sample
    can match or contain: every sample scores a wrong boxed answer) and a few do (one-step
    'gives away' problems the model solves sometimes). Over the same steps, LEEPS draws more groups
    with reward variance than shuffled epochs, at a negligible cost per step."""
    import random
    import world
    rng = random.Random(0)
    pool = [{"question": world.make_problem(rng, "add", 1)["question"], "answer": "99999"}
            for _ in range(40)] + \
        [{k: p[k] for k in ("question", "answer")}
         for p in (world.make_problem(rng, "word", "-") for _ in range(10))]
    data.write_jsonl(str(tmp_path / "pool.jsonl"), pool)
    (tmp_path / "my_eval.py").write_text(POOL_ROWS.format(root=ROOT))
    flags = ["--world", "small", "--synthetic", str(tmp_path / "pool.jsonl"),
             "--runs", str(tmp_path / "runs"), "--student_steps", "24", "--fixed_step", "24",
             "--eval_every", "24", "--student_questions", "4", "--student_samples", "8",
             "--student_lr", "0", "--passk_samples", "1", "--mode", "curriculum",
             "--switch_step", "24"]   # the pool alone, and a model that does not change
    # one launch, one engine: the row that names its sampler, then --sampler's (the student's
    # seeds are its step's, whatever the row: the same samples as a launch each)
    p = eval_py("row", "pool", "pool-leeps", *flags, "--sampler", "leeps",
                script=str(tmp_path / "my_eval.py"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    share = {}
    for sampler, name in (("uniform", "pool"), ("leeps", "pool-leeps+leeps")):
        d = tmp_path / "runs" / name / "seed0"
        res = json.loads((d / "result.json").read_text())
        assert res["sampler"] == sampler
        share[sampler] = res["nontrivial_share"]
        metrics = rows(d / "metrics.jsonl")
        assert all(m["sampler_seconds"] < 0.5 for m in metrics)   # negligible next to a step
    # 0.57 vs 0.31 on the machine this test was written on (0.44 vs 0.21 on the 300-step small
    # world of before, 0.33 vs 0.23 on an AVX-512 machine's build of it)
    assert share["leeps"] > share["uniform"] + 0.05, share


def test_train_is_the_row_of_its_synthetic_file(monkeypatch, tmp_path):
    """`eval.py train --synthetic F --name N`: the row N of the file F (the rows
    test_leeps_finds_the_informative_questions runs end to end), in runs/N[+leeps]"""
    called = []
    monkeypatch.setattr(ev, "cmd_row", lambda cfg, methods: called.append((cfg, methods)))
    ev.main(["train", "--synthetic", "q.jsonl", "--name", "mine", "--sampler", "leeps",
             "--runs", str(tmp_path)])
    (cfg, methods), = called
    row = ev.row_of("mine", cfg)
    assert methods == ["mine"] and ev.path_of(row.file, cfg) == "q.jsonl"
    assert row == ev.Row(row.about, file="{synthetic}")   # a fresh student, all else the default
    assert ev.run_dir(cfg, "mine", 0) == os.path.join(str(tmp_path), "mine+leeps", "seed0")


def test_rows_of_a_lora_run(lora_run, tmp_path):
    """a LoRA SOAR run's PEFT folders (the session's, conftest.lora_run) served as adapters (ps: its
    student, grounded-t: questions of its teacher) and a fresh student trained as an adapter
    (--lora_rank)"""
    soar_dir, _ = lora_run
    runs = tmp_path / "runs"
    p = eval_py("row", "ps", "hard-only", "grounded-t", "--lora_rank", "8", "--soar",
                str(soar_dir), "--runs", str(runs), *SMALL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for method in ("ps", "hard-only", "grounded-t"):
        res = json.loads((runs / method / "seed0" / "result.json").read_text())
        assert set(res["passk"]) >= {"pass@1", "pass@8"}
    questions = rows(runs / "grounded-t" / "seed0" / "questions.jsonl")
    assert len(questions) == 8 and all(q["question"] and q["answer"] for q in questions)
