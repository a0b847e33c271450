"""Algorithm 1's decisions on hand-built reward tables (pure logic, no engine)."""
import dataclasses
import json
import os
import re

import pytest

import launch
import data
import rloo
import soar
import world
from soar import (Config, decide, inner_steps, learnability, moving_average, promotion,
                  teacher_advantages)


def test_inner_step_schedule():
    cfg = Config()
    assert [inner_steps(cfg, p) for p in range(5)] == [10, 15, 20, 20, 20]


def test_moving_average_needs_full_window():
    assert moving_average([0.1, 0.2], 3) is None
    assert moving_average([0.5, 0.1, 0.2, 0.3], 3) == pytest.approx(0.2)
    assert moving_average([0.4], 1) == 0.4


def test_promotion_argmax_and_lower_middle_median():
    R = [[0.00, 0.02, 0.01, 0.03],    # R_0 = 0.015
         [0.05, -0.02, 0.04, 0.01],   # R_1 = 0.02  <- argmax; sorted: -0.02, 0.01, 0.04, 0.05
         [0.00, 0.00, 0.00, 0.00]]
    # lower middle of 4 is the 2nd smallest: 0.01 at j=3
    assert promotion(R, ma=0.02, tau=0.01) == (1, 3)
    assert promotion(R, ma=0.01, tau=0.01) is None      # strictly greater than tau
    assert promotion(R, ma=None, tau=0.01) is None
    # r odd: the median
    assert promotion([[0.1, 0.3, 0.2], [0.0, 0.0, 0.0]], ma=0.5, tau=0.01) == (0, 2)


def test_decide_window_and_reset():
    tau, w = 0.01, 3
    good = [[0.03, 0.01], [0.02, 0.04]]          # Rhat = 0.025
    flat = [[0.0, 0.0], [0.0, 0.0]]
    h = []
    reward, ma, chosen, h = decide(h, good, w, tau)
    assert (reward, ma, chosen) == (pytest.approx(0.025), None, None)  # window not full yet
    _, ma, chosen, h = decide(h, flat, w, tau)
    assert ma is None and chosen is None
    _, ma, chosen, h = decide(h, good, w, tau)
    assert ma == pytest.approx(0.05 / 3) and chosen == (1, 0) and h == []   # promoted: window reset
    for _ in range(2):                       # the next promotion needs a full post-promotion window
        _, ma, chosen, h = decide(h, good, w, tau)
        assert chosen is None and ma is None
    _, ma, chosen, h = decide(h, good, w, tau)
    assert chosen == (1, 0)
    _, _, chosen, h = decide(h, flat, w, tau)
    _, _, chosen, h = decide(h, flat, w, tau)
    _, ma, chosen, h = decide(h, good, w, tau)
    assert ma == pytest.approx(0.025 / 3) and chosen is None   # below tau: kept, sliding
    assert len(h) == 3


def test_teacher_advantages_leave_one_out():
    adv = teacher_advantages([0.1, 0.0, -0.1, 0.2])
    assert adv == pytest.approx([0.1 - 0.1 / 3, 0.0 - 0.2 / 3, -0.1 - 0.3 / 3, 0.2 - 0.0])
    assert sum(adv) == pytest.approx(0.0)    # why rejection sampling is exact (paper Prop. 1)


def test_promote_every_step_promotes_whatever_ma_and_tau_but_not_on_nan():
    """--promote_every_step (the end-to-end tests' promotions): the rule's choice of student at
    every step, with the window not yet full and tau out of reach; a NaN step reward does not
    promote; every step keeps its candidates"""
    R = [[0.1, 0.3, 0.2], [0.0, 0.0, 0.0]]
    reward, ma, chosen, history = decide([], R, 3, 1.0, every_step=True)
    assert ma is None and chosen == promotion(R, ma=2.0, tau=1.0) == (0, 2) and history == []
    nan = [[float("nan")], [0.0]]
    assert decide([], nan, 1, -1.0, every_step=True)[2] is None
    cfg = Config(window=3, tau=1.0, promote_every_step=True)
    assert soar.can_promote(cfg, []) and not soar.can_promote(
        Config(promote_every_step=True, reward="learnability"), [])


