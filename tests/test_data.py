import json
import os
import random
import subprocess
import sys
import time

import pytest

import data
from data import R_BOXED, R_CONTAINS, R_CORRECT, R_NONE

GOOD = "Let me think.\n<question>What is 3 + 4 * 2?</question><answer>\\boxed{11}</answer>\nDone."


# ---- the teacher format filter ----
@pytest.mark.parametrize("text,expected", [
    (GOOD, ("What is 3 + 4 * 2?", "11")),
    ("<question>Find x if 2x = 1.<question><answer>\\boxed{\\frac{1}{2}}</answer>",
     ("Find x if 2x = 1.", "\\frac{1}{2}")),
    ("<question>Q?</question>\n<answer>The answer: \\boxed{7}</answer>", ("Q?", "7")),
    # an inequality written plainly inside the question
    ("<question>How many integers x satisfy 0 < x < 5?</question><answer>\\boxed{4}</answer>",
     ("How many integers x satisfy 0 < x < 5?", "4")),
    ("<question>Is 3<x<7 for x = 5? Give x - 3.</question><answer>\\boxed{2}</answer>",
     ("Is 3<x<7 for x = 5? Give x - 3.", "2")),
    # an explanation between the tagged parts (the prompt puts explanations outside the tags)
    ("<question>What is 2^{10}?</question>\nWhy: doubling ten times.\n"
     "<answer>\\boxed{1024}</answer>", ("What is 2^{10}?", "1024")),
    (GOOD + GOOD, ("What is 3 + 4 * 2?", "11")),   # the first problem
])
def test_parse_teacher_accepts(text, expected):
    assert data.parse_teacher_batch([text]) == [expected]


@pytest.mark.parametrize("text", [
    "<question>What is 3 + 4?</question><answer>\\boxed{7",             # truncated mid-answer
    "<question>What is 3 + 4?</question><answer>\\boxed{7}",            # answer never closed
    "<question>What is 3 + 4?",                                         # truncated in the question
    "What is 3 + 4? \\boxed{7}",                                        # no tags at all
    "<question>What is 3 + 4?</question><answer>7</answer>",            # no boxed answer
    "<question>What is 3 + 4?</question><answer>\\boxed{}</answer>",    # empty boxed answer
    "<question></question><answer>\\boxed{7}</answer>",                 # empty question
    "<question>What?</question><answer>\\boxed{\\frac{}{}}}</answer>",  # unparseable answer
    "<answer>\\boxed{7}</answer><question>What is 3 + 4?</question>",   # answer before question
    "<question>Q?</question> (easy) <question>R?</question><answer>\\boxed{1}</answer>",  # whose?
])
def test_parse_teacher_rejects(text):
    assert data.parse_teacher_batch([text]) == [None]


def test_parse_teacher_batch_keeps_order():
    texts = ["junk", GOOD, "<question>Q</question><answer>\\boxed{2^{10}}</answer>"]
    assert data.parse_teacher_batch(texts) == [None, ("What is 3 + 4 * 2?", "11"), ("Q", "2^{10}")]


# ---- the student reward ----
@pytest.mark.parametrize("completion,gold,reward", [
    ("so it is \\boxed{0.5}", "1/2", R_CORRECT),
    ("The final answer is: \\boxed{\\frac{1}{2}}.", "0.5", R_CORRECT),  # equal near-miss forms
    ("\\boxed{1/2}", "0.5", R_CORRECT),
    ("first \\boxed{3} then \\boxed{12}", "12", R_CORRECT),   # the LAST boxed answer counts
    ("\\boxed{12}", "13", R_BOXED),
    ("\\boxed{x^2 + 1}", "x^2 + 2", R_BOXED),
    ("\\boxed{312}", "12", R_CONTAINS),                       # gold inside a wrong boxed answer
    ("\\boxed{12, 13}", "12", R_CONTAINS),
    ("the answer is 12", "12", R_NONE),                       # right, but not boxed
    ("\\boxed{12", "12", R_NONE),                             # truncated box
])
def test_student_reward(completion, gold, reward):
    assert data.student_reward(completion, gold) == reward
    assert data.grade([completion], [gold]) == [reward]


