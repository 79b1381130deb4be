"""A 2-rank DDP (gloo, CPU) training job for the multi-process tests. Run by tests/test_ddp.py (the S3 cases
by tests/test_remote.py, the soak by tests/test_reliability.py).

Each rank writes ``<out>/rank<r>.json`` with what it saw. Lightning relaunches this script for rank 1.
``--case NAME`` runs ``case_NAME`` from the modules beside this script: ``ddp_fit_cases.py`` (training to
the end: exact checkpoints and resumes, lazy snapshots, S3, a save in flight when every rank dies),
``ddp_fault_cases.py`` (a failing save raises on every rank) and ``ddp_soak_case.py`` (100 saves: nothing
grows); what they share is in ``ddp_common.py``.
"""

from __future__ import annotations

from jobs import ddp_fault_cases, ddp_fit_cases, ddp_soak_case
from processes import run_job

CASES = {
    name[len("case_"):]: case
    for module in (ddp_fit_cases, ddp_fault_cases, ddp_soak_case)
    for name, case in vars(module).items()
    if name.startswith("case_")
}


def main():
    run_job(lambda args, report: CASES[args.case](args, report))


if __name__ == "__main__":
    main()
