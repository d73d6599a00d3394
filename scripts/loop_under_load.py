"""Run pytest test ids again and again with busy loops beside them: the reproduction loop of timing bugs.

CI shares a 2-core machine with other work, so a timing bug shows up there and rarely on an idle
machine. This loop loads the cores the way CI's neighbours do (``--busy`` processes running
``while True: pass``), runs each test id ``--runs`` times in a fresh pytest, and counts passes:

    python scripts/loop_under_load.py --runs 10 --busy 2 \\
        'tests/e2e/test_afd_cpu.py::test_two_attention_ranks_share_one_ffn[tp2]' \\
        'tests/e2e/test_afd_cpu.py::test_two_attention_ranks_share_one_ffn[dp2]'

Each run's pytest output and server logs are kept under ``--out`` (default ``runs/loop``); with
``--stacks-after S`` a run still going after S seconds gets a ``py-spy dump`` of every process under
its pytest (``pip install py-spy``), written beside its logs, which is how a hang is read. The last
line is the tally per test id; the exit status is 1 if any run failed.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children first seen through /proc)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = pathlib.Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.append(child)
            frontier.append(child)
    return found


def _dump_stacks(pid: int, path: pathlib.Path) -> None:
    """``py-spy dump`` of every Python process under ``pid`` into ``path``."""
    py_spy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).with_name("py-spy"))
    with path.open("w") as out:
        for child in _descendants(pid):
            try:
                name = pathlib.Path(f"/proc/{child}/comm").read_text().strip()
            except OSError:
                continue
            out.write(f"=== pid {child} ({name})\n")
            out.flush()
            subprocess.run([py_spy, "dump", "--pid", str(child)], stdout=out, stderr=subprocess.STDOUT,
                           timeout=60, check=False)


def run_once(test_id: str, run_dir: pathlib.Path, stacks_after: float | None, timeout_s: float) -> tuple[bool, float]:
    """One fresh pytest of ``test_id``; (passed, seconds)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with (run_dir / "pytest.log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--basetemp",
             str(run_dir / "tmp"), test_id],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        dumped = False
        while process.poll() is None:
            elapsed = time.monotonic() - started
            if stacks_after is not None and not dumped and elapsed > stacks_after:
                _dump_stacks(process.pid, run_dir / "stacks.txt")
                dumped = True
            if elapsed > timeout_s:
                process.kill()
                break
            time.sleep(1.0)
        process.wait()
    return process.returncode == 0, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_ids", nargs="+", help="pytest node ids, each run --runs times")
    parser.add_argument("--runs", type=int, default=10, help="runs per test id (default 10)")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the tests (default 2)")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "runs" / "loop", help="where runs keep logs")
    parser.add_argument("--stacks-after", type=float, default=None,
                        help="py-spy dump every process of a run still going after this many seconds")
    parser.add_argument("--timeout", type=float, default=900.0, help="kill a run after this many seconds")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be >= 1 and --busy >= 0")

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    tally: dict[str, list[bool]] = {test_id: [] for test_id in args.test_ids}
    try:
        for run in range(args.runs):
            for index, test_id in enumerate(args.test_ids):
                passed, seconds = run_once(test_id, args.out / f"test{index}-run{run}", args.stacks_after,
                                           args.timeout)
                tally[test_id].append(passed)
                print(f"run {run + 1}/{args.runs} {test_id}: {'pass' if passed else 'FAIL'} ({seconds:.0f} s)",
                      flush=True)
    finally:
        for process in busy:
            process.kill()
    for test_id, results in tally.items():
        print(f"{sum(results)}/{len(results)} passed with {args.busy} busy loops: {test_id}")
    return 0 if all(all(results) for results in tally.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
