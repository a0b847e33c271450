"""The built-in small world: a problem family, a tiny Llama and its tokenizer, and the hard
problems it fails at (fail@128), all made here on CPU, so that the default run and the tests
need no GPU and no hub.

    python world.py [--small]                  # the world that ships (worlds/), its figures
    python world.py --ship [--small]           # rebuild it from this file, say if it is the same
    python world.py --out DIR [--seed N]       # build another (or reuse it) and print its figures

The default world and the tests' small one ship built, in worlds/default and worlds/small (a model,
its tokenizer, the hard split, the figures): every host runs the same world, which a host's CPU
would otherwise change (docs/world.md). They are checked against this file's recipe (build_key);
after a change to it, they must be rebuilt (--ship).

The family: small additions and subtractions, bare ("What is 12 - 3?") or as word problems of one to
four steps ("Tom has 12 apples. He gives away 3, then finds 2. How many apples does he have now?"),
solved left to right, one equation per step ("12 - 3 = 9. 9 + 2 = 11. The final answer is:
\\boxed{11}."). The tiny model is trained on SOAR's two formats:
  * teacher mode (replies to the teacher prompt through the chat template): it works a problem out
    first, outside the tags as the prompt allows, then poses it, so its answers are right;
  * student mode (solutions after the student prompt): right on bare problems and on "gets x more"
    steps, but it misreads "gives away x" and "finds x" steps (the training solutions add what is
    given away and take away what is found 80% of the time, a confusion between the verbs).
So the student solves one-step "gives away" problems some of the time and four-step ones never: the
hard set (fail@128 over four-step "gives away" problems) needs a reading that the easy problems
teach (a student trained by RL on one-step "gives away" problems reads the verb right, and its
greedy answers to the four-step ones turn right), and writing those easy problems takes no skill the
student lacks: the teacher writes them, answers right, as often as it likes. "finds" problems are as
learnable for the student, and useless for the hard set.

The build is reproducible: it pins threads and kernels in its own processes (PINNED_ENV), trains
with a fixed data order and seed, samples with fixed seeds, and prints a fingerprint of the hard
set (candidates are drawn in batches until each half holds the recipe's `need` problems)."""
import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter

import data  # the only import at the top: data.grade's workers re-import the main script, so torch
             # and vllm stay inside the functions that need them

# -----------------------------------------------------------------------------
# the problem family (the docstring above): kind "add" / "sub": bare, level 1; kind "word": level =
# its steps' signs ("+", "-+", ...); solutions work the steps out left to right, one equation each
START = (6, 20)             # a word problem's start; bare: the first number
STEP = (1, 5)               # every number added or taken away
KINDS = {"add": dict(template="What is {a} + {b}?"), "sub": dict(template="What is {a} - {b}?"),
         "word": dict(template="Tom has {a} apples. He {steps}. How many apples does he have now?")}
VERBS = {"+": "gets {x} more", "-": "gives away {x}", "f": "finds {x}"}   # "f": an addition too

# tokenizer: byte-level BPE, digits always single tokens (so numbers of any size are spelled alike)
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB_SIZE = 1024           # an upper bound: the corpus needs fewer
# no bos_token in the template and none added by the tokenizer: the same ids whether a caller
# tokenizes with or without special tokens, in training and in vLLM
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MAX_MODEL_LEN = 320         # engine context: teacher prompt ~150 tokens + a 96-token reply fits
MAX_TOKENS = 96             # both formats end (EOS) well within this

# Reproducibility: the build pins these in its own process (and its training children) whatever the
# caller's environment: one thread everywhere (summation order), ATen's portable kernels and MKL's
# conditional-numerical-reproducibility branch (the same float results on any x86 CPU with AVX2).
PINNED_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONHASHSEED": "0"}

