"""soar.py with its student groups made to disagree on purpose, run under torchrun by
test_soar_e2e.py as `SKEW=MODE torchrun ... skewed_groups.py soar.py-flags...`.

CPU engines give every group the same greedy answers, so the tests could never see groups whose Acc0
differ. On GPUs they can (greedy bf16 decoding is not batch-invariant). Here:
- SKEW=accuracy: group 1 measures every accuracy 1/M higher than group 0 (its baseline's and its
  students' alike, as a biased engine would); with LoRA, the adapter at place i of an engine call
  measures i/M higher besides (as a batch position could).
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
ACCURACY = soar.accuracy
ADAPTER_ACCURACIES = soar.adapter_accuracies   # with LoRA
TRAINED_ACCURACIES = soar.trained_accuracies
DECIDE = soar.decide


def skew(run, questions) -> float:
    return 1 / len(questions) if MODE == "accuracy" and run.mesh.get_local_rank("group") == 1 else 0


def skewed_accuracy(cfg, run, questions, policy):
    return ACCURACY(cfg, run, questions, policy) + skew(run, questions)


def skewed_adapter_accuracies(cfg, run, questions, policies):
    place = 1 / len(questions) if MODE == "accuracy" else 0
    return [a + skew(run, questions) + i * place
            for i, a in enumerate(ADAPTER_ACCURACIES(cfg, run, questions, policies))]


def nan_accuracies(cfg, run, step):
    accs, candidates = TRAINED_ACCURACIES(cfg, run, step)
    if step.index == 0 and run.mesh.get_local_rank("group") == 1:
        accs = {kj: float("nan") for kj in accs}
    return accs, candidates


def recorded_decide(history, R, window, tau):
    reward, ma, chosen, history = DECIDE(history, R, window, tau)
    rank = int(os.environ["RANK"])
    if MODE == "decision" and rank == 1:
        reward += 1
    out = sys.argv[sys.argv.index("--out") + 1]
    with open(os.path.join(out, f"decide-rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(dict(R=R, reward=reward, ma=ma, chosen=chosen)) + "\n")
    return reward, ma, chosen, history


if __name__ == "__main__":   # (data.grade's workers import this file again)
    soar.accuracy = skewed_accuracy
    soar.adapter_accuracies = skewed_adapter_accuracies
    soar.decide = recorded_decide
    if MODE == "nan":
        soar.ONE_AT_A_TIME = soar.GroupStudents(soar.baseline_accuracy, nan_accuracies)
        soar.can_promote = lambda cfg, history: False
    launch.main("soar.py", lambda: soar.main(world.resolve(soar.parse_args())))
