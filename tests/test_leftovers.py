"""The session check of conftest.py (issue 24): a test run that leaves a process of the pack or a /dev/shm frames
block behind fails, names what it left, and ends / removes it. Checked on an inner pytest run of one leaking test."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from _procs import process_alive, wait_gone

ROOT = Path(__file__).resolve().parent.parent
LEAK = '''
import subprocess, sys, time
from pathlib import Path

def test_leaks(tmp_path):
    ready = tmp_path / "ready"
    # a process named as a pack worker names itself (serving/worker.py: resources.set_process_name)
    code = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'ltx2mgpu-rank0', 0, 0, 0); "
            f"open({str(ready)!r}, 'w').close(); time.sleep(600)")
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    while not ready.exists():
        time.sleep(0.05)
    Path("/dev/shm/ltx2mgpu-999999999-1").write_bytes(b"frames")  # a writer pid above any pid_max: gone
'''


def test_a_run_that_leaves_a_worker_or_a_frames_block_behind_fails(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leak.py").write_text(textwrap.dedent(LEAK))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LTX2_MGPU_TEST_LEFTOVER_GRACE_S": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_leak.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 passed" in out  # the test itself passed: the run fails for what it left
    assert "left behind by this test run (issue 24): 1 process(es), 1 /dev/shm block(s)" in out, out
    pid = int(re.search(r"process (\d+) ltx2mgpu-rank0: ", out).group(1))
    assert wait_gone([pid]) and not process_alive(pid)  # ended by the check
    assert "/dev/shm/ltx2mgpu-999999999-1" in out and not Path("/dev/shm/ltx2mgpu-999999999-1").exists()
