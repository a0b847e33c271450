"""
The built-in small world: a problem family, a tiny Llama and its tokenizer, and the hard
problems it fails at (fail@128), all made here on CPU, so that the default run and the tests
need no GPU and no hub.

    python world.py [--out DIR] [--small] [--seed N]    # build (or reuse) and print the figures

The family is integer addition a + b, with the total number of digits as the difficulty knob
("level": 2 is 1+1 digits, 3 is 2+1, 4 is 2+2, 5 is 3+2, ...); answers are plain integers. The
model is trained from synthetic text in SOAR's real formats, on a mix weighted to the easy end
(5/8 of examples 1+1 digits, 2/8 2+1, 1/8 2+2): replies to the exact teacher prompt (through the
chat template), <question>...</question><answer>\boxed{...}</answer>, and solutions after the
student prompt that end "The final answer is: \boxed{...}.". It masters 1+1 digits (~90% of
samples right), is weak at 2+1 (~4%) and barely above guessing at 2+2 (~0.4%). The hard problems
are those of levels 3-4 it gets 0 of 128 samples right (METHOD.md "Data"), mostly 2+2 sums and 2+1
sums with a carry: at the edge of what it can do, so teacher questions around 2+1 and 2+2 digits
can move a student on them (a default SOAR run sees R > 0 at some steps).
"""
import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

import data  # the only import at the top: data.grade's workers re-import the main script, so torch
             # and vllm stay inside the functions that need them

# -----------------------------------------------------------------------------
# the problem family: a + b, difficulty = digits in all ("level": 2 = 1+1 digits, 3 = 2+1, 4 = 2+2, ...)
TEMPLATES = ("What is {a} + {b}?", "Compute {a} + {b}.", "Find the sum of {a} and {b}.")

# tokenizer: byte-level BPE, digits always single tokens (so numbers of any size are spelled the same way)
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB_SIZE = 1024           # an upper bound: the corpus saturates near 600
# no bos_token in the template and none added by the tokenizer: the same ids whether a caller
# tokenizes with or without special tokens, in training and in vLLM
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# model: a tiny Llama. head_dim 64 because vLLM's CPU attention kernels reject head_dim 16
MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=True)
MAX_MODEL_LEN = 320         # engine context: teacher prompt ~150 tokens + a 48-token reply fits easily

# training: plain AdamW, linear warmup then cosine. Data parallel over TRAIN_PROCS processes of one
# thread each: on a busy 2-core box two spin-waiting torch threads in one process run ~20x slower
LR = 3e-3                   # big, as suits a model this small (1e-2 was worse, 1e-3 slower)
WARMUP = 30
BATCH = 64                  # examples per step, over all processes
TEACHER_FRACTION = 0.25     # of each batch: teacher replies; the rest student solutions
TRAIN_PROCS = 2

# measuring
MAX_TOKENS = 48             # both formats end (EOS) well within this
TEACHER_SAMPLES = 64        # teacher prompt samples for the valid-pair rate
EASY_EVAL = 64              # easy problems for the student's greedy accuracy

# the two worlds. easy: the levels the model is trained on, drawn uniformly from the tuple, so a
# level listed n times gets n shares of the examples (the easy-accuracy check draws the same mix);
# hard: the levels the fail@k candidates are drawn from. Default: mostly 1+1 digits, a little 2+1
# and 2+2, so 2+1 stays weak (~4% of samples right) and 2+2 nearly out of reach (~0.4%); ~1/3 of
# level 3-4 candidates pass fail@128 (measured: 71 of 224), so the hard set sits at the edge of
# learnability (with levels 2-3 trained uniformly, every 2+1 sum was solved some of the time and
# 2+2 was out of reach: no student ever moved). Small: trained on 1+1 digits only, so it learns
# its easy end in fewer steps
SETTINGS = {
    "default": dict(easy=(2,) * 5 + (3, 3, 4), hard=(3, 4), steps=600, candidates=224, k=128),
    "small": dict(easy=(2,), hard=(3, 4), steps=300, candidates=32, k=32),
}
VERSION = 3                 # bump when the recipe changes: it is part of the cache key

# The settings of soar.py and eval.py on this world (used when no --model is given; their --help
# shows each next to the paper's default): the same algorithm with smaller numbers, for a tiny
# model on 2 CPU cores. A key means the same thing in both scripts.
PRESET = dict(
    # soar.py, the outer loop
    outer_steps=12, num_datasets=2, dataset_size=8, students=2, qr_size=32, inner_steps=4, inner_step_inc=2,
    teacher_lr=1e-3, teacher_warmup=2, learnability_samples=8,
    # both: students and sampling
    student_questions=4, student_samples=8, student_lr=1e-3, student_max_tokens=MAX_TOKENS,
    teacher_max_tokens=MAX_TOKENS, activation_checkpointing=False,
    # eval.py: fresh students, the fail@k filter, diversity
    student_steps=24, student_warmup=2, switch_step=6, big_group=16, teacher_questions=32, eval_every=4,
    ckpt_every=8, es_window=5, es_average=8, filter_samples=32, vendi_subset=32, vendi_draws=20)
