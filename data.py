"""The text side of SOAR: prompts, parsing teacher output, grading student output, datasets.

Everything that touches model text lives here. Model output is only ever *parsed*
(math-verify turns LaTeX into sympy objects; nothing is executed or eval'ed), and every
math-verify call on model text runs in a pool of worker processes with integer timeouts and
an outer deadline, because adversarial answers (power towers, huge factorials) can otherwise
hang a step (math-verify 0.9's own timeouts are SIGALRM-based and integer-only).

    python data.py math /tmp/math.jsonl    # fetch a hub pool into a local jsonl (connected machine)
"""
import argparse
import ctypes
import io
import json
import logging
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
import string
import sys
import time
import urllib.request
import zipfile
import zlib
from collections import deque
from multiprocessing.connection import wait

import numpy as np

# =================================================================================================
# THE TASK: what a student solves and how its answer is checked (METHOD.md "Prompts", "Rewards").
# Another task or checker (exact-match answers, code, ...) is this block alone: load_problems, the
# teacher's format filter, grading (grade, solved) and the other files use these names, never the
# checker's own library (math-verify here, which only the grading workers import).
#   TEACHER_PROMPT, STUDENT_PROMPT    the prompts; student_prompt(question) fills in the second
#   extract_answer(completion)        what of a completion the reward reads (None: it gives none)
#   answer_reward(answer, gold)       the student reward of that answer (run in a grading worker)
#   quick_reward(answer, gold)        answer_reward's first step where it needs no worker, or None
#   answer_is_valid(answer)           can the checker read this answer? (a gold one, a teacher's)
#   R_CORRECT                         the reward that counts as solved (Acc, pass@k, fail@k)
# The shipped worlds' hard sets depend on this block: rebuild them after changing it
# (`python world.py --ship`, and `--ship --small`).
# ---- prompts (METHOD.md "Prompts", verbatim from the paper) ----
TEACHER_PROMPT = """You are generating a new math problem for a math assistant.
Allowed topics: Algebra, Counting and Probability, Geometry, Intermediate Algebra, Number Theory, \
Prealgebra, or Precalculus.

Output rules (follow EXACTLY):
- Provide the final formatted problem in this structure: \
<question>[full math question]</question><answer>\\boxed{[answer]}</answer>
- Any explanations, steps, or reasoning about the problem goes OUTSIDE the \
<question> and <answer> tags.

Constraints:
- The problem must be original, challenging, and require at least 2-3 steps of reasoning.
- Output exactly ONE problem. You MUST follow the specified format EXACTLY.

Begin now:"""

STUDENT_PROMPT = """A conversation between User and Assistant. The user asks a question, and the \
Assistant solves it. The assistant first shows the complete reasoning process step by step, then \
provides the final answer in \\boxed{}. The assistant must always follow the format: 'User: \
[question] Assistant: [detailed reasoning] The final answer is: \\boxed{[answer]}.'

User: {question} Assistant:"""

# rewards (METHOD.md "Rewards")
R_CORRECT = 120.0   # the answer verifies against the gold answer (solved: exactly this)
R_CONTAINS = 20.0   # an answer, not verified, but the gold string occurs inside it
R_BOXED = 10.0      # an answer, neither of the above (also: grading timed out)
R_NONE = 0.0        # no boxed answer at all
MV_TIMEOUT_S = 1    # math-verify parse/verify timeouts, each (an int: a float silently fails)
_INT = re.compile(r"-?[0-9]{1,18}")   # a plain ASCII integer, short enough that int() is instant


def student_prompt(question: str) -> str:
    """the student's prompt for a question"""
    return STUDENT_PROMPT.replace("{question}", question)  # not .format: questions contain braces


def extract_answer(completion: str) -> str | None:
    """the answer a completion gives: its last \\boxed{...} (None without one)"""
    return last_boxed(completion)


def quick_reward(answer: str | None, gold: str) -> float | None:
    """answer_reward where it needs no math-verify: no answer, or two plain integers (math-verify's
    verdict for them, tested); None otherwise. grade takes this step in-process."""
    if answer is None:
        return R_NONE
    b, g = answer.strip(), gold.strip()   # (int() refuses some of what strip() removes)
    if _INT.fullmatch(b) and _INT.fullmatch(g):
        return R_CORRECT if int(b) == int(g) else R_CONTAINS if g in b else R_BOXED
    return None


