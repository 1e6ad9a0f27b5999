"""LocalSandbox: the escapes a model would try, each contained and reported, with the test process unharmed.

Where a guarantee depends on what the kernel allows (namespaces), the test asks `sandbox_capabilities()`
and checks the weaker, documented promise when it is not in force; on the development machine (Linux
6.18, root) everything is in force.
"""

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from hflow.sandbox import (
    LocalSandbox,
    RemoteSandbox,
    SandboxLimits,
    SandboxResult,
    make_sandbox,
    run_code,
    sandbox_capabilities,
)
from hflow.sandbox import local

REPO_ROOT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(cpu_time_s=2, wall_time_s=3, memory_mb=256, max_processes=8)
SLACK_S = 2.5  # killing and reaping after a limit, on a busy 2-core machine


@pytest.fixture(scope="module")
def caps():
    return sandbox_capabilities()


@pytest.fixture(autouse=True)
def parent_unharmed():
    """Whatever the sandboxed code did, this process keeps its environment, cwd and limits."""
    def environment():
        return {key: value for key, value in os.environ.items() if key != "PYTEST_CURRENT_TEST"}

    env, cwd = environment(), os.getcwd()
    names = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC")
    rlimits = {name: resource.getrlimit(getattr(resource, name)) for name in names}
    yield
    assert environment() == env and os.getcwd() == cwd
    assert {name: resource.getrlimit(getattr(resource, name)) for name in rlimits} == rlimits
    assert len(bytearray(64 * 2**20)) == 64 * 2**20  # can still allocate