def test_can_promote_only_when_the_window_can_pass_tau():
    cfg = Config(window=3, tau=0.01)
    # the window cannot be full yet
    assert not soar.can_promote(cfg, []) and not soar.can_promote(cfg, [0.1])
    assert soar.can_promote(cfg, [0.1, 0.2]) and soar.can_promote(cfg, [0.0] * 7)
    assert not soar.can_promote(Config(window=3, tau=0.5), [-0.3, -0.3])   # (-0.6 + 1) / 3 <= 0.5
    assert soar.can_promote(Config(window=1), []) and \
        not soar.can_promote(Config(window=1, tau=1.0), [])
    assert not soar.can_promote(Config(window=1, reward="learnability"), [0.5])


def test_a_chosen_student_that_was_not_kept_is_an_error(monkeypatch):
    """promote on a group (here the only one) that kept no snapshot of the chosen student, as after
    a reward above 1 that can_promote did not foresee: an error, not another student in its place.
    The group's last student needs no snapshot: it is still in run.student (None). (One rank: its
    all_gather is its own value; test_soar_e2e has every rank raise.)"""
    monkeypatch.setattr(soar.rloo, "all_gather", lambda obj, group=None: [obj])
    class Mesh:   # one group of one rank
        def __getitem__(self, name):
            return self

        def size(self):
            return 1

        def get_local_rank(self, name):
            return 0

    cfg = Config(num_datasets=2, students=2)
    run = type("Run", (), dict(mesh=Mesh(), theta={}))()
    assert soar.my_students(cfg, run) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(RuntimeError, match=r"student \(0, 1\) was not kept"):
        soar.promote(cfg, run, (0, 1), candidates={(1, 0): {}, (1, 1): None})


def test_settings_that_cannot_work_are_named_by_flag():
    ok = Config(train="t.jsonl")
    assert launch.check_settings(ok, world_size=32, n_hard=359, seq_len=1200,
                                 trains_students=True) == []
    bad = Config(train="t.jsonl", outer_steps=0, window=0, qr_size=400, student_groups=3,
                 student_samples=1, micro_batch_tokens=512)
    problems = " | ".join(launch.check_settings(bad, world_size=32, n_hard=359, seq_len=1200,
                                               trains_students=True))
    for flag in ("--outer_steps 0", "--window 0", "--qr_size 400",
                 "--student_groups 3 does not divide the 32 ranks", "--student_samples 1",
                 "--micro_batch_tokens 512 is less than one sequence "
                 "(prompt + completion: up to 1200 tokens)"):
        assert flag in problems
    assert "more groups than the g*r = 16 students" in \
        launch.check_settings(Config(train="t", student_groups=32), 32, 359, 1, True)[0]
    assert launch.check_settings(Config(train="t", students=0), 32, 359, 1, True) == \
        ["--students 0: need r >= 1 per dataset"]   # not "max() arg is an empty sequence"


