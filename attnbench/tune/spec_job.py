"""`python -m attnbench.tune.spec_job JOB OUT`: run one pickled study (objective, options) and
write its TuneResult as JSON to OUT.

`AttentionEngine(tune=True)` tunes through this module in a child process rather than in the
user's process: the tuner's workers are spawned, and a spawned worker re-imports the parent's
`__main__`, which for a user's top-level script would run the script again.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
from pathlib import Path

from attnbench.tune.runner import run_study
from attnbench.tune.space import load_space
from engine.fsutil import atomic_write_text


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m attnbench.tune.spec_job JOB OUT", file=sys.stderr)
        return 2
    job = pickle.loads(Path(argv[0]).read_bytes())
    objective, opts = job["objective"], job["options"]
    result = run_study(objective, load_space(objective.problem.template), opts)
    atomic_write_text(Path(argv[1]), json.dumps(dataclasses.asdict(result), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