def answer_reward(answer: str | None, gold: str) -> float:
    """120/20/10/0 (METHOD.md "Rewards"), math-verify in-process: grade() runs it in workers."""
    quick = quick_reward(answer, gold)
    if quick is not None:
        return quick
    from math_verify import verify
    pred, ref = _mv_parse(answer), _mv_parse(gold)
    if pred and ref and verify(ref, pred, timeout_seconds=MV_TIMEOUT_S):  # gold first (asymmetric)
        return R_CORRECT
    return R_CONTAINS if gold.strip() and gold.strip() in answer else R_BOXED


def answer_is_valid(answer: str) -> bool:
    """can math-verify parse it into a math object? (run in a grading worker)"""
    # math-verify falls back to the raw string when it cannot parse: demand a real (sympy) object
    return any(not isinstance(x, str) for x in _mv_parse(answer))


def _mv_parse(s: str):
    """math-verify's parse of an answer, as if boxed"""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    return parse("\\boxed{" + s + "}",
                 extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=MV_TIMEOUT_S)


def last_boxed(text: str) -> str | None:
    """Content of text's last \\boxed{...}, brace-matched (pure string work, safe on any input)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: truncated output


def student_reward(completion: str, gold: str) -> float:
    """the reward of a whole completion, in-process (grade() grades model text safely)"""
    return answer_reward(extract_answer(completion), gold)
# ==================================================================================== (task ends)

# ---- the two-turn teacher's (METHOD.md "Two-turn teacher"; the paper prints neither, ours): turn 1
# answers TEACHER_PROMPT and ends where its question does; turn 2 answers after p' (answer_prompt)
QUESTION_STOP = "</question>"   # the engine's stop string in turn 1; question_end may end it sooner
ANSWER_PROMPT = ("Now solve the problem you just wrote and give its final answer in the answer "
                 "tags, as the instructions above say.")
ANSWER_PROMPTS = ("chat", "tag")   # the forms of p' (answer_prompt)
WORLD_ANSWER_CUE = "answer"        # p' of form "tag": the answer tag's name (answer_prompt)

# Chat templates that print today's date (Llama 3.x: "Today Date: ...") get this one (Llama 3's own
# fallback): the teacher prompt is the same bytes every day, in every resume, in training and eval
TEMPLATE_DATE = "26 Jul 2024"

# ---- grading pool: math-verify's timeouts use SIGALRM (main thread only): processes, not threads
DEADLINE_S = 6.0          # outer deadline per item: a worker past it is killed and replaced
SPAWN_TIMEOUT_S = 120     # a worker's start (imports included), on a loaded machine too
# per rank: the node's cores shared by the ranks on it (torchrun sets LOCAL_WORLD_SIZE)
GRADE_WORKERS = max(1, min(8, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

# ---- hub pools (METHOD.md "Data"); a local .jsonl/.parquet with question/answer works offline ----
HUB = {
    "math": ("EleutherAI/hendrycks_math", "*/test-*.parquet"),
    "olympiad": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP/*.parquet"),
}
HARP_URL = "https://raw.githubusercontent.com/aadityasingh/HARP/main/HARP.jsonl.zip"   # zipped


def teacher_prompt(tokenizer) -> list[int]:
    """The one fixed teacher prompt: a user message through the model's chat template, as token ids
    (METHOD.md "Prompts"). Ids, not text: a template that starts with its BOS rendered to text gets
    a second BOS when the engine tokenizes it; the engine and the trainer both take these ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer of {tokenizer.name_or_path!r} has no chat_template; "
                         "the teacher prompt needs one")
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": TEACHER_PROMPT}], tokenize=True, return_dict=False,
        add_generation_prompt=True, date_string=TEMPLATE_DATE))