def test_grade_pathological_batch_is_bounded_and_pool_survives():
    comps, golds = [], []
    for i in range(240):
        comps.append(f"Adding up, the final answer is: \\boxed{{{i * 7 + 1}}}.")
        golds.append(str(i * 7 + 1) if i % 3 else str(i * 7 + 2))   # a third are wrong
    bad = ["\\boxed{2^{2^{2^{2^{2^{2^{2^{2}}}}}}}}", "\\boxed{9^{9^{9}}}", "\\boxed{100000000!}"]
    for i in range(16):
        comps.append(bad[i % 3])
        golds.append(str(-1 - i))   # 16 distinct pairs (grade() sends each distinct pair once)
    order = list(range(256))
    random.Random(0).shuffle(order)
    comps, golds = [comps[i] for i in order], [golds[i] for i in order]
    t0 = time.time()
    rewards = data.grade(comps, golds)
    assert time.time() - t0 < 30
    for c, g, r in zip(comps, golds, rewards):
        if c in bad:
            assert r == R_BOXED
        else:
            assert r == (R_CORRECT if c.endswith(f"{{{g}}}.") else R_BOXED), (c, g, r)
    # pool still usable
    assert data.grade(["\\boxed{4}", "\\boxed{5}"], ["4", "4"]) == [R_CORRECT, R_BOXED]


def test_grade_sends_each_distinct_pair_once(monkeypatch):
    sent, pool_map = [], data._pool_map
    monkeypatch.setattr(data, "_pool_map", lambda kind, items, on_timeout: sent.extend(items) or
                        pool_map(kind, items, on_timeout))
    comps = ["so \\boxed{4}", "\\boxed{4}", "no box", "\\boxed{0.5}", "\\boxed{4}", "\\boxed{0.5}"]
    golds = ["4", "4", "4", "1/2", "5", "1/2"]
    assert data.grade(comps, golds) == [data.student_reward(c, g) for c, g in zip(comps, golds)]
    assert sent == [("0.5", "1/2")]   # plain integers are compared without a worker


def test_a_reward_that_reads_the_whole_completion_sees_it(monkeypatch):
    """The task block's contract: grade sends what extract_answer returns to answer_reward. A task
    whose answer is the whole completion (and that takes no quick step) gets every distinct
    (completion, gold), an unboxed one and a plain integer too (here a scripted pool)."""
    sent = []
    monkeypatch.setattr(data, "extract_answer", lambda completion: completion)
    monkeypatch.setattr(data, "quick_reward", lambda answer, gold: None)
    monkeypatch.setattr(data, "_pool_map", lambda kind, items, on_timeout: sent.extend(items) or
                        [float(len(c)) for c, _ in items])
    comps = ["so \\boxed{4}", "\\boxed{4}", "no box", "so \\boxed{4}"]
    assert data.grade(comps, ["4"] * 4) == [12.0, 9.0, 6.0, 12.0]
    assert sent == [("so \\boxed{4}", "4"), ("\\boxed{4}", "4"), ("no box", "4")]


def test_integer_pairs_graded_as_math_verify_grades_them():
    ints = ["0", "-0", "7", "07", "-7", "12", "112", "121", "-12", "1200", "999999999999999999"]
    pairs = [(f"so \\boxed{{{b}}}.", g) for b in ints + [" 12 ", "12.0", "1,2", "\x1e1", "\u0663"]
             for g in ints]  # \x1e: str.strip() removes it, int() does not; \u0663: Arabic-Indic 3
    assert data.grade(*zip(*pairs)) == [data.student_reward(c, g) for c, g in pairs]


def test_grade_length_mismatch():
    with pytest.raises(ValueError, match="2 completions but 1"):
        data.grade(["a", "b"], ["1"])


def test_student_prompt():
    q = "Compute {a, b} \\cup {c}."  # braces must survive: no str.format on questions
    p = data.student_prompt(q)
    assert p.endswith(f"User: {q} Assistant:") and \
        p.startswith("A conversation between User and Assistant.")
    assert "<question>[full math question]</question><answer>\\boxed{[answer]}</answer>" in \
        data.TEACHER_PROMPT


