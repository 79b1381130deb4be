"""The job scripts: what the multi-process tests run in processes of their own. Each is started as a module,
``python -m jobs.<name>`` (``processes.job_command``), with ``tests/`` on its ``PYTHONPATH`` (``processes.launch``,
``nodes.launch_nodes``), so that it imports the test helpers (``helpers``, ``processes``, ``reports``) and the
jobs beside it (``jobs.ddp_common``) as the tests do. Each rank reports what it saw as a ``reports.RankReport``."""