@pytest.fixture
def own_tmpdir(tmp_path, monkeypatch):
    """Work dirs under this test's tmp_path: their paths (in every sandbox process's command line) mark them."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def run(code: str, limits: SandboxLimits = LIMITS, stdin: str = "") -> SandboxResult:
    return LocalSandbox(limits).run(textwrap.dedent(code), stdin=stdin)


# ---- normal paths --------------------------------------------------------------------------------


def test_stdout_stderr_exit_code_and_stdin():
    result = run(
        """
        import sys
        name = input()
        print("hello", name)
        print("to stderr", file=sys.stderr)
        sys.exit(3)
        """,
        stdin="world\n",
    )
    assert (result.status, result.exit_code, result.limit_hit) == ("error", 3, None)
    assert result.stdout == "hello world\n" and result.stderr == "to stderr\n"
    assert 0 < result.duration_s < 5


def test_ok_and_result_dict():
    result = run_code("print('é', 6 * 7)", limits=LIMITS)
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "é 42\n")
    assert set(result.to_dict()) == {
        "status", "exit_code", "stdout", "stderr", "limit_hit", "duration_s", "network_isolated"
    }
    json.dumps(result.to_dict())


def test_syntax_error_and_exception_are_errors():
    result = run("def broken(:\n")
    assert (result.status, result.exit_code) == ("error", 1) and "SyntaxError" in result.stderr
    result = run("1 / 0")
    assert result.status == "error" and result.limit_hit is None and "ZeroDivisionError" in result.stderr


def test_invalid_utf8_output_is_replaced():
    result = run("import sys; sys.stdout.buffer.write(b'a\\xffb')")
    assert result.status == "ok" and result.stdout == "a\ufffdb"


def test_fresh_empty_work_dir_removed_afterwards(own_tmpdir):
    code = "import os; print(os.getcwd()); print(sorted(os.listdir('.'))); open('left.txt', 'w').write('x')"
    first, second = run(code), run(code)
    first_dir, first_listing = first.stdout.splitlines()
    assert first_listing == "['main.py']" and second.stdout.splitlines()[1] == "['main.py']"
    assert first_dir != second.stdout.splitlines()[0]
    assert not os.path.exists(first_dir) and list(own_tmpdir.iterdir()) == []


def test_environment_is_minimal():
    result = run("import json, os; print(json.dumps(dict(os.environ)))")
    env = json.loads(result.stdout)
    assert set(env) == {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"}
    assert env["PATH"] == "/usr/bin:/bin" and env["LANG"] == "C.UTF-8" and env["HOME"].startswith(tempfile.gettempdir())


@pytest.mark.parametrize("module", ["hflow", "torch", "numpy"])
def test_trainer_modules_are_not_importable(module):
    result = run(f"import {module}")
    assert result.status == "error" and f"ModuleNotFoundError: No module named '{module}'" in result.stderr


def test_sys_path_holds_the_stdlib_only():
    result = run("import sys; print('\\n'.join(sys.path))")
    paths = result.stdout.split()
    assert paths and not any("site-packages" in p or p in ("", ".") or str(REPO_ROOT) in p for p in paths)


# ---- limits --------------------------------------------------------------------------------------


def test_rlimits_are_set_in_the_code_process(caps):
    limits = SandboxLimits(cpu_time_s=1.5, memory_mb=300, max_file_bytes=12345, max_processes=5)
    names = ["CPU", "AS", "FSIZE", "CORE", "NPROC"]
    result = run(f"import resource as r\nfor n in {names}:\n    print(*r.getrlimit(getattr(r, 'RLIMIT_' + n)))", limits)
    cpu, memory, file_size, core, nproc = result.stdout.splitlines()
    assert (cpu, memory, file_size, core) == ("2 3", f"{300 * 2**20} {300 * 2**20}", "12345 12345", "0 0")
    if caps["nproc_rlimit"] == "per_sandbox":
        assert nproc == "7 7"  # the code's 5, plus the launcher and init, which share the namespace's count


def test_infinite_loop_is_stopped_by_cpu_time():
    limits = SandboxLimits(cpu_time_s=1, wall_time_s=8, memory_mb=256)
    result = run("while True: pass", limits)
    # cpu_time unless the machine is so busy that 1 s of CPU takes over 8 s of wall time
    assert result.status == "limit" and result.limit_hit in ("cpu_time", "wall_time")
    assert result.duration_s < 8 + SLACK_S


def test_caught_sigxcpu_still_ends_as_cpu_time():
    limits = SandboxLimits(cpu_time_s=1, wall_time_s=8, memory_mb=256)
    result = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass", limits)
    assert result.status == "limit" and result.limit_hit in ("cpu_time", "wall_time")


def test_sleep_is_stopped_by_wall_time():
    limits = SandboxLimits(wall_time_s=1.5)
    start = time.monotonic()
    result = run("import time\nprint('started', flush=True)\ntime.sleep(60)", limits)
    assert (result.status, result.limit_hit, result.exit_code) == ("limit", "wall_time", None)
    assert result.stdout == "started\n"  # unbuffered: what it printed before the kill is kept
    assert 1.5 <= time.monotonic() - start < 1.5 + SLACK_S


@pytest.mark.parametrize(
    "bomb",
    [
        "import os\nwhile True:\n    os.fork()",
        # one that outlives failed forks: RLIMIT_NPROC alone leaves it spinning until the wall time
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    ],
    ids=["plain", "resilient"],
)
def test_fork_bomb_is_contained_and_leaves_no_process(caps, own_tmpdir, bomb):
    start = time.monotonic()
    result = run(bomb)
    assert result.status == "limit" and time.monotonic() - start < LIMITS.wall_time_s + SLACK_S
    if caps["process_watchdog"] or caps["nproc_rlimit"] != "not_enforced_root":
        assert result.limit_hit == "processes"  # stopped by the count, well before the wall time
    else:
        assert result.limit_hit in ("processes", "wall_time")
    assert processes_mentioning(str(own_tmpdir)) == []


def test_detached_daemon_does_not_outlive_the_run(caps, own_tmpdir):
    if not caps["pid_namespace"]:
        pytest.skip("without a pid namespace a setsid() daemon survives (documented)")
    code = """
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        print("parent done")
        """
    result = run(code)
    assert result.status == "ok" and result.stdout == "parent done\n" and result.duration_s < 2
    assert processes_mentioning(str(own_tmpdir)) == []


def test_background_child_holding_the_pipes_does_not_delay_the_result():
    result = run("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])")
    assert result.status == "ok" and result.duration_s < LIMITS.wall_time_s


def test_huge_allocation_is_a_memory_limit():
    result = run("x = bytearray(10 * 2**30)")
    assert (result.status, result.limit_hit) == ("limit", "memory") and "MemoryError" in result.stderr


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut_without_reaching_memory(stream):
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    start = time.monotonic()
    result = run(f"import sys\nchunk = 'x' * 2**20\nfor _ in range(1024):\n    sys.{stream}.write(chunk)")
    assert (result.status, result.limit_hit, result.exit_code) == ("limit", "output", None)
    assert len(getattr(result, stream)) == LIMITS.max_output_bytes
    assert time.monotonic() - start < LIMITS.wall_time_s
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 100 * 1024


def test_big_file_is_a_file_size_limit():
    limits = SandboxLimits(max_file_bytes=2**20, wall_time_s=5)
    result = run("open('big.bin', 'wb').write(b'x' * (4 * 2**20))", limits)
    assert (result.status, result.limit_hit) == ("limit", "file_size")


def test_processes_within_the_limit_work():
    result = run(
        """
        import subprocess, sys
        outs = [subprocess.run([sys.executable, "-c", f"print({i})"], capture_output=True, text=True).stdout
                for i in range(3)]
        print("".join(outs).split())
        """
    )
    assert result.status == "ok" and result.stdout == "['0', '1', '2']\n"


# ---- isolation -----------------------------------------------------------------------------------


def test_writes_outside_the_work_dir_fail(caps, own_tmpdir, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")  # not under the work dir's parent
    target = outside / "existing.txt"
    target.write_text("original")
    elsewhere = Path("/tmp") / f"hflow-escape-{uuid.uuid4().hex}.txt"
    paths = [str(target), str(outside / "new.txt"), "../escape.txt", str(elsewhere)]
    code = f"""
        for path in {paths!r}:
            try:
                with open(path, "w") as f:
                    f.write("escaped")
                print("wrote", path)
            except OSError as err:
                print("refused", path, err.errno)
        """
    try:
        result = run(code)
        assert result.status == "ok"
        if not caps["filesystem_readonly"]:
            pytest.skip("no mount namespace here: a same-uid process can write where the uid can (documented)")
        assert "wrote" not in result.stdout and result.stdout.count("refused") == 4
        assert target.read_text() == "original" and not (outside / "new.txt").exists()
        assert not (own_tmpdir / "escape.txt").exists() and not elsewhere.exists()
    finally:
        elsewhere.unlink(missing_ok=True)


def test_parent_environment_is_out_of_reach(caps, monkeypatch):
    monkeypatch.setenv("HFLOW_SANDBOX_TEST_SECRET", "s3cr3t-value")
    code = """
        import os
        found = []
        for pid in ["self", str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                if b"s3cr3t-value" in open(f"/proc/{pid}/environ", "rb").read():
                    found.append(pid)
            except OSError:
                pass
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print("env", "HFLOW_SANDBOX_TEST_SECRET" in os.environ, "found", found, "ppid", os.getppid(), "pids", pids)
        """
    result = run(code)
    assert result.status == "ok" and "env False" in result.stdout
    if not caps["proc_isolated"]:
        pytest.skip("no pid namespace here: /proc of same-uid processes is readable (documented)")
    # Its parent is the sandbox's init (pid 1); the trainer is not in its pid namespace at all.
    assert "found [] ppid 1 pids [1, 2]" in result.stdout
    assert os.environ["HFLOW_SANDBOX_TEST_SECRET"] == "s3cr3t-value"


@pytest.fixture
def tcp_server():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)
    accepted = []

    def accept():
        try:
            accepted.append(server.accept()[0])
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    try:
        server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
    except OSError:
        pass
    server.close()
    thread.join()
    for conn in accepted:
        conn.close()


CONNECT = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    print("connected")
except OSError as err:
    print("failed", err)
"""


def test_network_is_cut(caps, tcp_server):
    port, accepted = tcp_server
    result = run(CONNECT.format(port=port))
    assert result.status == "ok" and result.network_isolated == caps["network_namespace"]
    if not result.network_isolated:
        pytest.skip("no network namespace here: the code can connect (documented, network_isolated=False)")
    assert result.stdout.startswith("failed") and accepted == []


def test_network_true_keeps_the_network(tcp_server):
    port, accepted = tcp_server
    result = run(CONNECT.format(port=port), SandboxLimits(network=True))
    assert result.stdout == "connected\n" and result.network_isolated is False


def test_namespaces_are_used_where_the_os_allows_them(caps):
    # The isolation tests above accept a weaker promise where namespaces are refused; this one makes
    # sure the sandbox does not fall back to it where util-linux's unshare shows they work.
    probe = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "true"]
    try:
        allowed = subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except FileNotFoundError:
        pytest.skip("no unshare(1) here to tell whether namespaces are allowed")
    if not allowed:
        pytest.skip("this machine refuses unprivileged namespaces")
    in_force = ("user_namespace", "network_namespace", "mount_namespace", "pid_namespace", "uid_mapped")
    assert all(caps[key] for key in in_force), caps
    assert caps["filesystem_readonly"] and caps["proc_isolated"] and caps["process_watchdog"], caps


