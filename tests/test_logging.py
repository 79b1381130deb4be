"""Where the package's log lines go: Lightning's convention, without hiding them from the application."""

import subprocess
import sys

SCRIPT = """
import logging, sys
import lightning_asyncckpt.integration.io  # the package configures its logger at import
{configure}
logging.getLogger("lightning_asyncckpt.pipeline.committer").info("committed a.ckpt")
"""


def _run(configure: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(configure=configure)], capture_output=True,
                          text=True, timeout=120)


def test_records_reach_a_logging_config_made_after_the_import():
    r = _run('logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP %(name)s %(message)s")')
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("APP lightning_asyncckpt.pipeline.committer committed a.ckpt") == 1, r.stdout
    assert "committed a.ckpt" not in r.stderr  # and not printed twice


def test_without_a_logging_config_the_info_line_is_shown_on_stderr():
    r = _run("")
    assert r.returncode == 0 and r.stderr.count("committed a.ckpt") == 1, r.stderr