def answer_prompt(tokenizer, form: str) -> list[int]:
    """p', the two-turn teacher's prompt between its question and its answer, as token ids. "chat"
    (our reading of the paper): the teacher's reply closed, ANSWER_PROMPT as a second user message
    through the chat template, and the answer tag opened for the reply. "tag" (the built-in world's,
    whose model knows one turn): WORLD_ANSWER_CUE alone, as its model writes it after a question
    (its tokenizer ends the question on the token "><", the answer tag's "<"), so the pair reads as
    one reply."""
    if form == "tag":
        return tokenizer(WORLD_ANSWER_CUE, add_special_tokens=False).input_ids
    if form != "chat":
        raise ValueError(f"answer prompt {form!r}: one of {ANSWER_PROMPTS}")
    mark = "@@QUESTION@@"   # where turn 1 goes: p' is what the template puts after it
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": TEACHER_PROMPT}, {"role": "assistant", "content": mark},
         {"role": "user", "content": ANSWER_PROMPT}], tokenize=False,
        add_generation_prompt=True, date_string=TEMPLATE_DATE)
    return tokenizer(text[text.index(mark) + len(mark):] + "<answer>",
                     add_special_tokens=False).input_ids


# the first question, closed by </question> or (as the paper prints it) by <question>, then its
# answer, no other <question> between; text around and between is free (METHOD.md "Format filter")
_Q = re.compile(r"<question>((?:(?!</?question>).)*?)(?:</question>|<question>)"
                r"(?:(?!<question>).)*?<answer>(.*?)</answer>", re.S)


def question_end(text: str) -> int | None:
    """Where the first question of `text` ends as the format filter reads it (_Q): after the first
    </question> or <question> that follows its <question>; None while it is open. The two-turn
    teacher's turn 1 ends there (rloo_extras.sample_turns)."""
    start = text.find("<question>")
    close = re.compile(r"</?question>").search(text, start + len("<question>")) if start >= 0 \
        else None
    return close.end() if close else None


def _parse_teacher_text(text: str) -> tuple[str, str] | None:
    """The format filter's string half: both tags opened and closed, a non-empty boxed answer."""
    m = _Q.match(text, max(text.find("<question>"), 0))
    if m is None:
        return None
    question, answer = m.group(1).strip(), extract_answer(m.group(2))
    if not question or answer is None or not answer.strip():
        return None
    return question, answer.strip()


def grade(completions: list[str], golds: list[str]) -> list[float]:
    """answer_reward(extract_answer(completion), gold) of each completion, each distinct pair once,
    in worker processes with a deadline (the harness at the end of this file): a pathological
    answer is graded as a wrong one (R_BOXED) and cannot hang a step."""
    if len(completions) != len(golds):
        raise ValueError(f"grade: {len(completions)} completions but {len(golds)} gold answers")
    return grade_answers([extract_answer(c) for c in completions], golds)


def grade_answers(answers: list[str | None], golds: list[str]) -> list[float]:
    """grade's second half: answer_reward of each (answer, gold) pair"""
    pairs = list(zip(answers, golds))
    graded = {}   # distinct pair -> reward
    todo = []     # distinct pairs that need a worker
    for pair in dict.fromkeys(pairs):
        quick = quick_reward(*pair)
        if quick is None:
            todo.append(pair)
        else:
            graded[pair] = quick
    before = sum(GRADING_FAULTS.values())
    graded |= dict(zip(todo, _pool_map("reward", todo, R_BOXED)))
    failed = sum(GRADING_FAULTS.values()) - before
    if failed > WARN_FAULT_SHARE * len(todo):
        print(f"grade: {failed} of {len(todo)} distinct answers timed out or crashed their "
              f"grading worker; scored as wrong (R_BOXED)", file=sys.stderr, flush=True)
    return [graded[pair] for pair in pairs]


def solved(completions: list[str], golds: list[str]) -> list[bool]:
    """per completion: is its boxed answer correct? Acc, pass@k and fail@k count this. Correct is
    exactly a reward of R_CORRECT: a student_reward of another scale must keep that meaning."""
    return [r == R_CORRECT for r in grade(completions, golds)]


def engine_len(tok, questions: list[str], student_max_tokens: int,
               teacher_max_tokens: int = 0, answer_prompt: list[int] = ()) -> int:
    """The engines' context: the student prompt around the longest question (a teacher sample may
    be one) plus a completion, or the teacher prompt (and a two-turn teacher's answer_prompt) plus a
    teacher sample; 16 tokens of slack."""
    longest = max([len(tok(q).input_ids) for q in questions] + [teacher_max_tokens])
    student = len(tok(student_prompt("")).input_ids) + longest + student_max_tokens
    teacher = (len(teacher_prompt(tok)) + len(answer_prompt) + teacher_max_tokens
               if teacher_max_tokens else 0)
    return max(student, teacher) + 16