# a template shaped like Llama 3's: it opens with its BOS and prints today's date unless told one
LLAMA_LIKE = ("{{ bos_token }}{% if date_string is not defined %}{% set date_string = "
              "strftime_now('%d %b %Y') %}{% endif %}<|sys|>Today Date: {{ date_string }}<|end|>"
              "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def llama_like_tokenizer():
    """byte-level BPE whose tokenizer, like Llama 3's, adds a BOS to any text it encodes"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([data.TEACHER_PROMPT] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = LLAMA_LIKE
    return fast


def test_teacher_prompt_ids_one_bos_and_a_pinned_date(monkeypatch):
    import datetime as dt
    from transformers.utils import chat_template_utils
    tok = llama_like_tokenizer()

    def on(day):   # render as if today were `day`
        class Frozen(dt.datetime):
            @classmethod
            def now(cls, tz=None):
                return dt.datetime(2025, 1, day)
        monkeypatch.setattr(chat_template_utils, "datetime", Frozen)
        text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                       add_generation_prompt=True)
        return data.teacher_prompt(tok), text

    (ids1, text1), (ids2, text2) = on(1), on(2)
    # the template does print today's date, but the teacher prompt is pinned
    assert text1 != text2
    assert ids1 == ids2 and data.TEMPLATE_DATE in tok.decode(ids1)
    bos = tok.bos_token_id
    assert ids1[0] == bos and ids1.count(bos) == 1           # exactly one BOS
    assert tok(tok.decode(ids1))["input_ids"][:2] == [bos, bos]   # the rendered text, tokenized
    assert data.TEACHER_PROMPT in tok.decode(ids1)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        data.teacher_prompt(tok)


# ---- SeRL's self-instruction ----
def test_fewshot_prompt_numbers_the_examples_and_asks_for_the_next():
    tok = llama_like_tokenizer()
    text = tok.decode(data.fewshot_prompt(tok, ["What is\n 1 + 1?", "Find x."]))
    assert data.SERL_SYSTEM in text and data.TEMPLATE_DATE in text
    assert data.SERL_USER + "1. What is 1 + 1?\n2. Find x.\n3." in text


def test_numbered_questions_read_the_continued_list():
    reply = " Tom has 3 apples.\nHow many?\n10. What is 2 + 2?\n 11.  Find y if y = 3.5.\n12."
    assert data.numbered_questions(reply, 9) == ["Tom has 3 apples. How many?", "What is 2 + 2?",
                                                 "Find y if y = 3.5."]
    assert data.numbered_questions("", 9) == []


@pytest.mark.parametrize("question, ok", [
    ("What is the sum of 4 and 9?", True),
    ("What is 4?", False),                                  # 3 words
    (" ".join(["word"] * 151), False),                      # too long
    ("Draw the graph of y = x^2 and find its vertex.", False),
    ("Look at the image below: how many apples are there?", False),
    ("Write a program that prints the primes below 100.", False),
    ("(a) Find the sum of 4 and 9.", False),                # starts with punctuation
    ("Ünd what is the sum of 4 and 9?", False),             # starts with a non-ASCII character
    ("Plotting aside, what is the sum of 4 and 9?", True),  # whole words only
])
def test_serl_quality(question, ok):
    assert data.serl_quality(question) == ok


def test_majority_vote_on_hand_built_answers():
    same = str.__eq__
    assert data.majority(["3", "4", "3", None], same) == ("3", 0.5)   # no answer: a vote against
    assert data.majority(["4", "3", "3", "4"], same) == ("4", 0.5)    # a tie: the first
    assert data.majority([None, None], same) == (None, 0.0)
    assert data.majority(["7"] * 5, same) == ("7", 1.0)


def test_majority_labels_count_equal_answers_by_math_verify():
    groups = [["so \\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{1/2}", "\\boxed{2}", "none"],
              ["\\boxed{12}", "\\boxed{ 12 }", "\\boxed{13}", "\\boxed{}"],
              ["no answer", "\\boxed{"]]
    (a, share_a), (b, share_b), (c, share_c) = data.majority_labels(groups)
    assert a in ("0.5", "\\frac{1}{2}", "1/2") and share_a == 3 / 5
    assert (b, share_b) == ("12", 2 / 4)
    assert (c, share_c) == (None, 0.0)


def test_answer_prompt_is_a_second_user_turn():
    """p' "chat" (METHOD.md "Two-turn teacher"): what the template puts after the teacher's first
    reply, a user turn asking for the answer, then the answer tag opened; no BOS; the filter reads
    question, p' and answer as one reply"""
    tok = llama_like_tokenizer()
    ids = data.answer_prompt(tok, "chat")
    text = tok.decode(ids)
    assert tok.bos_token_id not in ids and text.endswith("<answer>")
    whole = tok.apply_chat_template(
        [{"role": "user", "content": data.TEACHER_PROMPT}, {"role": "assistant", "content": "Q"},
         {"role": "user", "content": data.ANSWER_PROMPT}], tokenize=False,
        add_generation_prompt=True, date_string=data.TEMPLATE_DATE)
    assert whole.endswith("Q" + text.removesuffix("<answer>"))
    assert data.parse_teacher_batch(["2 + 3 = 5. <question>What is 2 + 3?</question>" + text
                                     + "\\boxed{5}</answer>"]) == [("What is 2 + 3?", "5")]
    assert tok.decode(data.answer_prompt(tok, "tag")) == data.WORLD_ANSWER_CUE
    with pytest.raises(ValueError, match="'turn'"):
        data.answer_prompt(tok, "turn")


# ---- datasets ----
def test_load_jsonl_and_errors(tmp_path):
    f = tmp_path / "ok.jsonl"
    f.write_text('{"question": "1+1?", "answer": "2"}\n\n'
                 '{"question": " 2+2? ", "answer": "4", "extra": 1}\n')
    assert data.load_problems(str(f)) == [{"question": "1+1?", "answer": "2"},
                                          {"question": "2+2?", "answer": "4"}]
    cases = {
        '{"question": "q", "answer": "1"}\n{"question": "q"}\n':
            r"bad.jsonl:2: missing field 'answer'",
        '{"question": "q", "answer": "  "}\n': r"bad.jsonl:1: empty or non-string 'answer'",
        '{"question": "q", "answer": "1"}\n{"question": "q", "answer": "1"}\n{oops\n':
            r"bad.jsonl:3: not JSON",
        '[1, 2]\n': r"bad.jsonl:1: expected a JSON object",
    }
    for text, msg in cases.items():
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(ValueError, match=msg):
            data.load_problems(str(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        data.load_problems(str(tmp_path / "nope.jsonl"))


def test_unparseable_gold_answers_are_dropped(tmp_path, capsys):
    rows = [{"question": "a?", "answer": "12"}, {"question": "b?", "answer": "\\frac{}{}}"},
            {"question": "c?", "answer": "x^2 + 1"}, {"question": "d?", "answer": "}{"}]
    data.write_jsonl(str(tmp_path / "p.jsonl"), rows)
    assert data.load_problems(str(tmp_path / "p.jsonl")) == [rows[0], rows[2]]
    assert "dropped 2 of 4 problems whose gold answer the checker cannot read" in \
        capsys.readouterr().err


def test_harp_release_zip(tmp_path):
    import zipfile
    rows = [{"problem": "What is $1+1$?", "answer": 2, "level": 1},
            {"problem": "Find $x$.", "answer": "\\frac{1}{2}"}]
    with zipfile.ZipFile(tmp_path / "HARP.jsonl.zip", "w") as z:
        z.writestr("HARP.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_harp_zip(str(tmp_path / "HARP.jsonl.zip")) == [
        {"question": "What is $1+1$?", "answer": "2"},
        {"question": "Find $x$.", "answer": "\\frac{1}{2}"}]
    assert data.HARP_URL.endswith("/HARP.jsonl.zip")


def test_load_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"question": ["a?", "b?"], "answer": ["1", ""]}),
                   tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p.parquet:2: empty"):
        data.load_problems(str(tmp_path / "p.parquet"))


def test_write_jsonl_roundtrip_and_split(tmp_path):
    rows = [{"question": f"q{i} \\frac{{1}}{{2}}", "answer": str(i)} for i in range(11)]
    data.write_jsonl(str(tmp_path / "sub" / "x.jsonl"), rows)
    assert data.load_problems(str(tmp_path / "sub" / "x.jsonl")) == rows
    train, test = data.split_train_test(rows, seed=3)
    assert (len(train), len(test)) == (5, 6)
    assert sorted(map(json.dumps, train + test)) == sorted(map(json.dumps, rows))
    assert data.split_train_test(rows, seed=3) == (train, test)      # seeded
    assert data.split_train_test(rows, seed=4) != (train, test)
    qr = data.sample_questions(train, 4, random.Random(0))
    assert len(qr) == 4 and all(q in train for q in qr) and len(set(map(json.dumps, qr))) == 4
    with pytest.raises(ValueError, match="M=6 .* only 5"):
        data.sample_questions(train, 6, random.Random(0))


def test_no_network_is_one_clear_error(tmp_path):
    """a hub pool, and a --model hub id, on a machine that cannot reach the hub"""
    code = ("import data, launch\nfor f, x in ((data.load_problems, 'math'), "
            "(launch.tokenizer, 'meta-llama/Llama-3.2-3B-Instruct')):\n"
            "    try:\n        f(x)\n    except (RuntimeError, launch.UsageError) as e:\n"
            "        print(e)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)},
                       timeout=300)
    said = p.stdout.splitlines()
    assert said[0].startswith("hub pool math: cannot fetch it (") and "data.py math FILE" in said[0]
    assert said[1].startswith("--model meta-llama/Llama-3.2-3B-Instruct: neither an HF model "
                              "folder nor a hub id this machine can reach ("), p.stderr[-2000:]