# The recipes. student / teacher: the training mix of each format, as (kind, level, weight); hard:
# the (kind, level) pairs the fail@k candidates are drawn from; need: the least hard problems each
# half must hold (the defaults of soar.py and eval.py), candidates are drawn in batches until both
# halves have them.
RECIPES = {
    "default": dict(
        model=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                   max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                   tie_word_embeddings=True),
        student=[("add", 1, 3), ("sub", 1, 3), ("word", "?1", 2), ("word", "?2", 2),
                 ("word", "?3", 2), ("word", "?4", 1)],
        misread=0.8, student_steps=(1, 1, 1), teacher_steps=(6, 2, 2),
        teacher=[("add", 1, 1), ("sub", 1, 1), ("word", "?1", 1), ("word", "?2", 1),
                 ("word", "?3", 1), ("word", "?4", 1)],
        teacher_fraction=0.4, steps=1000, lr=3e-3, warmup=30, batch=64, procs=2,
        hard=[("word", "----")], k=128, need=32, batch_candidates=64, max_candidates=2048,
        teacher_samples=256, level_problems=8, level_samples=16,
        probe=[("add", 1), ("sub", 1), ("word", "+"), ("word", "-"), ("word", "f"), ("word", "++"),
               ("word", "--"), ("word", "+-+"), ("word", "ff"), ("word", "---"), ("word", "++++"),
               ("word", "----")]),
}
RECIPES["small"] = dict(   # the tests': formats and plumbing, not skill
    RECIPES["default"],
    student=[("add", 1, 3), ("sub", 1, 3), ("word", "?1", 2), ("word", "?2", 2)],
    teacher=[("add", 1, 1), ("sub", 1, 1), ("word", "?1", 1), ("word", "?2", 1)],
    steps=150, hard=[("word", "---")], k=32, need=8, batch_candidates=32, max_candidates=256,
    teacher_samples=64, level_samples=8,
    probe=[("add", 1), ("word", "+"), ("word", "-"), ("word", "---")])
VERSION = 6                 # part of the key: bump it when what the build calls outside world.py
                            # and data.py (the engine's sampling, rloo) changes; the rest is in it

# -----------------------------------------------------------------------------


def make_problem(rng: random.Random, kind: str, level, steps=(1, 1, 1)) -> dict:
    """a problem of the family (KINDS): every partial result >= 1, the answer a plain integer"""
    while True:
        a = rng.randint(*START)
        signs = "+" if kind == "add" else "-" if kind == "sub" else level
        if signs.startswith("?"):   # "?3": 3 steps of any kind, drawn with weights `steps`
            signs = "".join(rng.choices("+-f", weights=steps)[0] for _ in range(int(signs[1:])))
        xs = [rng.randint(*STEP) for _ in signs]
        vals = [a]
        for s, x in zip(signs, xs):
            vals.append(vals[-1] - x if s == "-" else vals[-1] + x)
        if min(vals) >= 1:
            break
    if kind == "word":
        steps = ", then ".join(VERBS[s].format(x=x) for s, x in zip(signs, xs))
        q = KINDS[kind]["template"].format(a=a, steps=steps)
    else:
        q = KINDS[kind]["template"].format(a=a, b=xs[0])
    return {"question": q, "answer": str(vals[-1]), "start": a, "signs": signs, "xs": xs,
            "kind": kind, "level": signs if kind == "word" else level}


def working(p: dict, misread=()) -> str:
    """the steps, left to right: 'a - x = b. b + y = c.'; `misread` steps add what they take away"""
    out = []          # the equations so far
    v = p["start"]    # the value they reach
    for i, (s, x) in enumerate(zip(p["signs"], p["xs"])):
        s = "-" if s == "-" else "+"            # "finds" adds
        if i in misread:
            s = "+" if s == "-" else "-"
        w = v + x if s == "+" else v - x
        out.append(f"{v} {s} {x} = {w}.")
        v = w
    return " ".join(out)


def student_solution(p: dict, misread=()) -> str:
    """what follows the student prompt's 'Assistant:' (the trainer adds EOS); with `misread` steps,
    the solution of a student who reads those "gives away" steps as additions (a wrong answer)"""
    w = working(p, misread)
    answer = w.rsplit("= ", 1)[1].rstrip(".")
    return f" {w} The final answer is: \\boxed{{{answer}}}."