def parse_teacher_batch(texts: list[str]) -> list[tuple[str, str] | None]:
    """METHOD.md "Format filter", batched: tags, one problem, an answer the checker reads
    (answer_is_valid)."""
    pairs = [_parse_teacher_text(t) for t in texts]
    idx = [i for i, p in enumerate(pairs) if p is not None]
    for i, ok in zip(idx, _pool_map("parses", [(pairs[i][1],) for i in idx], False)):
        if not ok:
            pairs[i] = None
    return pairs


# ---- SeRL's self-instruction (METHOD.md "SeRL"): its question-writing prompt, the questions read
# back from it, its quality filter and its majority-vote labels
SERL_SYSTEM = ("Please act as a professional math teacher.\nYour goal is to create high quality "
               "math word problems to help students learn math.\nYou only need to create the new "
               "question. Please DO NOT solve it.")
SERL_USER = "Come up with a series of questions:\n"   # then the numbered examples, the next number
SERL_WORDS = (4, 150)   # a kept question has this many words, at least and at most
# words of questions a text-only model cannot work with (SeRL's list)
_SERL_BANNED = re.compile(r"\b(images?|graphs?|pictures?|files?|maps?|draw|plot|go to)\b", re.I)
_NUMBERED = re.compile(r"(?:^|\n)[ \t]*\d+\.[ \t]*(.*?)(?=\n[ \t]*\d+\.(?:\s|\Z)|\Z)", re.S)


def fewshot_prompt(tokenizer, examples: list[str]) -> list[int]:
    """SeRL's question-writing prompt, as token ids through the chat template: its system message,
    then the examples as a numbered list that ends in the next number, for the model to go on."""
    listed = "".join(f"{i}. {' '.join(q.split())}\n" for i, q in enumerate(examples, 1))
    messages = [{"role": "system", "content": SERL_SYSTEM},
                {"role": "user", "content": SERL_USER + listed + f"{len(examples) + 1}."}]
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=True,
                                              date_string=TEMPLATE_DATE))


def numbered_questions(reply: str, first: int) -> list[str]:
    """The questions of a reply to fewshot_prompt: it continues the list at number `first`, and
    may go on with first + 1, ... (one question per item, whitespace collapsed)."""
    items = [" ".join(q.split()) for q in _NUMBERED.findall(f"{first}. {reply.lstrip()}")]
    return [q for q in items if q]


def serl_quality(question: str) -> bool:
    """SeRL's quality filter on a written question: SERL_WORDS words, none of _SERL_BANNED, not a
    "Write a program" task, and it starts with an ASCII character that is not punctuation."""
    words = len(question.split())
    return (SERL_WORDS[0] <= words <= SERL_WORDS[1] and not _SERL_BANNED.search(question)
            and not question.startswith("Write a program") and question[0].isascii()
            and question[0] not in string.punctuation)


def majority(answers: list[str | None], same) -> tuple[str | None, float]:
    """SeRL's self-reward label: of n samples' final answers (None: none given), the one the most
    samples agree with (same(a, b): are two answers equal; the first such answer on a tie) and the
    share of the n samples that agree with it; (None, 0.0) when no sample gave an answer."""
    given = [a for a in answers if a is not None]
    if not given:
        return None, 0.0
    votes = {a: sum(same(a, b) for b in given) for a in dict.fromkeys(given)}
    best = max(votes, key=votes.get)
    return best, votes[best] / len(answers)


def majority_labels(groups: list[list[str]]) -> list[tuple[str | None, float]]:
    """majority() of each group of completions (one question's samples) over their last boxed
    answers, two answers equal when math-verify says so either way round (as SeRL's reward does;
    graded in the worker pool)."""
    answers = [[(extract_answer(c) or "").strip() or None for c in g] for g in groups]
    pairs = sorted({(a, b) for g in answers for a in g for b in g
                    if a is not None and b is not None and a != b})
    verdicts = grade_answers([a for a, _ in pairs], [b for _, b in pairs])
    equal = {pair for pair, r in zip(pairs, verdicts) if r == R_CORRECT}
    return [majority(g, lambda a, b: a == b or (a, b) in equal or (b, a) in equal)
            for g in answers]