# -----------------------------------------------------------------------------


def make_problem(rng: random.Random, level: int) -> dict:
    """a + b with `level` digits in all (level >= 2), split as evenly as possible: 2 is 1+1 digits,
    3 is 2+1, 4 is 2+2, 5 is 3+2, ... The answer is the plain integer."""
    def num(d):
        return rng.randrange(10 ** (d - 1) if d > 1 else 0, 10 ** d)
    a, b = num((level + 1) // 2), num(level // 2)
    if rng.random() < 0.5:
        a, b = b, a
    return {"question": rng.choice(TEMPLATES).format(a=a, b=b), "answer": str(a + b), "a": a, "b": b}


def student_solution(p: dict) -> str:
    """what follows the student prompt's 'Assistant:' (the trainer adds EOS)"""
    return f" {p['a']} + {p['b']} = {p['answer']}. The final answer is: \\boxed{{{p['answer']}}}."


def teacher_reply(p: dict) -> str:
    return f"<question>{p['question']}</question><answer>\\boxed{{{p['answer']}}}</answer>"


# -----------------------------------------------------------------------------
# tokenizer and model

def build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = random.Random(seed)
    probs = [make_problem(rng, rng.randint(2, 8)) for _ in range(500)]
    corpus = [data.TEACHER_PROMPT, data.STUDENT_PROMPT] * 50 + \
             [p["question"] + student_solution(p) + teacher_reply(p) for p in probs]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 model_max_length=MAX_MODEL_LEN)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def train_model(model_dir: str, easy: tuple, steps: int, seed: int) -> None:
    """Train a fresh tiny Llama on SOAR's two formats, levels drawn from easy, and save it next to the
    tokenizer in model_dir. Data parallel over TRAIN_PROCS processes (gloo): same result as one
    process with the whole batch, up to float summation order."""
    import torch.multiprocessing as mp
    import rloo
    port = rloo.free_port()
    mp.spawn(_train_rank, args=(TRAIN_PROCS, port, model_dir, easy, steps, seed), nprocs=TRAIN_PROCS)