def teacher_reply(p: dict) -> str:
    """the teacher works its problem out first, outside the tags (as the teacher prompt allows),
    then poses it"""
    return (f"{working(p)} <question>{p['question']}</question>"
            f"<answer>\\boxed{{{p['answer']}}}</answer>")


_BARE = re.compile(r"^What is (\d+) ([+-]) (\d+)\?$")
_WORD = re.compile(r"^Tom has (\d+) apples\. He (.+)\. How many apples does he have now\?$")
_VERB = re.compile(r"^(?:gets (\d+) more|gives away (\d+)|finds (\d+))$")


def classify(question: str) -> dict | None:
    """A question of the family, read back: kind, level, and the true answer; None for anything else
    (what the teacher writes is read with this, never executed)."""
    q = question.strip()
    m = _BARE.match(q)
    if m:
        a, s, x = int(m[1]), m[2], int(m[3])
        return dict(kind="add" if s == "+" else "sub", level=1,
                    answer=str(a + x if s == "+" else a - x))
    m = _WORD.match(q)
    if not m:
        return None
    v = int(m[1])   # the value so far
    signs = ""      # the signs of the steps read
    for part in m[2].split(", then "):
        st = _VERB.match(part)
        if not st:
            return None
        signs += "+" if st[1] else "-" if st[2] else "f"
        v = v - int(st[2]) if st[2] else v + int(st[1] or st[3])
    return dict(kind="word", level=signs, answer=str(v))


# The curriculum as eval.py's report shows it: what the teacher's questions are, by this world's
# design. Only the report reads this; soar.py knows nothing of it; the teacher sees only its prompt.
CATEGORIES = ("not of the family", "bare sum", "word, no 'gives away'", "word, with 'gives away'")
USEFUL = ("word, with 'gives away'",)   # what the hard set needs: reading "gives away x" as "- x"


def describe(question: str, answer: str | None = None) -> dict:
    """A teacher's question read back: well-posed (a problem of the family), its kind, number of
    steps, "gives away" steps, report category, and whether `answer` (the teacher's boxed answer) is
    correct."""
    c = classify(question)
    if c is None:
        return dict(well_posed=False, kind=None, steps=0, gives_away=0, category=CATEGORIES[0],
                    correct=False)
    word = c["kind"] == "word"
    steps = len(c["level"]) if word else 1
    away = c["level"].count("-") if word else 0
    category = CATEGORIES[1] if not word else CATEGORIES[3] if away else CATEGORIES[2]
    return dict(well_posed=True, kind=c["kind"], steps=steps, gives_away=away, category=category,
                correct=answer is not None and answer.strip() == c["answer"])


def draw(rng: random.Random, mix: list, steps=(1, 1, 1)) -> dict:
    """a problem from a mix [(kind, level, weight), ...]; steps: weights of "+-f" in "?n" levels"""
    kind, level, _ = rng.choices(mix, weights=[w for *_, w in mix])[0]
    return make_problem(rng, kind, level, steps)


# -----------------------------------------------------------------------------
# tokenizer and model

def build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = random.Random(seed)
    probs = [make_problem(rng, "word", "".join(rng.choice("+-") for _ in range(rng.randint(1, 3))))
             for _ in range(500)] + \
            [make_problem(rng, kind, 1) for kind in ("add", "sub") for _ in range(250)]
    corpus = [data.TEACHER_PROMPT, data.STUDENT_PROMPT] * 50 + \
             [p["question"] + student_solution(p) + teacher_reply(p) for p in probs]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", model_max_length=MAX_MODEL_LEN)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def train_model(model_dir: str, r: dict, seed: int) -> None:
    """Train a fresh tiny Llama on SOAR's two formats (recipe r) and save it next to the tokenizer
    in model_dir. Data parallel over r["procs"] processes (gloo) of one thread each: the result
    depends on the recipe and the seed only, not on the machine's cores."""
    import torch.multiprocessing as mp
    import rloo   # here, not at the top: see the import of data
    port = rloo.free_port()
    mp.spawn(_train_rank, args=(r["procs"], port, model_dir, r, seed), nprocs=r["procs"])