# ---- datasets ----
def _check_rows(rows: list, where: str) -> list[dict]:
    out = []
    for line, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where}:{line}: expected a JSON object, got {type(row).__name__}")
        for key in ("question", "answer"):
            if key not in row:
                raise ValueError(f"{where}:{line}: missing field {key!r}")
            if not isinstance(row[key], str) or not row[key].strip():
                raise ValueError(f"{where}:{line}: empty or non-string {key!r}")
        out.append({"question": row["question"].strip(), "answer": row["answer"].strip()})
    return out


def _read_jsonl(path: str) -> list[tuple[int, object]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((line_no, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e.msg})") from None
    return rows


def _read_parquet(path: str) -> list[tuple[int, dict]]:
    import pyarrow.parquet as pq   # here, not at the top: parquet files only (optional formats)
    return list(enumerate(pq.read_table(path).to_pylist(), 1))


def _from_hub(name: str) -> list[dict]:
    """MATH / OlympiadBench by hub id, HARP from its GitHub release (connected machines only)."""
    if name == "harp":
        with urllib.request.urlopen(HARP_URL) as r:
            return read_harp_zip(io.BytesIO(r.read()))
    from huggingface_hub import snapshot_download   # connected machines only
    repo, pattern = HUB[name]
    folder = snapshot_download(repo, repo_type="dataset", allow_patterns=[pattern])
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder)
                   for f in fs if f.endswith(".parquet"))
    rows = [r for f in files for _, r in _read_parquet(f)]
    if name == "math":  # answer = the last \boxed{} of the reference solution
        return [{"question": r["problem"], "answer": last_boxed(r["solution"]) or ""} for r in rows]
    return [{"question": r["question"],
             "answer": ", ".join(a.strip().strip("$") for a in r["final_answer"])}
            for r in rows]  # olympiad: final_answer is a list of LaTeX strings


def first_line(e: BaseException) -> str:
    """an error's message for a one-line report: its first line, at most 200 characters"""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def read_harp_zip(file) -> list[dict]:
    """The HARP release: a zip (path or file object) holding HARP.jsonl (problem/answer fields)."""
    with zipfile.ZipFile(file) as z:
        name = next(n for n in z.namelist() if n.endswith(".jsonl"))
        rows = [json.loads(x) for x in z.read(name).decode().splitlines() if x.strip()]
    return [{"question": r["problem"], "answer": str(r["answer"])} for r in rows]


def load_problems(source: str) -> list[dict]:
    """A problem pool as [{"question", "answer"}]: 'math' | 'harp' | 'olympiad' from the hub, or a
    local .jsonl / .parquet file with question/answer fields. Bad rows raise, naming file and line.
    Problems without a gold answer, or whose gold answer the checker cannot read, are dropped with
    a note (they could never be solved, so they would pass any fail@k filter: METHOD.md "Data")."""
    if source in ("math", "harp", "olympiad"):
        try:
            rows = _from_hub(source)
        except OSError as e:   # no network, no such file on the hub (requests' errors are OSErrors)
            raise RuntimeError(f"hub pool {source}: cannot fetch it ({first_line(e)}); on a "
                               f"machine with network, `python data.py {source} FILE` saves it "
                               "as a file to pass instead") from None
        kept = [r for r in rows if r["question"].strip() and r["answer"].strip()]
        if len(kept) < len(rows):
            print(f"load_problems({source}): dropped {len(rows) - len(kept)} of {len(rows)} rows "
                  "without an answer", file=sys.stderr)
        rows = _check_rows(list(enumerate(kept, 1)), source)
    elif not os.path.exists(source):
        raise FileNotFoundError(f"problem file {source!r} does not exist "
                                "(or name a hub pool: math, harp, olympiad)")
    else:
        rows = _check_rows(_read_parquet(source) if source.endswith(".parquet")
                           else _read_jsonl(source), source)
    ok = _pool_map("parses", [(r["answer"],) for r in rows], False)
    bad = [r["answer"] for r, good in zip(rows, ok) if not good]
    if bad:
        print(f"load_problems({source}): dropped {len(bad)} of {len(rows)} problems whose "
              f"gold answer the checker cannot read (answer_is_valid; e.g. {bad[0]!r})",
              file=sys.stderr)
    return [r for r, good in zip(rows, ok) if good]


