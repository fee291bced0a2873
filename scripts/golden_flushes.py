"""Record, or compare against a record, what a restructure must leave unchanged (issue 47): the collective log of every
rank in the simulated device's end-to-end cases and in the exchanging in-process ranks' two-level cases (each call,
its communicator, root, count and dtype, in order), and the sizing command's output for Llama-7B at 1024 ranks (both
buckets, with and without NVLS), byte for byte.

    .venv/bin/python scripts/golden_flushes.py record tests/golden            # at the commit a restructure starts from
    .venv/bin/python scripts/golden_flushes.py compare tests/golden           # after it: exit 1 naming what differs
    .venv/bin/python scripts/golden_flushes.py compare tests/golden --logs-only   # the logs alone (a minute)

The logs are also compared by ``tests/repo/test_golden_flushes.py`` (the sizing, minutes per run, only here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZING = {  # file name -> size_the_win's arguments (the documented Llama-7B command at 1024 ranks)
    "size_the_win_llama-7b_1024.txt": ["--model", "llama-7b", "--world-size", "1024"],
    "size_the_win_llama-7b_1024_no-nvls.txt": ["--model", "llama-7b", "--world-size", "1024", "--no-nvls"],
}
LOGS = "flush_logs.json"


def _tests_on_path() -> None:
    if str(ROOT) not in sys.path:  # the tests and their support code, as the package ``tests``
        sys.path.insert(0, str(ROOT))


def _calls(runtimes: list[Any]) -> list[list[list[Any]]]:
    """Every rank's collective log as JSON values: (name, root, count, dtype) per call."""
    return [[[name, root, count, str(dtype)] for name, root, count, dtype in rt.collective_log] for rt in runtimes]


def sim_logs() -> dict[str, Any]:
    """Each of ``test_sim_e2e``'s one- and two-level cases, run as the test runs it."""
    import pytest

    from tests.sim import test_sim_e2e as e2e
    from tests.support.sim.cuda import Sim

    out: dict[str, Any] = {}
    for case, (ws, stage, ga, algo, bucket, dtype) in e2e.ONE_LEVEL.items():
        with Sim(hang_bound_s=20) as sim:
            runtimes, _ = e2e._run(sim, ws, stage, ga, algo, bucket, dtype)
            out[f"sim/{case}"] = _calls(runtimes)
            e2e._cleanup(sim, runtimes)
    for case, (ws, per_node, stage, ga, step, layout) in e2e.TWO_LEVEL.items():
        with pytest.MonkeyPatch.context() as monkeypatch, Sim(hang_bound_s=20) as sim:
            e2e._two_level(monkeypatch, sim, per_node, step, layout)
            runtimes, _ = e2e._run(sim, ws, stage, ga, "two_level", 64)
            out[f"sim/{case}"] = _calls(runtimes)
            e2e._cleanup(sim, runtimes)
    return out


def exchange_logs() -> dict[str, Any]:
    """``test_two_level_exchange``'s cases (ws 4, 6, 8; by owner and balanced), three steps each."""
    import pytest

    from tests.exchange import test_two_level_exchange as tx

    out: dict[str, Any] = {}
    for ws, per_node in ((4, 2), (6, 2), (8, 4)):
        for layout in ("by_owner", "balanced"):
            with pytest.MonkeyPatch.context() as monkeypatch:
                tx._rail_layout(monkeypatch, layout)
                world, runtimes = tx._world(ws, per_node, monkeypatch)
                for step in range(3):
                    tx._step(world, runtimes, ws, step)
                out[f"exchange/ws{ws}-nodes{per_node}-{layout}"] = _calls(runtimes)
    return out


def logs() -> dict[str, Any]:
    _tests_on_path()
    return {**sim_logs(), **exchange_logs()}


def sizing(name: str) -> str:
    """The command's output, byte for byte but for the two wall-clock readings it prints (``built in``, ``wall
    time``), which no code change keeps."""
    args = [sys.executable, str(ROOT / "scripts" / "size_the_win.py"), *SIZING[name]]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"},
                          check=True)
    return re.sub(r"(built in|wall time:) [0-9.]+ s", r"\1 * s", done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--logs-only", action="store_true", help="the collective logs, not the sizing")
    args = parser.parse_args(argv)
    folder: Path = args.folder
    names = [] if args.logs_only else list(SIZING)
    if args.action == "record":
        folder.mkdir(parents=True, exist_ok=True)
        (folder / LOGS).write_text(json.dumps(logs(), indent=0, sort_keys=True) + "\n")
        for name in names:
            (folder / name).write_text(sizing(name))
        print(f"golden_flushes: recorded {LOGS}{''.join(', ' + n for n in names)} in {folder}")
        return 0
    differ = []
    want = json.loads((folder / LOGS).read_text())
    got = logs()
    for case in sorted(set(want) | set(got)):
        if want.get(case) != got.get(case):
            differ.append(f"{case}: the collective logs differ")
    for name in names:
        if (folder / name).read_text() != sizing(name):
            differ.append(f"{name}: the sizing output differs")
    for line in differ:
        print(f"golden_flushes: {line}")
    print(f"golden_flushes: {len(want)} logged cases{' and ' + str(len(names)) + ' sizing outputs' if names else ''} "
          f"compared: {'identical' if not differ else f'{len(differ)} differ'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
