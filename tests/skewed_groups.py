"""soar.py with its student groups made to disagree on purpose, run under torchrun by
test_soar_e2e.py as `SKEW=MODE torchrun ... skewed_groups.py soar.py-flags...`.

CPU engines give every group the same greedy answers, so the tests could never see groups whose Acc0
differ. On GPUs they can (greedy bf16 decoding is not batch-invariant). Here:
- SKEW=accuracy: group 1 measures every accuracy 1/M higher than group 0 (its baseline's and its
  students' alike, as a biased engine would).
- SKEW=decision: rank 1 adds 1 to the step reward of its decision (a rank that decides apart).
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
DECIDE = soar.decide


def skew(run, questions) -> float:
    return 1 / len(questions) if MODE == "accuracy" and run.mesh.get_local_rank("group") == 1 else 0


def skewed_accuracy(cfg, run, questions, policy):
    return ACCURACY(cfg, run, questions, policy) + skew(run, questions)


def skewed_adapter_accuracies(cfg, run, questions, policies):
    return [a + skew(run, questions) for a in ADAPTER_ACCURACIES(cfg, run, questions, policies)]


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
    launch.main("soar.py", lambda: soar.main(world.resolve(soar.parse_args())))