def read_jsonl(path: str) -> list[dict]:
    """The rows of a jsonl file we wrote (metrics, evals, counts); none if it does not exist yet."""
    return [row for _, row in _read_jsonl(path)] if os.path.exists(path) else []


def write_text(path: str, text: str) -> None:
    """Written to path.tmp, then renamed: a reader (or a crash) never sees a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_jsonl(path: str, rows: list[dict]) -> None:
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_json(path: str, obj) -> None:
    write_text(path, json.dumps(obj, indent=1))


def read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def append_jsonl(path: str, rows: list[dict]) -> None:
    """Append and fsync: a row that was logged survives a crash."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def split_train_test(problems: list[dict], seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The fail@128 survivors split 50/50 at random with a fixed seed (METHOD.md "Data")."""
    idx = list(range(len(problems)))
    random.Random(seed).shuffle(idx)
    half = len(idx) // 2
    return [problems[i] for i in idx[:half]], [problems[i] for i in idx[half:]]


def sample_questions(problems: list[dict], m: int, rng: random.Random) -> list[dict]:
    """Q_R: m hard train problems, fresh each outer step (METHOD.md "Algorithm 1", step 3)."""
    if len(problems) < m:
        raise ValueError(f"need M={m} questions for Q_R but the hard train split has only "
                         f"{len(problems)}")
    return rng.sample(problems, m)


# ---- diversity (METHOD.md "Diversity")

def embed_ngram(texts: list[str], dim: int = 4096, n: int = 3) -> np.ndarray:
    """Character n-gram counts hashed into `dim` buckets (crc32: stable across runs), L2-normalised.
    The default because it needs no model and no network and is deterministic: it measures surface
    diversity, which is what separates the teachers in the paper (Intrinsic-T's collapse onto
    near-copies). Its numbers are not on the scale of the paper's (embeddings of a large LM); pass
    --embed <HF model> for a semantic embedding, and compare methods only under one embedding."""
    X = np.zeros((len(texts), dim))
    for r, t in enumerate(texts):
        t = " ".join(t.lower().split())
        for i in range(max(1, len(t) - n + 1)):
            X[r, zlib.crc32(t[i:i + n].encode()) % dim] += 1
    return X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)


def novelty(questions: list[str], archive: list[str]) -> list[float]:
    """Per question: 1 - the highest cosine similarity of its n-gram embedding to an archived
    question's (1 while the archive is empty): the OpenSIR-style reward's novelty and SeRL's
    diversity filter."""
    if not archive:
        return [1.0] * len(questions)
    similarity = embed_ngram(questions) @ embed_ngram(archive).T
    return (1 - similarity.max(1)).tolist()


def embed_hf(texts: list[str], path: str, batch: int = 32) -> np.ndarray:
    """Mean-pooled last hidden states of a HF model (e.g. the base model, or a sentence encoder)."""
    import torch   # here, not at the top: only --embed with a model needs torch and transformers
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    tok.pad_token = tok.pad_token or tok.eos_token
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], return_tensors="pt", padding=True, truncation=True,
                  max_length=512)
        with torch.no_grad():
            h = model(**enc).last_hidden_state
        m = enc.attention_mask[..., None].to(h.dtype)
        out.append(((h * m).sum(1) / m.sum(1)).float().numpy())
    return np.concatenate(out)


def vendi(X: np.ndarray) -> float:
    """VS = exp(-sum l log l) over the eigenvalues l of K/n, K the cosine kernel of the rows of X.
    Identical items give 1, mutually orthogonal ones give n."""
    X = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)
    lam = np.linalg.eigvalsh(X @ X.T / len(X))
    lam = lam[lam > 1e-12]
    return float(np.exp(-(lam * np.log(lam)).sum()))