def _train_rank(rank: int, world: int, port: int, model_dir: str, r: dict, seed: int):
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    data.die_with_parent()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)  # the same initial weights on every rank
    rng = random.Random(seed * 1000 + rank + 1)  # its own examples on every rank
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, **r["model"]))
    eos = tok.eos_token_id
    # The teacher prompt is all prefix (_prefix_loss); the student prompt is, up to "User:".
    t_prefix = data.teacher_prompt(tok)
    s_prefix = _ids(tok, data.STUDENT_PROMPT.split("{question}")[0].rstrip())
    opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], betas=(0.9, 0.98), weight_decay=0.0)
    n_teacher = round(r["batch"] * r["teacher_fraction"]) // world
    n_student = r["batch"] // world - n_teacher
    steps = r["steps"]
    t0 = time.time()
    for step in range(steps):
        lr = (r["lr"] * min(1.0, (step + 1) / r["warmup"]) * 0.5 *
              (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        lt, nt = _prefix_loss(model, tok, t_prefix, [
            ([], _ids(tok, teacher_reply(draw(rng, r["teacher"], r["teacher_steps"]))) + [eos])
            for _ in range(n_teacher)])
        ls, ns = _prefix_loss(model, tok, s_prefix, [
            _student_row(tok, s_prefix, draw(rng, r["student"], r["student_steps"]), r["misread"],
                         rng)
            for _ in range(n_student)])
        # mean over all tokens of all ranks: sum the counts, then the gradients of the sums / count
        counts = torch.tensor([nt, ns, lt.item(), ls.item()], dtype=torch.float64)
        dist.all_reduce(counts)
        opt.zero_grad(set_to_none=True)
        ((lt + ls) / (counts[0] + counts[1]).item()).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if rank == 0 and (step % 100 == 0 or step == steps - 1):
            print(f"train step {step:4d}  loss teacher {counts[2] / counts[0]:.3f} "
                  f"student {counts[3] / counts[1]:.3f}  {time.time() - t0:.0f}s", flush=True)
    if rank == 0:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()   # its "Writing model shards" bar, for one tiny file
        model.save_pretrained(model_dir)  # safetensors, next to the tokenizer
    dist.destroy_process_group()


def _student_row(tok, s_prefix: list[int], p: dict, misread_rate: float, rng: random.Random):
    """(prompt ids after s_prefix, solution ids + EOS) of problem p; each "gives away" or "finds"
    step of a word problem is misread with probability misread_rate (the world's docstring)"""
    full = _ids(tok, data.student_prompt(p["question"]))
    assert full[:len(s_prefix)] == s_prefix, "the student prompt's head must tokenize on its own"
    misread = {i for i, sg in enumerate(p["signs"])
               if p["kind"] == "word" and sg in "-f" and rng.random() < misread_rate}
    return full[len(s_prefix):], _ids(tok, student_solution(p, misread)) + [tok.eos_token_id]


def _prefix_loss(model, tok, prefix: list[int], rows: list[tuple[list[int], list[int]]]):
    """(summed next-token loss over the completions, their token count); rows = [(prompt tail ids,
    completion ids)] after the shared prefix. Every example starts with one of two long fixed
    prompts (~150 and ~75 tokens) and what is learnt is ~30 tokens, so the prefix runs once and its
    keys and values are shared by all rows (gradients flow through them): the same loss for ~4x
    less compute."""
    import torch
    import torch.nn.functional as F
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
    return (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"),
            int((labels >= 0).sum()))


# -----------------------------------------------------------------------------
# measuring, with the project's own engine and grader

def _correct_counts(llm, problems, *, n, seed):
    """How many of n samples (student prompt, T = 1) are right, per problem: the project's own
    sampling and grading"""
    import rloo  # here, not at the top: see the import of data
    return rloo.count_correct(llm, problems, prompt=data.student_prompt, correct=data.solved, n=n,
                              max_tokens=MAX_TOKENS, seed=seed)


def teacher_profile(texts: list[str]) -> dict:
    """What a teacher wrote: the valid-pair rate (the format filter); per kind and level the share
    of valid pairs and how often the pair's answer is right; and per kind of word-problem step ("+"
    gets, "-" gives away, "f" finds) the share of valid pairs that have one."""
    pairs = data.parse_teacher_batch(texts)
    valid = [p for p in pairs if p is not None]
    per = {}   # kind and level -> (valid pairs, right answers)
    steps = {"+": 0, "-": 0, "f": 0}
    for q, a in valid:
        c = classify(q)
        key = f"{c['kind']}{c['level']}" if c else "other"
        n, right = per.get(key, (0, 0))
        per[key] = (n + 1, right + (c is not None and a.strip() == c["answer"]))
        if c and c["kind"] == "word":
            for s in set(c["level"]):
                steps[s] += 1
    n = max(1, len(valid))
    return dict(valid_pair_rate=len(valid) / max(1, len(texts)),
                answer_right=sum(r for _, r in per.values()) / n,
                with_step={s: k / n for s, k in steps.items()},
                share={k: c / n for k, (c, _) in sorted(per.items())},
                answer_right_by_level={k: r / c for k, (c, r) in sorted(per.items())})


def measure(model_dir: str, r: dict, seed: int, log=print) -> tuple[dict, list[dict], list[int]]:
    """The world's figures, with rloo's engine and data's parser and grader: what the teacher
    writes, the student's sampled accuracy per kind and level, and the fail@k filter over candidates
    drawn in batches until the hard set holds 2 * need problems. Returns (stats, candidates, correct
    counts)."""
    import torch
    torch.set_num_threads(1)  # before the engine: vLLM's CPU worker forbids changing it afterwards
    import rloo
    rloo.init_distributed()  # a 1-rank group: build_engine's external_launcher wants one
    llm = rloo.build_engine(model_dir, max_model_len=MAX_MODEL_LEN, seed=seed)
    t0 = time.time()
    prompt = data.teacher_prompt(llm.vllm.get_tokenizer())
    teacher = rloo.generate(llm, [prompt], n=r["teacher_samples"], max_tokens=MAX_TOKENS,
                            seed=seed)[0]
    prof = teacher_profile([x.text for x in teacher])
    log(f"teacher: {prof['valid_pair_rate']:.0%} valid pairs, e.g. {teacher[0].text!r}")
    log(f"teacher: answers right {prof['answer_right']:.0%}; pairs with a step of kind " +
        ", ".join(f"{k} {v:.0%}" for k, v in prof["with_step"].items()))
    rng = random.Random(seed + 2)
    sampled = {}  # where the learning signal lives: accuracy at T = 1 per kind and level
    cells = [tuple(x) for x in r["probe"]]
    for i, (kind, lv) in enumerate(cells):
        probs = [make_problem(rng, kind, lv) for _ in range(r["level_problems"])]
        c = _correct_counts(llm, probs, n=r["level_samples"], seed=seed + 1000 * i)
        sampled[f"{kind}{lv}"] = sum(c) / (len(probs) * r["level_samples"])
    log("student: sampled accuracy (T=1) " + ", ".join(f"{k} {a:.1%}" for k, a in sampled.items()))
    candidates = []
    counts = []   # per candidate: correct samples of r["k"]
    seen = set()
    crng = random.Random(seed + 3)
    while sum(c == 0 for c in counts) < 2 * r["need"]:
        if len(candidates) >= r["max_candidates"]:
            raise RuntimeError(f"only {sum(c == 0 for c in counts)} of {len(candidates)} "
                               f"candidates pass fail@{r['k']}; the recipe needs {2 * r['need']}")
        batch = []
        while len(batch) < r["batch_candidates"]:  # distinct questions from the hard end
            kind, lv = crng.choice(r["hard"])
            p = make_problem(crng, kind, lv)
            if p["question"] not in seen:
                seen.add(p["question"])
                batch.append(p)
        # filter request i has seed + (its index among all candidates): batching does not matter
        counts += _correct_counts(llm, batch, n=r["k"], seed=seed + 100 + len(candidates) * r["k"])
        candidates += batch
    log(f"fail@{r['k']}: {sum(c == 0 for c in counts)} of {len(candidates)} candidates have "
        f"0 correct; measuring took {time.time() - t0:.0f}s")
    return dict(teacher=prof, sampled_accuracy=sampled), candidates, counts


# -----------------------------------------------------------------------------
# building (once per recipe, cached)

# world.py's functions that read, check, print or ship a world without making it: build_key leaves
# them out, so editing them keeps the worlds built. Every other function and every top-level
# assignment (the recipes, the family, the tokenizer's settings) is the build's code.
NOT_BUILD_CODE = ("build_key", "build_code", "grader", "code_of", "fingerprint", "file_hashes",
                  "check_files", "shipped_world", "build_world", "summary", "resolve", "main",
                  "ship", "kind")


def build_key(small: bool, seed: int) -> str:
    """What the world depends on: the recipe above, the code that builds it (build_code), the
    prompts it is trained on and the grader that decides its hard set."""
    recipe = dict(version=VERSION, recipe=RECIPES["small" if small else "default"], seed=seed,
                  family=[KINDS, VERBS, START, STEP], vocab=VOCAB_SIZE, chat_template=CHAT_TEMPLATE,
                  max_tokens=MAX_TOKENS, env=PINNED_ENV, code=build_code(),
                  prompts=[data.TEACHER_PROMPT, data.STUDENT_PROMPT], grader=grader())
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def build_code() -> list[str]:
    """The code of this file that makes a world (all but NOT_BUILD_CODE's functions, and every
    top-level assignment) and data.split_train_test, without comments and docstrings: a change to
    any of it gets another key, so the worlds must be built again. (What it calls in rloo, the
    engine's sampling, is covered by VERSION: bump it when that changes.)"""
    import ast
    with open(os.path.abspath(__file__), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    nodes = [node for node in tree.body
             if isinstance(node, (ast.Assign, ast.AnnAssign)) or
             isinstance(node, ast.FunctionDef) and node.name not in NOT_BUILD_CODE]
    return [code_of(node) for node in nodes] + [code_of(data.split_train_test)]


def code_of(code) -> str:
    """A function's (or an AST node's) code without its comments and docstrings"""
    import ast
    import inspect
    import textwrap
    if not isinstance(code, ast.AST):
        code = ast.parse(textwrap.dedent(inspect.getsource(code)))
    for node in ast.walk(code):   # drop docstrings (ast.dump already drops comments)
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) is not None:
            node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(code)


def grader() -> list:
    """What decides which problems are hard (fail@k counts data.solved): the code of data.solved,
    of what it calls and of the task block at the top of data.py, without comments and
    docstrings, its constants, and math-verify's version. A fork that changes any of them gets
    another key, so a world built again."""
    import importlib.metadata
    funcs = (data.solved, data.grade, data.grade_answers, data.student_prompt,
             data.extract_answer, data.quick_reward, data.answer_reward, data.answer_is_valid,
             data._mv_parse, data.last_boxed)
    constants = [data.R_CORRECT, data.R_CONTAINS, data.R_BOXED, data.R_NONE, data.MV_TIMEOUT_S,
                 data.DEADLINE_S, data._INT.pattern]
    return [[code_of(f) for f in funcs], constants, importlib.metadata.version("math-verify")]


def fingerprint(train: list[dict], test: list[dict]) -> str:
    """A short hash of the hard set (both halves, in order): equal fingerprints, equal worlds."""
    text = json.dumps([[(p["question"], p["answer"]) for p in half] for half in (train, test)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def file_hashes(folder: str) -> dict[str, str]:
    """sha256 of every file of a world's folder but stats.json, by its path in the folder"""
    hashes = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != "stats.json":
                with open(path, "rb") as f:
                    hashes[rel] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(hashes.items()))


def check_files(folder: str, stats: dict, small: bool) -> None:
    """Refuse a world whose files are not the ones it was built with (stats.json's sha256 of each,
    and its hard set's fingerprint), naming the files that differ or are missing"""
    from launch import UsageError   # (torch: not at the top, see the imports)
    paths = _paths(folder)
    halves = [data.read_jsonl(paths[half]) for half in ("train", "test")]
    have = file_hashes(folder)
    changed = [name for name, sha in stats["files"].items() if have.get(name) != sha]
    hard_set = fingerprint(*halves)
    if changed or hard_set != stats["fingerprint"]:
        raise UsageError(f"{folder}: files changed since it was built ({', '.join(changed)}; hard "
                         f"set fingerprint {hard_set}, built {stats['fingerprint']}): "
                         f"restore them (git checkout {folder}) or rebuild it with "
                         f"`python world.py --ship{' --small' * small}`")


def _paths(out: str) -> dict:
    return {"model": os.path.join(out, "model"), "train": os.path.join(out, "train.jsonl"),
            "test": os.path.join(out, "test.jsonl"), "stats": os.path.join(out, "stats.json")}


def _build_here(out: str, r: dict, seed: int, key: str = "", small: bool = False) -> None:
    """The whole build in this process, into `out` (the caller renames it into place)."""
    t0 = time.time()
    paths = _paths(out)
    tok = build_tokenizer(seed)
    tok.save_pretrained(paths["model"])
    train_model(paths["model"], r, seed)
    train_s = time.time() - t0
    stats, candidates, counts = measure(paths["model"], r, seed)
    hard = [{"question": p["question"], "answer": p["answer"]}
            for p, c in zip(candidates, counts) if c == 0]
    train, test = data.split_train_test(hard, seed)
    data.write_jsonl(paths["train"], train)
    data.write_jsonl(paths["test"], test)
    kinds = Counter(f"{p['kind']}{p['level']}" for p, c in zip(candidates, counts) if c == 0)
    stats.update(key=key, small=small, seed=seed, recipe=r, params=_param_count(paths["model"]),
                 vocab=len(tok), candidates=len(candidates), hard=len(hard),
                 hard_by_kind=dict(sorted(kinds.items())), train=len(train), test=len(test),
                 fingerprint=fingerprint(train, test), candidate_correct_counts=counts,
                 train_seconds=round(train_s, 1), build_seconds=round(time.time() - t0, 1),
                 files=file_hashes(out))
    data.write_json(paths["stats"], stats)


def _param_count(model_dir: str) -> int:
    from safetensors.torch import load_file
    return sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())


# torchrun's variables: the build runs as its own 1-rank job whoever calls it
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worlds")   # worlds/<kind>


def kind(small: bool) -> str:
    return "small" if small else "default"


def shipped_world(small: bool = False) -> dict:
    """The paths of the world that ships (worlds/default, worlds/small), if it was built from this
    file's recipe; else an error that names the command that rebuilds it."""
    folder = os.path.join(SHIPPED, kind(small))
    paths = _paths(folder)
    key = build_key(small, 0)
    stats = data.read_json(paths["stats"]) if os.path.exists(paths["stats"]) else {}
    if stats.get("key") != key:
        from launch import UsageError   # (torch: not at the top, see the imports)
        raise UsageError(f"{folder} was built from another recipe or build code than world.py's "
                         f"(key {stats.get('key')}, now {key}): rebuild it with `python world.py "
                         f"--ship{' --small' * small}`")
    check_files(folder, stats, small)
    return paths


def build_world(out_dir: str | None = None, small: bool = False, seed: int = 0) -> dict:
    """Build the world (or reuse a finished one) and return its paths: model (HF folder),
    train / test (hard problems, jsonl), stats (json). Without out_dir, seed 0's is the one that
    ships (shipped_world), and another seed's goes to .cache/.

    The build runs in a child process: it gets its own 1-rank vLLM engine and process group
    whatever the caller runs under (torchrun, pytest), its own pinned threads and kernels
    (PINNED_ENV), and frees all of it on exit. It writes into a temporary folder renamed into
    place at the end, so a folder under the final name is finished."""
    if out_dir is None and seed == 0:
        return shipped_world(small)
    key = build_key(small, seed)
    out = os.path.abspath(out_dir or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), ".cache", f"world-{kind(small)}-{key}"))
    paths = _paths(out)
    if not os.path.exists(paths["stats"]):
        if os.path.exists(out):
            raise FileExistsError(f"{out} exists but is not a finished world (no stats.json); "
                                  "remove it")
        tmp = f"{out}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        env = {k: v for k, v in os.environ.items()
               if k not in _LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
        env.update(PINNED_ENV)
        cmd = [sys.executable, os.path.abspath(__file__), "--here", "--out", tmp,
               "--seed", str(seed)]
        try:
            subprocess.run(cmd + ["--small"] * small, env=env, check=True)
            os.rename(tmp, out)
        except OSError:
            if not os.path.exists(paths["stats"]):  # else another process finished it: use theirs
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    stats = data.read_json(paths["stats"])
    if stats["key"] != key:
        raise ValueError(f"{out} holds a world built with other settings "
                         f"(key {stats['key']}, want {key})")
    return paths


