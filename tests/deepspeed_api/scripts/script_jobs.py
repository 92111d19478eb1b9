"""Several runs of a script in one launch: ``script.py --jobs jobs.json`` runs each of a JSON list of
argument lists in turn in the same ranks (one launch's imports and rendezvous for all of them), rank 0
printing ``JOB_MARK`` and the job's ``--out`` to stderr before each, so a test splits the log by job
(``split_log``). Without ``--jobs`` the script's arguments are one job."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable

JOB_MARK = "script job writing"


def run_jobs(parser: argparse.ArgumentParser, job: Callable[[argparse.Namespace], None]) -> None:
    if sys.argv[1:2] == ["--jobs"]:
        with open(sys.argv[2]) as f:
            jobs = [parser.parse_args(argv) for argv in json.load(f)]
    else:
        jobs = [parser.parse_args()]
    for args in jobs:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{JOB_MARK} {args.out}", file=sys.stderr, flush=True)
        job(args)


def split_log(log: str) -> dict[str, str]:
    """Each job's ``--out`` and its part of the log: the lines from its mark to the next job's (the first job's
    from the start: what the imports printed)."""
    parts = re.split(rf"^{re.escape(JOB_MARK)} (.*)$", log, flags=re.M)
    if len(parts) > 1:
        parts[2] = parts[0] + parts[2]
    return dict(zip(parts[1::2], parts[2::2]))
