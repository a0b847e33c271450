"""SOAR end to end on the small built-in world: torchrun with 2 ranks on CPU, real vLLM engines,
real FSDP2 (gloo), real math-verify: the outputs of a run (the session's reference run,
conftest.py), settings a resume refuses, and the clean failures. Faults (kills, locks, damage):
test_faults.py."""
import json
import math
import os
import re
import sys

import pytest
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from soar_runs import (FLAGS, LORA, ROOT, TIMING, dcp_keys, kill_all, rows, soar,  # noqa: E402
                       torchrun, wait_for, without_timing)


def tag(name):
    """the soar.json of a FLAGS run's teacher/ or student/ (the teacher's says how it samples)"""
    turns = {"teacher_turns": 1, "answer_prompt": "tag"} if name == "teacher" else {}
    return {"step": 3, "promotions": 3, **turns}


def test_outputs_are_consistent(full_run):
    out, _ = full_run
    metrics = rows(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    promotions = 0
    for m in metrics:
        assert len(m["R"]) == 2 and all(len(row) == 2 for row in m["R"])
        assert m["R_k"] == pytest.approx([sum(row) / 2 for row in m["R"]])
        assert m["reward"] == pytest.approx(sum(m["R_k"]) / 2)
        assert all(-1 <= x <= 1 for row in m["R"] for x in row) and 0 <= m["acc0"] <= 1
        assert m["ma"] == pytest.approx(m["reward"])              # window 1
        # --promote_every_step: every step promotes, argmax dataset, lower-middle student of r = 2
        assert m["promoted"] and m["promoted_k"] == max(range(2), key=lambda k: (m["R_k"][k], -k))
        row = m["R"][m["promoted_k"]]
        assert m["promoted_j"] == (0 if row[0] <= row[1] else 1)
        promotions += 1
        assert m["promotions"] == promotions
        assert m["inner_steps"] == 2 + min(promotions - 1, 2)     # S grows with earlier promotions
        assert 0 < m["teacher_valid_rate"] <= 1
        assert TIMING <= m.keys() and m["total"] >= m["student_training"] > 0
        # throughput: tokens per phase over all ranks, tokens/s per GPU (no MFU on CPU)
        for phase in ("teacher_generation", "student_rollouts", "evaluation"):
            assert m[f"tokens/generated/{phase}"] > 0 and \
                m[f"perf/tokens_per_s_per_gpu/{phase}"] > 0
        assert m["tokens/trained/student_training"] > m["tokens/trained/teacher_update"] > 0
        assert not any(k.startswith("perf/mfu") for k in m)
        # two students per group, the last one stays in the model: one host snapshot per rank
        assert m["snapshots"] == 1
    pq = rows(out / "pq.jsonl")
    assert len(pq) == 4 * 3 and [r["step"] for r in pq] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(r["question"] and r["answer"] for r in pq)
    # questions.jsonl: every valid pair of every step, with its dataset and that dataset's R_k; the
    # PQ of a step are its promoted dataset's pairs
    qs = rows(out / "questions.jsonl")
    assert [(r["step"], r["k"]) for r in qs] == [(s, k) for s in range(3) for k in range(2)
                                                 for _ in range(4)]
    assert all(r["R_k"] == metrics[r["step"]]["R_k"][r["k"]] and r["question"] and r["answer"]
               for r in qs)
    assert [{k: r[k] for k in ("question", "answer", "step")} for r in qs
            if r["k"] == metrics[r["step"]]["promoted_k"]] == pq
    assert sorted(os.listdir(out / "ckpt")) == ["step-2", "step-3"]   # the newest KEEP_CKPTS
    assert not (out / "wandb").exists() and not (out / "wandb.json").exists()   # no --wandb
    state = json.loads((out / "ckpt" / "step-3" / "state.json").read_text())
    assert state["step"] == 3 and state["promotions"] == 3 and state["pq"] == 12
    # what a restart needs: the teacher with its AdamW state, the student's weights only
    teacher, student = dcp_keys(out / "ckpt" / "step-3" / "teacher"), \
        dcp_keys(out / "ckpt" / "step-3" / "student")
    assert any(k.startswith("optim.") for k in teacher) and \
        any(k.startswith("model.") for k in teacher)
    assert student and all(k.startswith("model.") for k in student)
    # HF folders: links to the version a step wrote, marked with it
    for name in ("teacher", "student"):
        assert os.readlink(out / name) == f"{name}.v3"
        assert json.loads((out / name / "soar.json").read_text()) == tag(name)
    log = full_run[1].stdout
    assert "written per step: checkpoint" in log and "HF folders" in log
    ours = re.compile(r"(built-in world \(small\): fingerprint|SOAR: 2 ranks|written per step: "
                      r"|step \d/3  reward|done: )")
    assert all(ours.match(line) for line in log.splitlines()), log   # no vLLM nor torch line
    assert re.search(r"step 3/3  reward [+-]\d\.\d{3}  MA [+-]\d\.\d{3}  promotions 3  "
                     r"valid \d+%  \d+ s", log)
    base = AutoModelForCausalLM.from_pretrained(state["config"]["model"]).state_dict()
    for name in ("teacher", "student"):   # HF folders that load, with the base model's tensors
        sd = AutoModelForCausalLM.from_pretrained(out / name).state_dict()
        assert sd.keys() == base.keys()
        if name == "teacher":  # it moved iff some step gave datasets different rewards (A_k != 0)
            moved = any(not (sd[k] == base[k]).all() for k in sd)
            assert moved == any(len(set(m["R_k"])) > 1 for m in metrics)


def test_finished_run_does_nothing(full_run):
    out, _ = full_run
    before = (out / "metrics.jsonl").read_text()
    p = soar(out)
    assert p.returncode == 0 and "nothing to do" in p.stdout
    assert (out / "metrics.jsonl").read_text() == before


def test_other_settings_refused(full_run):
    """a run with steps to go refuses other settings; a finished one too (a script that loops over
    settings must not reuse its outputs), saying it is finished"""
    out, _ = full_run
    p = soar(out, "--dataset_size", "5", "--outer_steps", "4")
    assert p.returncode != 0 and "other settings" in p.stdout + p.stderr and \
        "'dataset_size': (4, 5)" in p.stdout + p.stderr
    p = soar(out, "--dataset_size", "5")
    assert p.returncode != 0 and "nothing to do" not in p.stdout + p.stderr
    assert "is finished (all 3 steps), and" in p.stderr and "'dataset_size': (4, 5)" in p.stderr


@pytest.fixture(scope="module")
def easy(tmp_path_factory):
    """a Q_R the model solves: the small world's model is barely trained and gets few sums right,
    and which ones depends on the machine that built it, so: sums labelled with the model's own
    greedy answers (from an engine of this fixture's), those it answers with a number"""
    import random
    import subprocess
    import world
    rng = random.Random(0)
    sums = [world.make_problem(rng, "add", 1)["question"] for _ in range(40)]
    code = ("import json, sys, data, rloo; rloo.init_distributed(); "
            "llm = rloo.build_engine(sys.argv[1], max_model_len=320); "
            "qs = json.loads(sys.argv[2]); outs = rloo.generate("
            "llm, [data.student_prompt(q) for q in qs], temperature=0.0, max_tokens=96, seed=0); "
            "print('ANSWERS', json.dumps([data.last_boxed(o[0].text) for o in outs]))")
    g = subprocess.run([sys.executable, "-c", code, world.build_world(small=True)["model"],
                        json.dumps(sums)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert g.returncode == 0, g.stderr[-3000:]
    answers = json.loads(g.stdout.split("ANSWERS ", 1)[1])
    solved = [{"question": q, "answer": a.strip()} for q, a in zip(sums, answers)
              if a and a.strip().isdigit()]
    assert len(solved) >= 8, answers   # M = 8 (soar_runs.FLAGS)
    path = tmp_path_factory.mktemp("easy") / "easy.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in solved[:16]))
    return path


def skewed(out, mode, *extra):
    """soar.py FLAGS extra under tests/skewed_groups.py, its groups or ranks made to differ"""
    return torchrun("tests/skewed_groups.py", out, *FLAGS, *extra,
                    env={**os.environ, "SKEW": mode}, timeout=600)


@pytest.mark.parametrize("flags", [(), LORA], ids=["full", "lora"])
def test_unchanged_student_scores_zero_and_snapshots_wait_for_a_full_window(tmp_path, flags, easy):
    """student lr 0: every trained student is the baseline, so R == 0 exactly (Acc0 is measured on
    the same engines and batches as the students: with LoRA, a group's students as adapters at
    theta in one call), on a Q_R the model solves (the fixture easy), so any difference shows.
    The two groups' engines are made to differ on purpose (tests/skewed_groups.py: group 1
    measures every Acc 1/M higher, as a biased GPU engine could): each R_kj subtracts the Acc0 of
    the group that trained student (k, j), so R is still 0, and both ranks decide alike.
    Window 2: step 0 cannot promote, so no snapshot is kept; step 1 can."""
    out = tmp_path / "lr0"
    p = skewed(out, "accuracy", "--student_lr", "0", "--no-promote_every_step", "--window", "2",
               "--tau", "0.4", "--outer_steps", "2", "--train", str(easy), *flags)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = rows(out / "metrics.jsonl")
    assert all(m["acc0"] > 0 for m in metrics)
    assert all(m["acc0_groups"] == [m["acc0"], m["acc0"] + 1 / 8] for m in metrics)   # M = 8
    assert [x for m in metrics for row in m["R"] for x in row] == [0.0] * 8
    assert [m["snapshots"] for m in metrics] == [0, 1] and not any(m["promoted"] for m in metrics)
    decisions = [rows(out / f"decide-rank{r}.jsonl") for r in (0, 1)]
    assert decisions[0] == decisions[1] and len(decisions[0]) == 2


def test_ranks_that_decide_apart_stop_with_one_error(tmp_path):
    """A rank whose decision differs (tests/skewed_groups.py: rank 1 adds 1 to its step reward)
    stops the run at once with one error naming the step, the ranks and their values, where a
    promotion's broadcast would have hung until the collectives' timeout."""
    p = skewed(tmp_path / "apart", "decision", "--outer_steps", "1")
    assert p.returncode != 0
    err = p.stderr
    assert "step 0's decision differs between ranks: rank 0: {" in err and "; rank 1: {" in err, \
        err[-3000:]
    assert err.count("differs between ranks") == 1, err[-3000:]   # printed by rank 0 alone


def test_a_nan_reward_is_one_decision_and_an_unkept_student_stops_every_rank(tmp_path):
    """tests/skewed_groups.py SKEW=nan: at step 0 group 1's students measure NaN, so R holds NaN
    (the same on every rank: the ranks agree, NaN or not), the step does not promote (MA is NaN) and
    its teacher update is skipped as non-finite; at step 1 (--promote_every_step) the chosen student
    was not kept (can_promote made to say no): every rank stops with the error, printed once, where
    the chosen group alone raising would leave the other waiting in the broadcast"""
    out = tmp_path / "nan"
    p = skewed(out, "nan", "--outer_steps", "2")
    assert p.returncode != 0
    err = p.stderr
    assert "differs between ranks" not in err, err[-3000:]
    assert err.count("was not kept") == 1 and "promote: student (" in err, err[-3000:]
    assert "non-finite loss nan" in err and "update skipped" in err, err[-3000:]   # the teacher's
    [step0] = rows(out / "metrics.jsonl")
    assert any(math.isnan(x) for row in step0["R"] for x in row) and not step0["promoted"]
    assert all(math.isnan(rows(out / f"decide-rank{r}.jsonl")[0]["reward"]) for r in (0, 1))


@pytest.fixture(scope="module")
def opensir_two_turns(tmp_path_factory):
    """one run of two extras together: the OpenSIR-style reward and the two-turn teacher (they are
    independent: one scores the datasets, the other writes them)"""
    out = tmp_path_factory.mktemp("os") / "os"
    p = soar(out, "--reward", "opensir", "--teacher_turns", "2", "--outer_steps", "2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


def test_opensir_teacher(opensir_two_turns):
    """--reward opensir: no students; R_k is the mean of calibration (0 or 1) + 0.5 * novelty
    against the archive of earlier steps' questions, which the checkpoint carries"""
    out = opensir_two_turns
    metrics = rows(out / "metrics.jsonl")
    assert all(0.5 - 1e-9 <= r <= 1.5 for r in metrics[0]["R_k"])  # nothing archived yet: novelty 1
    assert not any(m["promoted"] for m in metrics) and all(len(m["R"][0]) == 1 for m in metrics)
    state = json.loads((out / "ckpt" / "step-2" / "state.json").read_text())
    # 2 steps of g*n
    assert len(state["archive"]) == 2 * 2 * 4 and all(q.strip() for q in state["archive"])


def test_a_teacher_without_valid_pairs_fails_cleanly(tmp_path):
    """(settings that cannot work: test_faults.test_bad_input_ends_in_one_line)"""
    p = soar(tmp_path / "d", "--teacher_max_tokens", "1", "--max_rejection_rounds", "2")
    assert p.returncode == 1 and "valid question-answer pairs" in p.stdout + p.stderr


@pytest.fixture(scope="module")
def lora_runs(lora_run, tmp_path_factory):
    """a LoRA run to the end (the session's, conftest.lora_run), and the same run killed once its
    step-1 checkpoint exists, then resumed"""
    whole, p = lora_run
    killed = tmp_path_factory.mktemp("lora") / "killed"
    k = soar(killed, *LORA, wait=False)
    wait_for(killed / "ckpt" / "step-1", k, delay=0.3)
    kill_all(k)
    resumed = soar(killed, *LORA)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return whole, killed, p.stdout, resumed.stdout


def test_lora_run_resumes_to_the_same_result(lora_runs):
    whole, killed, _, log = lora_runs
    assert "resuming at step" in log
    assert without_timing(rows(killed / "metrics.jsonl")) == \
        without_timing(rows(whole / "metrics.jsonl"))
    for name in ("pq.jsonl", "questions.jsonl"):
        assert rows(killed / name) == rows(whole / name), name


def test_lora_run_writes_adapters_only(lora_runs):
    out, _, log, _ = lora_runs
    assert [m["promotions"] for m in rows(out / "metrics.jsonl")] == [1, 2, 3]
    assert "LoRA rank 8 adapters of" in log and "PEFT adapter folders" in log
    for name in ("teacher", "student"):   # checkpoints: the adapter (teacher: and AdamW) alone
        assert os.listdir(out / "ckpt" / "step-3" / name) == ["adapter.pt"]
        folder = out / name   # PEFT folders on the base model, marked with their step
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
        assert (folder / "adapter_model.safetensors").exists() and \
            not (folder / "model.safetensors").exists()
        assert json.loads((folder / "soar.json").read_text()) == tag(name)


def test_two_turn_teacher_trains_both_turns(opensir_two_turns):
    """--teacher_turns 2 (METHOD.md "Two-turn teacher"): step 0's kept pairs, sampled again here
    from the base model with the run's seeds and p', are the run's questions.jsonl rows; the tokens
    the teacher update trained are both turns' of each pair (turn 1 alone would be fewer), and its
    loss is the RLOO loss over both turns' tokens with the pair's A_k (no KL at step 0: the
    teacher is still its reference)."""
    import subprocess
    out = opensir_two_turns
    m = rows(out / "metrics.jsonl")[0]
    code = ("import json, sys, data, launch, rloo, rloo_extras, world; rloo.init_distributed(); "
            "model = world.build_world(small=True)['model']; tok = launch.tokenizer(model); "
            "llm = rloo.build_engine(model, max_model_len=320); "
            "seeds = [rloo.seed_of(0, 0, 'teacher', i) for i in range(8)]; "
            "draw = rloo_extras.turns_of(llm, data.teacher_prompt(tok), max_tokens=96, "
            "temperature=1.0, "
            "answer_prompt=data.answer_prompt(tok, 'tag'), stop=data.QUESTION_STOP, "
            "turn_end=data.question_end); "
            "kept, _ = rloo.sample_until(draw, need=8, parse=data.parse_teacher_batch, "
            "round_seeds=seeds, what=''); "
            "print('KEPT', json.dumps([[pair, [[len(t.prompt_token_ids), len(t.token_ids)] "
            "for t in s]] for s, pair in kept]))")
    g = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert g.returncode == 0, g.stderr[-3000:]
    kept = json.loads(g.stdout.split("KEPT ", 1)[1])
    assert [pair for pair, _ in kept] == [[r["question"], r["answer"]]
                                          for r in rows(out / "questions.jsonl") if r["step"] == 0]
    assert all(len(turns) == 2 for _, turns in kept)
    trained = sum(prompt + new for _, turns in kept for prompt, new in turns)
    assert m["tokens/trained/teacher_update"] == trained
    assert trained > sum(prompt + new for _, turns in kept for prompt, new in turns[:1])
    R_k = m["R_k"]
    adv = [R_k[0] - R_k[1], R_k[1] - R_k[0]]   # g = 2: A_k = R_k - the other's
    tokens = [sum(new for _, new in turns) for _, turns in kept]
    pg = -sum(adv[i // 4] * t for i, t in enumerate(tokens)) / sum(tokens)   # n = 4 per dataset
    assert m["teacher_kl"] == pytest.approx(0, abs=1e-6)
    assert m["teacher_loss"] == pytest.approx(pg, abs=1e-6)
