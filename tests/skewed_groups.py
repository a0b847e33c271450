"""soar.py with its student groups made to disagree on purpose, run under torchrun by
test_soar_e2e.py as `SKEW=MODE torchrun ... skewed_groups.py soar.py-flags...`.

CPU engines give every group the same greedy answers, so the tests could never see groups whose Acc0
differ. On GPUs they can (greedy bf16 decoding is not batch-invariant). Here:
- SKEW=accuracy: group 1 measures every accuracy 1/M higher than group 0 (its baseline's and its
  students' alike, as a biased engine would; the first question's outcome counts 1 more); with
  LoRA, the adapter at place i of an engine call measures i/M higher besides (as a batch position
  could).
- SKEW=decision: rank 1 adds 1 to the step reward of its decision (a rank that decides apart).
- SKEW=nan: at step 0, group 1's trained students measure NaN (so R holds NaN on every rank); and
  no step keeps promotion candidates (can_promote says no), as a reward above 1 could make it.
Each rank writes what soar.decide returned to <out>/decide-rank<N>.jsonl.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import launch  # noqa: E402
import soar  # noqa: E402
import world  # noqa: E402

MODE = os.environ.get("SKEW")
OUTCOMES = soar.outcomes
ADAPTER_OUTCOMES = soar.adapter_outcomes   # with LoRA
TRAINED_OUTCOMES = soar.trained_outcomes
DECIDE = soar.decide


def skew(run) -> int:
    return int(MODE == "accuracy" and run.mesh.get_local_rank("group") == 1)


def raised(solved: list, by: int) -> list:
    """solved with the first question's outcome counting `by` more: its mean is by/M higher"""
    return [solved[0] + by] + solved[1:]


def skewed_outcomes(cfg, run, questions, policy):
    return raised(OUTCOMES(cfg, run, questions, policy), skew(run))


def skewed_adapter_outcomes(cfg, run, questions, policies):
    place = int(MODE == "accuracy")
    return [raised(solved, skew(run) + i * place)
            for i, solved in enumerate(ADAPTER_OUTCOMES(cfg, run, questions, policies))]


def nan_outcomes(cfg, run, step):
    solved, candidates = TRAINED_OUTCOMES(cfg, run, step)
    if step.index == 0 and run.mesh.get_local_rank("group") == 1:
        solved = {kj: [float("nan")] * len(s) for kj, s in solved.items()}
    return solved, candidates


def recorded_decide(history, R, window, tau, every_step=False):
    reward, ma, chosen, history = DECIDE(history, R, window, tau, every_step)
    rank = int(os.environ["RANK"])
    if MODE == "decision" and rank == 1:
        reward += 1
    out = sys.argv[sys.argv.index("--out") + 1]
    with open(os.path.join(out, f"decide-rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(dict(R=R, reward=reward, ma=ma, chosen=chosen)) + "\n")
    return reward, ma, chosen, history


if __name__ == "__main__":   # (data.grade's workers import this file again)
    soar.outcomes = skewed_outcomes
    soar.adapter_outcomes = skewed_adapter_outcomes
    soar.decide = recorded_decide
    if MODE == "nan":
        soar.ONE_AT_A_TIME = soar.GroupStudents(soar.baseline_outcomes, nan_outcomes)
        soar.can_promote = lambda cfg, history: False
    launch.main("soar.py", lambda: soar.main(world.resolve(soar.parse_args())))
