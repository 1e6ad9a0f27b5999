"""The README's "Writing a worker" example runs as printed (on Ray and on the local backend)."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT


def test_writing_a_worker_example_runs(tmp_path):
    readme = (Path(REPO_ROOT) / "README.md").read_text()
    section = readme.split("### Writing a worker", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "readme_example.py").write_text(code + "\nprint('scores', out.batch['score'].tolist())\n")
    run = subprocess.run([sys.executable, "readme_example.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "scores [0.0, 2.0, 4.0, 6.0, 8.0]" in run.stdout
