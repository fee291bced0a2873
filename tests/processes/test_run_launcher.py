"""``python -m owner_reduce.run``: the command line each launcher produces, the user's code run as ``__main__`` with
its own arguments, exit codes and exceptions passed through, and (one real process) a launcher's SIGTERM reaching
the user's code because there is no process in between. The launchers themselves: test_launchers_e2e.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import owner_reduce
from owner_reduce import run as launcher
from owner_reduce.run import Target, UsageError, parse


@pytest.mark.parametrize(("argv", "target"), [
    (["train.py", "--lr", "1", "-m", "x"], Target(False, "train.py", ("train.py", "--lr", "1", "-m", "x"))),
    (["-m", "pkg.train", "--lr", "1"], Target(True, "pkg.train", ("pkg.train", "--lr", "1"))),
    (["-mpkg.train", "a"], Target(True, "pkg.train", ("pkg.train", "a"))),
    # DeepSpeed's launcher: python -u -m owner_reduce.run --local_rank=N train.py ARGS
    (["--local_rank=1", "train.py", "--x"], Target(False, "train.py", ("train.py", "--local_rank=1", "--x"))),
    # torch.distributed.launch: --local-rank=N; and the two-token form
    (["--local-rank=0", "-m", "t", "a"], Target(True, "t", ("t", "--local-rank=0", "a"))),
    (["--local_rank", "3", "train.py"], Target(False, "train.py", ("train.py", "--local_rank", "3"))),
    (["--accelerate-backend", "gloo", "train.py", "--accelerate-backend", "x"],
     Target(False, "train.py", ("train.py", "--accelerate-backend", "x"), "gloo")),
    (["--accelerate-backend=gloo", "--local_rank=0", "-m", "t"], Target(True, "t", ("t", "--local_rank=0"), "gloo")),
    (["train.py", "--help"], Target(False, "train.py", ("train.py", "--help"))),
])
def test_parse_hands_everything_from_the_script_on_to_it(argv, target):
    assert parse(argv) == target


@pytest.mark.parametrize(("argv", "message"), [
    ([], "no script"),
    (["--local_rank=0"], "no script"),
    (["-m"], "-m needs a module"),
    (["--lr", "1", "train.py"], "unknown option '--lr'"),
    (["--accelerate-backend"], "needs a value"),
    (["--accelerate-backend="], "needs a value"),
    (["--local_rank"], "needs a value"),
    (["--help"], ""),
])
def test_parse_refuses_what_names_no_target(argv, message):
    with pytest.raises(UsageError) as e:
        parse(argv)
    assert message in str(e.value) and (message or not str(e.value))


@pytest.fixture
def clean_process():
    """main() installs and rewrites sys.argv / sys.path[0]: start uninstalled, then put all three back."""
    argv, path0, was_installed = list(sys.argv), sys.path[0], owner_reduce.is_installed()
    owner_reduce.uninstall()
    yield
    sys.argv[:] = argv
    sys.path[0] = path0
    owner_reduce.uninstall()
    if was_installed:
        owner_reduce.install()


RECORDER = textwrap.dedent("""
    import json, signal, sys
    import owner_reduce
    if "--install-too" in sys.argv:
        owner_reduce.install()  # a script that installs itself still works (install() is idempotent)
    with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
        json.dump({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "installed": owner_reduce.is_installed(),
                   "main_is_me": sys.modules["__main__"].__dict__ is globals(),
                   "handlers": [repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)]}, f)
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
    if "--raise" in sys.argv:
        raise KeyError("from the user's script")
""")


def _recorded(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


@pytest.mark.parametrize("install_too", [False, True])
def test_a_script_runs_as_main_with_its_own_argv(tmp_path, clean_process, install_too):
    script = tmp_path / "sub" / "train.py"
    script.parent.mkdir()
    script.write_text(RECORDER)
    out = tmp_path / "out.json"
    assert not owner_reduce.is_installed()
    extra = ["--install-too"] if install_too else []
    # What the process had (a shell's background job starts with SIGINT ignored, for one): the launcher keeps it.
    handlers = [repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)]
    launcher.main(["--local_rank=1", str(script), "--out", str(out), "--lr", "3", *extra])
    r = _recorded(out)
    assert r["argv"] == [str(script), "--local_rank=1", "--out", str(out), "--lr", "3", *extra]
    assert r["name"] == "__main__" and r["main_is_me"], "the script is sys.modules['__main__'] while it runs"
    assert r["path0"] == str(script.parent), "sys.path[0] is the script's folder, as `python train.py` sets it"
    assert r["installed"], "owner_reduce.install() ran before the script"
    assert r["handlers"] == handlers, "the launcher installs no signal handler"


def test_a_module_runs_as_main(tmp_path, clean_process, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out.json"
    launcher.main(["-m", "userpkg.train", "--out", str(out), "a"])
    r = _recorded(out)
    assert r["argv"] == [str(pkg / "train.py"), "--out", str(out), "a"], "argv[0]: the module's file, as `python -m`"
    assert r["name"] == "__main__" and r["main_is_me"] and r["installed"]


def test_exit_codes_and_exceptions_pass_through(tmp_path, clean_process):
    script = tmp_path / "train.py"
    script.write_text(RECORDER)
    with pytest.raises(SystemExit) as e:
        launcher.main([str(script), "--out", str(tmp_path / "o.json"), "--exit", "3"])
    assert e.value.code == 3
    with pytest.raises(KeyError, match="from the user's script"):
        launcher.main([str(script), "--out", str(tmp_path / "o.json"), "--raise"])


@pytest.mark.parametrize(("argv", "code", "stream", "says"), [
    (["nosuch.py"], 2, "err", "can't open file 'nosuch.py'"),
    (["-m", "nosuch_pkg.train"], 2, "err", "No module named 'nosuch_pkg.train'"),
    ([], 2, "err", "no script or -m module"),
    (["-h"], 0, "out", "usage: python -m owner_reduce.run"),
])
def test_usage_errors_exit_before_installing(capsys, monkeypatch, argv, code, stream, says):
    import owner_reduce.wiring.install as install_module

    def refuse() -> None:
        raise AssertionError("install() was called")

    monkeypatch.setattr(install_module, "install", refuse)
    with pytest.raises(SystemExit) as e:
        launcher.main(argv)
    assert e.value.code == code
    assert says in getattr(capsys.readouterr(), stream)


@pytest.mark.timeout(120)
def test_sigterm_reaches_the_script_in_the_launched_process(tmp_path):
    """A launcher signals the pid it started: that pid is the user's code (no child in between), with Python's
    default SIGTERM disposition, so the launcher sees -SIGTERM as if it had started the script itself."""
    script = tmp_path / "sleeper.py"
    ready = tmp_path / "pid"
    script.write_text(textwrap.dedent(f"""
        import os, time
        with open({str(ready)!r} + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace({str(ready)!r} + ".tmp", {str(ready)!r})
        time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "owner_reduce.run", str(script)], start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, f"exited early: {proc.returncode}"
            assert time.monotonic() < deadline, "the script never started"
            time.sleep(0.2)
        assert int(ready.read_text()) == proc.pid, "the script runs in the launched process itself"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