def _train_rank(rank: int, world: int, port: int, model_dir: str, easy: tuple, steps: int, seed: int):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    data.die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)  # the same initial weights on every rank
    rng = random.Random(seed * 1000 + rank + 1)  # its own examples on every rank
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **MODEL))
    eos = tok.eos_token_id
    # Every example starts with one of two long fixed prompts (~150 and ~75 tokens) and what is
    # learnt is ~30 tokens, so each fixed prefix runs once per batch and its keys and values are
    # shared by all rows (gradients flow through them): the same loss for ~4x less compute.
    # The teacher prompt is all prefix; the student prompt is, up to "User:".
    t_prefix = data.teacher_prompt(tok)
    s_prefix = _ids(tok, data.STUDENT_PROMPT.split("{question}")[0].rstrip())

    def problem():
        return make_problem(rng, rng.choice(easy))

    def student_row(p):
        full = _ids(tok, data.student_prompt(p["question"]))
        assert full[:len(s_prefix)] == s_prefix, "the student prompt's head must tokenize on its own"
        return full[len(s_prefix):], _ids(tok, student_solution(p)) + [eos]

    def loss_sum(prefix, rows):
        """summed next-token loss over the completions of rows = [(prompt tail ids, completion ids)]"""
        n = len(rows)
        cache = model(input_ids=torch.tensor([prefix[:-1]]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(n)
        seqs = [[prefix[-1]] + tail + comp for tail, comp in rows]
        L = max(map(len, seqs))
        ids = torch.full((n, L), tok.pad_token_id)
        mask = torch.zeros((n, L), dtype=torch.long)
        labels = torch.full((n, L), -100)
        for i, ((tail, comp), s) in enumerate(zip(rows, seqs)):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
            labels[i, len(tail):len(s) - 1] = torch.tensor(comp)  # position j predicts token j + 1
        mask = torch.cat([torch.ones((n, len(prefix) - 1), dtype=torch.long), mask], 1)
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), int((labels >= 0).sum())

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    n_teacher = round(BATCH * TEACHER_FRACTION) // world
    n_student = BATCH // world - n_teacher
    t0 = time.time()
    for step in range(steps):
        lr = LR * min(1.0, (step + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        lt, nt = loss_sum(t_prefix, [([], _ids(tok, teacher_reply(problem())) + [eos]) for _ in range(n_teacher)])
        ls, ns = loss_sum(s_prefix, [student_row(problem()) for _ in range(n_student)])
        # mean over all tokens of all ranks: sum the counts, then sum the gradients of loss_sum / count
        counts = torch.tensor([nt, ns, lt.item(), ls.item()], dtype=torch.float64)
        dist.all_reduce(counts)
        opt.zero_grad(set_to_none=True)
        ((lt + ls) / (counts[0] + counts[1]).item()).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if rank == 0 and (step % 50 == 0 or step == steps - 1):
            print(f"train step {step:4d}  loss teacher {counts[2] / counts[0]:.3f} student {counts[3] / counts[1]:.3f}"
                  f"  {time.time() - t0:.0f}s", flush=True)
    if rank == 0:
        model.save_pretrained(model_dir)  # safetensors, next to the tokenizer
    dist.destroy_process_group()


# -----------------------------------------------------------------------------
# measuring, with the project's own engine and grader

def measure(model_dir: str, s: dict, seed: int, log=print) -> tuple[dict, list[dict], list[int]]:
    """The world's figures, with rloo's engine and data's parser and grader: valid teacher pairs,
    greedy accuracy on the easy end, sampled accuracy per difficulty, and the fail@k filter.
    Returns (stats, fail@k candidates, their correct counts)."""
    import rloo  # here, not at the top: see the import of data
    rloo.init_distributed()  # a 1-rank group: build_engine's external_launcher wants one
    llm = rloo.build_engine(model_dir, max_model_len=MAX_MODEL_LEN, seed=seed)
    rng = random.Random(seed + 2)
    t0 = time.time()
    teacher = rloo.generate(llm, [data.teacher_prompt(llm.get_tokenizer())], n=TEACHER_SAMPLES,
                            max_tokens=MAX_TOKENS, seed=seed)[0]
    pairs = data.parse_teacher_batch([x.text for x in teacher])
    valid = sum(p is not None for p in pairs) / len(pairs)
    log(f"teacher: {valid:.0%} valid pairs, e.g. {teacher[0].text!r}")
    easy = [make_problem(rng, d) for d in s["easy"] for _ in range(EASY_EVAL // len(s["easy"]))]
    counts = rloo.correct_counts(llm, easy, n=1, max_tokens=MAX_TOKENS, seed=seed, temperature=0.0)
    easy_acc = sum(counts) / len(easy)
    log(f"student: {easy_acc:.0%} greedy accuracy on {len(easy)} easy problems")
    sampled = {}  # where the learning signal lives: accuracy at T = 1 along the difficulty knob
    for d in range(2, max(s["hard"]) + 1):
        c = rloo.correct_counts(llm, [make_problem(rng, d) for _ in range(16)], n=16, max_tokens=MAX_TOKENS,
                                seed=seed + d)
        sampled[d] = sum(c) / (16 * 16)
    log("student: sampled accuracy (T=1) by level " + ", ".join(f"{d}: {a:.1%}" for d, a in sampled.items()))
    candidates, seen = [], set()
    while len(candidates) < s["candidates"]:  # distinct questions from the hard end
        p = make_problem(rng, rng.choice(s["hard"]))
        if p["question"] not in seen:
            seen.add(p["question"])
            candidates.append(p)
    counts = rloo.correct_counts(llm, candidates, n=s["k"], max_tokens=MAX_TOKENS, seed=seed + 100)
    kept = sum(c == 0 for c in counts)
    log(f"fail@{s['k']}: {kept} of {len(candidates)} candidates (levels {'/'.join(map(str, s['hard']))}) "
        f"have 0 correct; measuring took {time.time() - t0:.0f}s")
    stats = dict(valid_pair_rate=valid, easy_greedy_accuracy=easy_acc, sampled_accuracy_by_level=sampled)
    return stats, candidates, counts


# -----------------------------------------------------------------------------
# building (once per recipe, cached)

def build_key(small: bool, seed: int) -> str:
    """What the world depends on: the recipe above and the prompts it is trained on."""
    recipe = dict(version=VERSION, settings=SETTINGS["small" if small else "default"], seed=seed,
                  templates=TEMPLATES, model=MODEL, vocab=VOCAB_SIZE, chat_template=CHAT_TEMPLATE,
                  train=[LR, WARMUP, BATCH, TEACHER_FRACTION, TRAIN_PROCS], max_tokens=MAX_TOKENS,
                  eval=[TEACHER_SAMPLES, EASY_EVAL], prompts=[data.TEACHER_PROMPT, data.STUDENT_PROMPT])
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _paths(out: str) -> dict:
    return {"model": os.path.join(out, "model"), "train": os.path.join(out, "train.jsonl"),
            "test": os.path.join(out, "test.jsonl"), "stats": os.path.join(out, "stats.json")}


def _build_here(out: str, small: bool, seed: int) -> None:
    """The whole build in this process, into `out` (the caller renames it into place)."""
    t0 = time.time()
    s = SETTINGS["small" if small else "default"]
    paths = _paths(out)
    tok = build_tokenizer(seed)
    tok.save_pretrained(paths["model"])
    train_model(paths["model"], s["easy"], s["steps"], seed)
    train_s = time.time() - t0
    stats, candidates, counts = measure(paths["model"], s, seed)
    hard = [{"question": p["question"], "answer": p["answer"]} for p, c in zip(candidates, counts) if c == 0]
    train, test = data.split_train_test(hard, seed)
    data.write_jsonl(paths["train"], train)
    data.write_jsonl(paths["test"], test)
    stats.update(key=build_key(small, seed), small=small, seed=seed, settings=s, model=MODEL,
                 params=_param_count(paths["model"]), vocab=len(tok),
                 candidates=len(candidates), hard=len(hard), train=len(train), test=len(test),
                 candidate_correct_counts=counts, train_seconds=round(train_s, 1),
                 build_seconds=round(time.time() - t0, 1))
    with open(paths["stats"], "w") as f:
        json.dump(stats, f, indent=1)


def _param_count(model_dir: str) -> int:
    from safetensors.torch import load_file
    return sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())


# torchrun's variables: the build runs as its own 1-rank job whoever calls it
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def build_world(out_dir: str | None = None, small: bool = False, seed: int = 0) -> dict:
    """Build the world (or reuse a finished one) and return its paths: model (HF folder),
    train / test (hard problems, jsonl), stats (json).

    The build runs in a child process: it gets its own 1-rank vLLM engine and process group
    whatever the caller runs under (torchrun, pytest), and frees all of it on exit. It writes into
    a temporary folder renamed into place at the end, so a folder under the final name is finished."""
    key = build_key(small, seed)
    out = os.path.abspath(out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache",
                                                   f"world-{'small' if small else 'default'}-{key}"))
    paths = _paths(out)
    if not os.path.exists(paths["stats"]):
        if os.path.exists(out):
            raise FileExistsError(f"{out} exists but is not a finished world (no stats.json); remove it")
        tmp = f"{out}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
        cmd = [sys.executable, os.path.abspath(__file__), "--here", "--out", tmp, "--seed", str(seed)]
        try:
            subprocess.run(cmd + ["--small"] * small, env=env, check=True)
            os.rename(tmp, out)
        except OSError:
            if not os.path.exists(paths["stats"]):  # else another process finished it first: use theirs
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with open(paths["stats"]) as f:
        stats = json.load(f)
    if stats["key"] != key:
        raise ValueError(f"{out} holds a world built with other settings (key {stats['key']}, want {key})")
    return paths


def build_world_all_ranks(small: bool = False) -> dict:
    """build_world from every rank of a torch.distributed job: rank 0 builds it (or finds it built)
    while the others wait, then they reuse it."""
    import torch.distributed as dist
    paths = build_world(small=small) if dist.get_rank() == 0 else None
    dist.barrier()
    return paths or build_world(small=small)


def resolve(cfg):
    """cfg with the built-in world's model and hard splits filled in when it names no --model (rank 0
    of a torch.distributed job builds the world, cached, while the others wait); else cfg as is."""
    if cfg.model:
        return cfg
    import dataclasses
    import rloo
    rloo.init_distributed()
    paths = build_world_all_ranks(small=cfg.world == "small")
    return dataclasses.replace(cfg, model=paths["model"], **{k: getattr(cfg, k) or paths[k] for k in ("train", "test")
                                                             if hasattr(cfg, k)})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder of the world (default: .cache/world-<kind>-<hash>)")
    p.add_argument("--small", action="store_true", help="the smaller, faster world of the tests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # build_world's child
    a = p.parse_args()
    if a.here:   # build_world's child: it must not outlive the process that waits for it
        data.die_with_parent()
        return _build_here(a.out, a.small, a.seed)
    paths = build_world(a.out, a.small, a.seed)
    with open(paths["stats"]) as f:
        st = json.load(f)
    print(f"world: {paths['model']}  ({st['params'] / 1e6:.2f} M parameters, vocab {st['vocab']})")
    print(f"  valid teacher pairs {st['valid_pair_rate']:.0%}, easy greedy accuracy {st['easy_greedy_accuracy']:.0%}")
    print("  sampled accuracy by level: " +
          ", ".join(f"{d}: {a:.1%}" for d, a in st["sampled_accuracy_by_level"].items()))
    print(f"  fail@{st['settings']['k']}: {st['hard']} of {st['candidates']} hard candidates -> "
          f"{st['train']} train ({paths['train']}), {st['test']} test ({paths['test']})")
    print(f"  built in {st['build_seconds']:.0f}s (training {st['train_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