def vendi_bootstrap(X: np.ndarray, subset: int = 128, draws: int = 100,
                    seed: int = 0) -> tuple[float, float]:
    """Mean and std of VS over `draws` random `subset`-question subsets, drawn without replacement
    (duplicates would read as lost diversity); a set of <= subset questions is one draw."""
    if len(X) <= subset:
        return vendi(X), 0.0
    rng = np.random.default_rng(seed)
    vs = [vendi(X[rng.choice(len(X), subset, replace=False)]) for _ in range(draws)]
    return statistics.fmean(vs), (statistics.stdev(vs) if draws > 1 else 0.0)


def embed(texts: list[str], how: str = "ngram") -> np.ndarray:
    """question embeddings for Vendi: "ngram", or a HF model path"""
    return embed_ngram(texts) if how == "ngram" else embed_hf(texts, how)


# ---- harness: the grading pool behind grade(), answer_is_valid's batch checks and load_problems.
# Each item runs in a worker process with a deadline, so no answer can hang a step.

_TASKS = {"reward": answer_reward, "parses": answer_is_valid}   # what the workers run


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies, so that no orphan goes on
    running (or writing into a run folder) after its launcher is gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:                         # the parent died before we asked
            os._exit(1)


def _worker(conn):
    """a grading worker: runs _TASKS[kind](*args) for each (kind, args) it receives"""
    die_with_parent()   # its parent is multiprocessing's fork server, which exits with our process
    import math_verify  # noqa: F401  (loaded before "ready": the deadline must not pay for imports)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # timeouts are expected, not news
    conn.send("ready")
    while True:
        kind, args = conn.recv()
        try:
            out = _TASKS[kind](*args)
        except Exception:  # a math-verify crash on odd input is a failed item, not a dead worker
            out = None
        conn.send(out)


_pool: list = []  # [process, connection] pairs, built on first use and kept
# since the start: items past the deadline (worker killed), items whose worker crashed or raised
GRADING_FAULTS = {"grading_timeouts": 0, "grading_errors": 0}
WARN_FAULT_SHARE = 0.01   # grade() warns when more than this share of a batch failed so


def _spawn():
    """a new grading worker process, started and ready: [process, connection]"""
    ctx = mp.get_context("forkserver")  # not fork: the parent holds vLLM/torch threads
    ctx.set_forkserver_preload(["math_verify", __name__])
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_worker, args=(child,), daemon=True)
    p.start()
    child.close()
    if not parent.poll(SPAWN_TIMEOUT_S) or parent.recv() != "ready":
        p.kill()
        raise RuntimeError(f"a grading worker did not start within {SPAWN_TIMEOUT_S}s")
    return [p, parent]


def _pool_map(kind: str, items: list[tuple], on_timeout) -> list:
    """Run _TASKS[kind](*item) for every item in the worker pool; an item that errors or runs past
    DEADLINE_S gets on_timeout (its worker is killed and replaced). Cannot hang."""
    while len(_pool) < GRADE_WORKERS:
        _pool.append(_spawn())
    out = [on_timeout] * len(items)
    todo = deque(range(len(items)))
    busy = {}   # worker -> (item, its start)
    while todo or busy:
        for w in range(len(_pool)):
            if w not in busy and todo:
                i = todo.popleft()
                _pool[w][1].send((kind, items[i]))
                busy[w] = (i, time.monotonic())
        conns = {id(_pool[w][1]): w for w in busy}
        for conn in wait([_pool[w][1] for w in busy], timeout=0.05):
            w = conns[id(conn)]
            i, _ = busy.pop(w)
            try:
                res = conn.recv()
            except EOFError:  # the worker died (e.g. out of memory on a huge number)
                res = None
                _pool[w] = _spawn()
            GRADING_FAULTS["grading_errors"] += res is None
            out[i] = on_timeout if res is None else res
        now = time.monotonic()
        for w, (i, t0) in list(busy.items()):
            if now - t0 > DEADLINE_S:
                _pool[w][0].kill()
                _pool[w] = _spawn()
                del busy[w]
                GRADING_FAULTS["grading_timeouts"] += 1
    return out


def grading_faults() -> dict:
    """the grading timeouts and errors since the process started (callers count differences)"""
    return dict(GRADING_FAULTS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="data.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source",
                   help="math, harp or olympiad (from the hub), or a .jsonl / .parquet file")
    p.add_argument("out", help="the .jsonl file to write")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    write_jsonl(a.out, load_problems(a.source))
    print(f"wrote {a.out}")
