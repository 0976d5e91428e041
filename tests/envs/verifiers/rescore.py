"""verifiers' own scoring of rollouts Flywheel recorded, for the bridge's tests.

    PYTHONPATH=<the taskset's folder> python rescore.py TASKSET_ID RESULTS.jsonl

For each rollout of ``flywheel eval``'s results file, the verifiers trace its episode left in the
state is read back (``verifiers.v1.Trace``), its rewards and metrics are cleared, and the task
of the same position in the taskset scores it again with verifiers' own code
(``Task.score``); prints one JSON line per rollout: ``reward`` (``trace.reward``), ``rewards``
(name: score, weight), ``metrics``, and ``last_reply`` (the text verifiers scored).
"""

import asyncio
import json
import sys

import verifiers.v1 as vf
from verifiers.v1.utils.loaders import load_taskset, taskset_config_type


async def main(taskset_id: str, records: list[dict]) -> None:
    taskset = load_taskset(taskset_config_type(taskset_id)(id=taskset_id))
    tasks = {task.data.idx: task for task in taskset}
    for record in records:
        trace = vf.Trace.model_validate(record["state"]["verifiers"]["trace"])
        trace.rewards.clear()
        trace.metrics.clear()
        await tasks[record["task"]["idx"]].score(trace)
        print(json.dumps({"reward": trace.reward, "last_reply": trace.last_reply,
                          "rewards": {k: {"score": r.score, "weight": r.weight} for k, r in trace.rewards.items()},
                          "metrics": dict(trace.metrics)}))


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        asyncio.run(main(sys.argv[1], [json.loads(line) for line in f if line.strip()]))