def summary(paths: dict) -> str:
    st = data.read_json(paths["stats"])
    t = st["teacher"]
    return "\n".join([
        f"world: {paths['model']}  ({st['params'] / 1e6:.2f} M parameters, vocab {st['vocab']})",
        f"  teacher: {t['valid_pair_rate']:.0%} valid pairs, answers "
        f"right {t['answer_right']:.0%}; pairs with a step 'gets' / 'gives away' / 'finds': " +
        " / ".join(f"{v:.0%}" for v in t["with_step"].values()),
        "  student: sampled accuracy " +
        ", ".join(f"{k} {a:.1%}" for k, a in st["sampled_accuracy"].items()),
        f"  fail@{st['recipe']['k']}: {st['hard']} of {st['candidates']} candidates "
        f"({st['hard_by_kind']}) -> {st['train']} train ({paths['train']}), "
        f"{st['test']} test ({paths['test']})",
        f"  fingerprint {st['fingerprint']}; built in {st['build_seconds']:.0f}s "
        f"(training {st['train_seconds']:.0f}s)"])


def resolve(cfg):
    """cfg with the built-in world's model and hard splits filled in if it names no --model (rank 0
    of a torch.distributed job builds the world, cached, while the others wait); else cfg as is."""
    if cfg.model:
        return cfg
    import rloo
    import torch.distributed as dist
    rloo.init_distributed()
    paths = build_world(small=cfg.world == "small") if dist.get_rank() == 0 else None
    dist.barrier()   # the others reuse what rank 0 built (or found built)
    paths = paths or build_world(small=cfg.world == "small")
    if rloo.rank0():
        st = data.read_json(paths["stats"])
        print(f"built-in world ({cfg.world}): fingerprint {st['fingerprint']}, "
              f"{st['train']} train / {st['test']} test hard problems", flush=True)
    return dataclasses.replace(cfg, model=paths["model"],
                               **{k: getattr(cfg, k) or paths[k] for k in ("train", "test")
                                  if hasattr(cfg, k)})


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help="folder of the world (default: the one that ships, worlds/<kind>, for "
                        "seed 0; else .cache/world-<kind>-<hash>)")
    p.add_argument("--small", action="store_true", help="the smaller, faster world of the tests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ship", action="store_true",
                   help="rebuild the world that ships from this file and put it in worlds/")
    p.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # build_world's child
    a = p.parse_args()
    if a.here:   # build_world's child: it must not outlive the process that waits for it
        data.die_with_parent()
        return _build_here(a.out, RECIPES[kind(a.small)], a.seed,
                           key=build_key(a.small, a.seed), small=a.small)
    if a.ship:
        return ship(a.small)
    print(summary(build_world(a.out, a.small, a.seed)))


def ship(small: bool) -> None:
    """worlds/<kind> rebuilt from this file's recipe (seed 0), and whether its hard set equals the
    one that shipped before (the world's fingerprint): on another host's CPU it may not"""
    folder = os.path.join(SHIPPED, kind(small))
    before = _paths(folder)["stats"]
    old = data.read_json(before)["fingerprint"] if os.path.exists(before) else None
    tmp = f"{folder}.new-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    new = data.read_json(build_world(tmp, small)["stats"])["fingerprint"]
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    same = "the same hard set as" if new == old else "another hard set than"
    print(f"{folder}: rebuilt, fingerprint {new}: {same} what shipped before ({old})")
    print(summary(_paths(folder)))


if __name__ == "__main__":
    main()