def test_a_layout_that_cannot_fit_is_named_before_anything_loads(tmp_path):
    """launch.check_settings on a GPU of a given size (a fake one: these are CPU tests), from the 3B
    and 7B configs bench_rloo.py knows: the paper's 32 H200s fit, one node of 8 H100s does not and
    the line names the figures and the flags that make it fit (launch.memory_per_rank)"""
    import importlib.util
    import os
    from transformers import LlamaConfig
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "bench_rloo.py")
    spec = importlib.util.spec_from_file_location("bench_rloo", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for shape in ("llama3b", "qwen7b"):
        LlamaConfig(**{"tie_word_embeddings": True, **bench.SHAPES[shape]}).save_pretrained(
            tmp_path / shape)
    def check(shape, W, gpu_gib, **flags):
        cfg = Config(train="t", model=str(tmp_path / shape), **flags)
        return launch.check_settings(cfg, W, 359, 1200, True, gpu_gib=gpu_gib)
    def fixes(line):   # the flags a line suggests, as keyword arguments
        return [{name: type(getattr(Config, name))(value)} for name, value in
                re.findall(r"--(\w+) (\S+)", line.split("it fits with ")[1])]

    def suggests(shape, W, gpu_gib, want, **flags):
        """the line names `want`, and each flag it suggests fits by the same estimate"""
        [line] = check(shape, W, gpu_gib, **flags)
        assert line.endswith("it fits with " + want), line
        for fix in fixes(line):
            assert check(shape, W, gpu_gib, **{**flags, **fix}) == [], (line, fix)
        return line

    assert check("llama3b", 32, 139.0) == []   # docs/scale.md: ~85 of 139 GiB
    assert check("llama3b", 8, 139.0) == []
    line = suggests("llama3b", 8, 79.0, "--student_groups 4 or --lora_rank 32")   # a whole student
    assert line.startswith("the layout needs ~98 GiB per rank of a 79 GiB GPU (engine 23.7, "
                           "policies 40.4, gradients 12.0, references 6.7, activations 11.9, "
                           "context 3.0")
    assert check("llama3b", 1, 79.0, lora_rank=32) == []   # LoRA: one H100 holds 16 students
    assert "~199 GiB" in suggests("qwen7b", 8, 139.0, "--student_groups 4 or --lora_rank 32")
    # 16 groups of 2 do not fit, 8 groups of 4 do
    assert "~100 GiB" in suggests("qwen7b", 32, 79.0, "--student_groups 8 or --lora_rank 32",
                                  kl_coef=0.0)
    # 65536-token micro-batches: 32 GiB of activations, 12 of them fixed or the head's (the
    # 16384 of the paper's settings would fit, by the per-token part alone)
    suggests("llama3b", 32, 79.0, "--student_groups 8 or --lora_rank 32 or --micro_batch_tokens "
             "32768", micro_batch_tokens=65536)
    line = suggests("llama3b", 32, 79.0, "--student_groups 8 or --lora_rank 32 or "
                    "--micro_batch_tokens 4096 or --gpu_memory_utilization 0.45",
                    gpu_memory_utilization=0.5)
    assert "~83 GiB" in line
    # host RAM: theta and the candidates, fp32 shards, g*r*4N/W bytes a rank (~24 GiB on 8 GPUs),
    # within half a rank's RAM: a node of 8 with 512 GiB holds them, one with 256 does not
    def host(W, host_gib, **flags):
        cfg = Config(train="t", model=str(tmp_path / "llama3b"), **flags)
        return launch.check_settings(cfg, W, 359, 1200, True, gpu_gib=139.0, host_gib=host_gib)
    assert host(8, 512 / 8) == [] and host(32, 256 / 8) == []
    [line] = host(8, 256 / 8)
    assert line.startswith("theta and the promotion candidates need ~24 GiB of host RAM per rank") \
        and line.endswith("it fits with --lora_rank 32")
    assert host(8, 256 / 8, lora_rank=32) == []
    # LoRA's GPU memory: every adapter held (12 bytes a parameter), and the gradients of the one
    # that trains twice (its flat copy for the all-reduce)
    config3b = LlamaConfig(**bench.SHAPES["llama3b"])
    est = launch.memory_per_rank(config3b, gpu_gib=80.0, engine_share=0.3, policy_ranks=[1],
                                 lora_rank=32, adapters=3)
    a = launch.lora.adapter_parameters(config3b, 32)
    assert est["adapters"] == pytest.approx((3 * 12 + 2 * 4) * a / launch.GIB)
    # the activations: a fixed part, the head's chunk and a part per token (docs/scale.md)
    config = LlamaConfig(**bench.SHAPES["llama3b"])
    assert launch.activation_gib(config, 16384, True) == pytest.approx(11.9, abs=0.05)   # measured
    assert launch.activation_gib(config, 8192, True) > 11.9 / 2 + 2.5


def test_the_engine_is_sized_for_an_inner_step(monkeypatch):
    """launch.step_engine_args (GPU only) and launch.kv_line: the paper's layout, 16 groups of 2
    ranks, one student each, puts 128 rollouts of up to 1152 tokens on a rank: 147456 tokens, more
    than the ~120k an H100's 30% holds (a warning naming the flag), less than an H200's"""
    cfg = Config()
    seqs = launch.step_sequences(cfg, 32, 16, 1)
    assert seqs == 8 * 32 // 2 == 128
    # LoRA: a group's 2 students at once
    assert launch.step_sequences(Config(lora_rank=32), 8, 8, 2) == 2 * 8 * 32
    assert launch.step_engine_args(seqs, 128) == {}   # CPU: build_engine's own settings
    monkeypatch.setattr(rloo.torch.cuda, "is_available", lambda: True)
    assert launch.step_engine_args(seqs, 128) == dict(max_num_seqs=128,
                                                      max_num_batched_tokens=16384)
    assert launch.step_engine_args(4, 100) == dict(max_num_seqs=4, max_num_batched_tokens=2048)
    assert launch.step_engine_args(256, 128)["max_num_batched_tokens"] == 16384   # vLLM's default
    short = launch.kv_line(120_000, seqs, 1152)
    assert short.startswith("engine: KV cache 120000 tokens per rank; an inner step needs up to "
                            "147456 (128 rollouts x 1152 tokens); warning: 1.2x the cache")
    assert "--gpu_memory_utilization" in short and "--student_groups" in short
    assert "warning" not in launch.kv_line(300_000, seqs, 1152)


def test_opensir_reward_ranks_calibrated_novel_questions_first():
    archive = ["What is 12 + 30?", "Find the sum of 4 and 9."]
    qs = ["How many primes are below 20?",      # novel, calibrated (s = 0.5)
          "How many primes are below 20?",      # novel, solved every time (s = 1)
          "What is 12 + 30?",                   # calibrated, but a repeat of an archived question
          "Compute the product 7 * 6."]         # novel, never solved (s = 0)
    r = soar.opensir([0.5, 1.0, 0.5, 0.0], data.novelty(qs, archive))
    assert r[0] > r[1] and r[0] > r[2] and r[0] > r[3]
    # calibration is worth 1
    assert r[2] == pytest.approx(1.0) and r[1] == pytest.approx(r[0] - 1.0) and r[3] <= 0.5
    # nothing archived yet
    assert soar.opensir([0.5], data.novelty(qs[:1], [])) == [1.5]


def test_each_teacher_reward_is_a_function_of_one_datasets_measurements():
    """TEACHER_REWARDS on hand-built records: one reward per student, or one per dataset"""
    X = [("q1", "1"), ("q2", "2")]
    # student 2 was trained by a group whose engines measure Acc0 higher: its own Acc0 is subtracted
    T, F = True, False   # what each student, and the baseline where it was measured, solved of Q_R
    students = soar.Measured(X, solved=[[T, F, T, F], [T, F, F, F], [T, T, F, F]],
                             solved0=[[T, F, F, F], [F, F, F, T], [T, T, T, F]], solve_rates=[],
                             novelty=[])
    assert students.accs == [0.5, 0.25, 0.5] and students.acc0s == [0.25, 0.25, 0.75]
    baseline = soar.Measured(X, solved=[], solved0=[], solve_rates=[0.0, 0.5], novelty=[1.0, 0.2])
    rewards = soar.TEACHER_REWARDS
    assert rewards["grounded"].score(students) == [0.25, 0.0, -0.25]   # R_kj = Acc - Acc0
    assert rewards["learnability"].score(baseline) == [0.25]           # (0 + 0.5) / 2
    assert rewards["opensir"].score(baseline) == pytest.approx([(0.5 + 1.1) / 2])
    assert [name for name, r in rewards.items() if r.trains_students] == ["grounded"]


def test_learnability_reward():
    assert learnability([0.0, 0.25, 1.0, 0.5]) == pytest.approx((0 + 0.75 + 0 + 0.5) / 4)


def test_seeds_are_stable_and_distinct():
    assert rloo.seed_of(3, 5, "teacher", 0) == rloo.seed_of(3, 5, "teacher", 0) != \
        rloo.seed_of(4, 5, "teacher", 0)
    assert len({rloo.seed_of(3, s, "student", k) for s in range(20) for k in range(4)}) == 80


def test_restore_rows_puts_back_what_the_checkpoint_committed(tmp_path, capsys):
    ckpt = tmp_path / "ckpt" / "step-2"
    (ckpt / "rows").mkdir(parents=True)
    committed = "".join(json.dumps({"step": s}) + "\n" for s in range(2))
    (ckpt / "rows" / "metrics.jsonl").write_text(committed)
    (ckpt / "rows" / "pq.jsonl").write_text("")
    (tmp_path / "metrics.jsonl").write_text(committed + '{"step": 2}\n{"st')   # uncommitted, cut
    (tmp_path / "pq.jsonl").write_text("\x00 garbage\n")
    names = ["metrics.jsonl", "pq.jsonl", "questions.jsonl"]
    launch.restore_rows(str(tmp_path), str(ckpt), names)
    assert [(tmp_path / n).read_text() for n in names] == [committed, "", ""]
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'} differed from what {ckpt} committed (3 lines, 2 " \
        "committed)" in err
    assert "pq.jsonl differed" in err and "questions.jsonl" not in err   # it was only missing
    launch.restore_rows(str(tmp_path), None, names)   # no checkpoint: a fresh start, empty files
    assert [(tmp_path / n).read_text() for n in names] == ["", "", ""]


def test_hf_folders_behind_their_checkpoint(tmp_path):
    (tmp_path / "ckpt" / "step-3").mkdir(parents=True)
    data.write_json(str(tmp_path / "ckpt" / "step-3" / "state.json"), {"step": 3, "promotions": 1})
    tag = lambda name, step, promotions: data.write_json(  # noqa: E731
        str(tmp_path / name / "soar.json"), {"step": step, "promotions": promotions})
    tag("teacher", 3, 1)
    tag("student", 1, 1)   # written at the promotion of step 1, unchanged since: current
    assert launch.hf_behind(str(tmp_path)) == []
    tag("teacher", 2, 1)
    tag("student", 1, 0)
    assert launch.hf_behind(str(tmp_path)) == [
        f"{tmp_path / 'teacher'} (step 2, the checkpoint's 3)",
        f"{tmp_path / 'student'} (step 1, the checkpoint's 3)"]
    assert launch.hf_behind(str(tmp_path), {"step": 2, "promotions": 0}, ["student"]) == []


def test_parse_args_world_values_and_overrides():
    cfg = soar.parse_args(["--outer_steps", "3", "--activation_checkpointing"])
    assert cfg.model == "" and cfg.outer_steps == 3 and cfg.activation_checkpointing
    world_values = launch.world_values(Config)   # (what they are is the world's to choose)
    assert {"dataset_size", "inner_steps", "student_max_tokens"} <= world_values.keys()
    given = {"outer_steps", "activation_checkpointing"}
    assert all(getattr(cfg, k) == v for k, v in world_values.items() if k not in given)
    assert cfg.student_max_tokens == world.MAX_TOKENS
    assert "num_datasets" not in world_values and cfg.num_datasets == 4   # the paper's
    paper = soar.parse_args(["--model", "m", "--train", "t.jsonl"])
    assert (paper.num_datasets, paper.dataset_size, paper.students, paper.qr_size,
            paper.outer_steps, paper.tau) == (4, 64, 4, 64, 200, 0.01)
    with pytest.raises(SystemExit):
        soar.parse_args(["--reward", "vibes"])
    reward = next(f for f in dataclasses.fields(Config) if f.name == "reward")
    assert reward.metadata["choices"] == tuple(soar.TEACHER_REWARDS)   # --reward's are the table's


def test_one_vocabulary_and_help(capsys, monkeypatch):
    """a setting both scripts have keeps its name, type and default in both, and every flag's help
    shows its meaning, its default and the built-in world's value"""
    import dataclasses
    import eval as ev
    s, e = ({f.name: f for f in dataclasses.fields(c)} for c in (Config, ev.Config))
    shared = s.keys() & e.keys()
    assert {"student_lr", "student_max_tokens", "student_samples", "student_questions",
            "train"} <= shared
    assert all((s[k].type, s[k].default, s[k].metadata["world"]) ==
               (e[k].type, e[k].default, e[k].metadata["world"]) for k in shared - {"out"})
    assert not {"steps", "lr", "hard", "max_tokens", "samples", "questions"} & (s.keys() | e.keys())
    monkeypatch.setenv("COLUMNS", "400")   # no wrapping inside a help text
    with pytest.raises(SystemExit):
        soar.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"--student_lr FLOAT AdamW, cosine over S, no warmup (default 1e-05; built-in world " \
        f"{launch.world_values(Config)['student_lr']})" in text
    assert "--tau FLOAT promotion threshold on the moving average (default 0.01)" in text


def test_flags_survive_torchrun():
    """torchrun's parser takes any flag that abbreviates one of its own (--n, --r, --m...), even
    after the script name: no flag of ours may be a prefix of a torchrun option."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"],
                         capture_output=True, text=True).stdout
    theirs = {w.split("=")[0] for w in out.replace(",", " ").split() if w.startswith("--")}
    import dataclasses
    import eval as ev
    ours = {"--" + f.name for c in (Config, ev.Config) for f in dataclasses.fields(c)}
    assert len(theirs) > 20
    assert not {(a, b) for a in ours for b in theirs
                if b.startswith(a) or b.replace("-", "_").startswith(a)}


def test_wandb_that_cannot_start_is_one_line(monkeypatch, tmp_path):
    """--wandb online with no login: a one-line error naming the way out, not W&B's traceback"""
    import wandb
    wandb.teardown()   # a fresh W&B: an earlier test's, in this process, keeps its settings
    for k, v in (("WANDB_MODE", "online"), ("HOME", tmp_path), ("NETRC", tmp_path / "none")):
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(launch.UsageError,
                       match=r"^--wandb p: W&B did not start \(No API key.*offline$"):
        launch.tracker("p", "", str(tmp_path), {})


def test_a_value_edited_at_the_top_of_soar_py_is_the_run_s(tmp_path):
    """Both values of a flag, the paper's and the world's, stand where the flag is defined: edited
    in a copy of soar.py, they are what the copy's parse_args and its run use (a run of the copy
    refuses its edited world value, --dataset_size 0, before loading a model)."""
    import importlib.util
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "soar.py")).read()
    edited, n = re.subn(r"inner_steps: int = launch.flag\(\d+, world=\d+,",
                        "inner_steps: int = launch.flag(11, world=5,", text)
    assert n == 1
    edited, n = re.subn(r"dataset_size: int = launch.flag\((\d+), world=\d+,",
                        r"dataset_size: int = launch.flag(\1, world=0,", edited)
    assert n == 1
    copy = tmp_path / "soar.py"
    copy.write_text(edited)
    spec = importlib.util.spec_from_file_location("soar_copy", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_args([]).inner_steps == 5
    assert module.parse_args(["--model", "m", "--train", "t.jsonl"]).inner_steps == 11
    env = {**os.environ, "PYTHONPATH": root}
    p = subprocess.run([sys.executable, str(copy), "--world", "small", "--out",
                        str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == launch.USAGE_EXIT, p.stdout[-2000:] + p.stderr[-2000:]
    assert "--dataset_size 0: need at least 1" in p.stderr
    assert not (tmp_path / "run").exists()