def test_code_has_no_capabilities(caps):
    result = run("print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
    assert result.stdout.strip() == "0000000000000000"


def test_code_cannot_kill_or_fake_its_supervisor(caps):
    # A sandbox_error must mean the sandbox failed: the code must not be able to cause one.
    result = run("import os, signal\nos.killpg(0, signal.SIGKILL)")
    assert result.status == "error"
    if not caps["pid_namespace"]:
        pytest.skip("without a pid namespace the code can signal its supervisor (counted as the code's error)")
    assert result.exit_code == -9
    code = """
        import os, signal
        for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM, signal.SIGCHLD):
            os.kill(1, sig)  # the sandbox's init ignores them
        for fd in os.listdir("/proc/1/fd"):  # its report pipe among them
            try:
                open(f"/proc/1/fd/{fd}", "w").write('{"exit_code": 0, "watchdog": null}\\n')
                print("forged", fd)
            except OSError:
                pass
        raise SystemExit(5)
        """
    result = run(code)
    assert (result.status, result.exit_code, result.stdout) == ("error", 5, "")


def test_tempfile_works_in_the_work_dir(caps):
    result = run("import os, tempfile\nprint(tempfile.gettempdir() == os.getcwd())")
    assert result.status == "ok" and result.stdout == f"{caps['filesystem_readonly']}\n"


def test_capabilities_report(caps):
    namespaces = {"user_namespace", "network_namespace", "mount_namespace", "pid_namespace"}
    assert namespaces | {"filesystem_readonly", "proc_isolated", "nproc_rlimit"} <= set(caps)
    assert caps["rlimits"][:4] == ["RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_CORE"]


def test_sandbox_dies_with_its_parent(own_tmpdir):
    # A scoring worker killed at its deadline must not leave the code running.
    helper = f"""
import tempfile
tempfile.tempdir = {str(own_tmpdir)!r}
from hflow.sandbox import run_code, SandboxLimits
run_code("import time; time.sleep(60)", limits=SandboxLimits(wall_time_s=60))
"""
    proc = subprocess.Popen([sys.executable, "-c", helper], cwd=REPO_ROOT)
    deadline = time.monotonic() + 10
    while not processes_mentioning(f"{own_tmpdir}/hflow-sandbox-") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # let the code start
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while processes_mentioning(str(own_tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_mentioning(str(own_tmpdir)) == []


def test_without_namespaces_the_rest_still_holds(monkeypatch, own_tmpdir):
    # What a machine that refuses namespaces gets: rlimits, wall time, env, fresh dir; network_isolated False.
    monkeypatch.setattr(local, "_NAMESPACES", False)
    result = run("import os; print(sorted(os.environ))")
    assert result.status == "ok" and result.network_isolated is False and "HOME" in result.stdout
    assert run("x = bytearray(10 * 2**30)").limit_hit == "memory"
    assert run("import time; time.sleep(60)", SandboxLimits(wall_time_s=1)).limit_hit == "wall_time"
    assert run("import hflow").status == "error"
    assert processes_mentioning(str(own_tmpdir)) == []


def test_unsupported_language_is_a_usage_error():
    with pytest.raises(ValueError, match="language='python'"):
        LocalSandbox().run("console.log(1)", language="javascript")


# ---- configuration -------------------------------------------------------------------------------


def test_make_sandbox():
    sandbox = make_sandbox()
    assert isinstance(sandbox, LocalSandbox) and sandbox.limits == SandboxLimits()
    sandbox = make_sandbox({"backend": "local", "wall_time_s": 5, "memory_mb": 512, "url": None})
    assert sandbox.limits == SandboxLimits(wall_time_s=5, memory_mb=512)
    remote = make_sandbox({"backend": "remote", "url": "http://h:8080/run_code", "wall_time_s": 7, "max_retries": 1})
    assert isinstance(remote, RemoteSandbox) and remote.limits.wall_time_s == 7 and remote.timeout_s == 17
    assert remote.max_retries == 1


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"wall_time": 5}, r"unknown sandbox config key 'wall_time'; the keys are \[.*'wall_time_s'"),
        ({"backend": "docker"}, r"backend='docker'; choose one of \['local', 'remote'\]"),
        ({"backend": "remote"}, "needs url"),
        ({"url": "http://h/run_code"}, "apply to backend='remote' only"),
        ({"memory_mb": -1}, "memory_mb=-1; give a positive number"),
        ({"max_processes": 2.5}, "give a whole number"),
        ({"network": "yes"}, "give true or false"),
        ({"backend": "remote", "url": "h:8080"}, "full http"),
    ],
)
def test_make_sandbox_rejects_bad_config(config, message):
    with pytest.raises(ValueError, match=message):
        make_sandbox(config)


# ---- CLI -----------------------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hflow.sandbox", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )


def test_cli_runs_a_file_and_prints_json(tmp_path):
    program, given = tmp_path / "prog.py", tmp_path / "in.txt"
    program.write_text("print(input()[::-1])\nimport time\ntime.sleep(60)\n")
    given.write_text("abc\n")
    done = cli(str(program), "--stdin", str(given), "--wall-time-s", "1", "--memory-mb", "256")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["stdout"] == "cba\n" and result["limit_hit"] == "wall_time" and result["status"] == "limit"


def test_cli_bad_usage(tmp_path):
    done = cli(str(tmp_path / "missing.py"))
    assert done.returncode == 2 and "cannot read file" in done.stderr and "missing.py" in done.stderr
    (tmp_path / "p.py").write_text("pass")
    done = cli(str(tmp_path / "p.py"), "--max-processes", "0")
    assert done.returncode == 2 and "max_processes=0" in done.stderr
