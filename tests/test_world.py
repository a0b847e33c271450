"""The built-in world (world.py): the problem generator's answers, and a fresh small build measured
with the real engine, so that a regression in the formats (prompts, chat template, parser, grader)
shows up as a rate falling below its bar."""
import json
import os
import random

import pytest

import data
import world


def test_generator_answers_verify():
    rng = random.Random(0)
    for level in range(2, 9):
        for _ in range(4):
            p = world.make_problem(rng, level)
            a, b = p["a"], p["b"]
            assert len(str(a)) + len(str(b)) == level and abs(len(str(a)) - len(str(b))) <= 1
            assert f"{a}" in p["question"] and f"{b}" in p["question"]
            assert p["answer"] == str(a + b)
            # the formats the model is trained on grade and parse as intended
            assert data.grade([world.student_solution(p)] * 2, [p["answer"], str(a + b + 1)]) == \
                [data.R_CORRECT, data.R_BOXED]
            assert data.parse_teacher_batch([world.teacher_reply(p)]) == [(p["question"], p["answer"])]


def test_unfinished_folder_is_not_a_world(tmp_path):
    (tmp_path / "w").mkdir()  # e.g. a crash mid-build under the final name (cannot happen: tmp + rename)
    with pytest.raises(FileExistsError):
        world.build_world(out_dir=str(tmp_path / "w"), small=True)


@pytest.fixture(scope="module")
def small_world(tmp_path_factory):
    return world.build_world(out_dir=str(tmp_path_factory.mktemp("world") / "small"), small=True)


def test_small_world_rates(small_world):
    with open(small_world["stats"]) as f:
        st = json.load(f)
    assert st["valid_pair_rate"] >= 0.5, st
    assert st["easy_greedy_accuracy"] >= 0.5, st
    # the hard set: exactly the candidates with 0 correct of k on the filter's own samples
    counts, k = st["candidate_correct_counts"], st["settings"]["k"]
    assert len(counts) == st["candidates"] and all(0 <= c <= k for c in counts)
    train, test = data.load_problems(small_world["train"]), data.load_problems(small_world["test"])
    assert len(train) + len(test) == sum(c == 0 for c in counts) == st["hard"] > 0
    assert abs(len(train) - len(test)) <= 1
    assert not {p["question"] for p in train} & {p["question"] for p in test}


def test_small_world_model_folder(small_world):
    from transformers import AutoConfig, AutoTokenizer
    model = small_world["model"]
    assert os.path.exists(os.path.join(model, "model.safetensors"))
    cfg = AutoConfig.from_pretrained(model)
    assert cfg.model_type == "llama" and cfg.head_dim == 64
    tok = AutoTokenizer.from_pretrained(model)
    prompt = data.teacher_prompt(tok)  # the chat template is there and renders the teacher prompt
    assert data.TEACHER_PROMPT in tok.decode(prompt) and tok.eos_token and tok.pad_token
    # same ids with or without special tokens: nothing is added behind the caller's back
    text = tok.decode(prompt)
    assert tok(text)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"] == prompt
    # the engines' context holds a teacher prompt + reply and a student prompt + completion
    import rloo
    q = "What is 12 + 345?"
    n = rloo.engine_len(tok, [q], student_max_tokens=48, teacher_max_tokens=48)
    assert n >= len(prompt) + 48 and n >= len(tok(data.student_prompt(q))["input_ids"]) + 48


def test_small_world_is_reused(small_world):
    mtime = os.path.getmtime(small_world["stats"])
    again = world.build_world(out_dir=os.path.dirname(small_world["stats"]), small=True)
    assert again == small_world and os.path.getmtime(again["stats"]) == mtime
