"""SB3's own tests as the judge of the drop-in: download the installed Stable-Baselines3's sdist,
unpack its ``tests/``, and run its buffer and off-policy algorithm tests twice in one pytest
session, with SB3's replay buffers (the control) and with shmbuf's (``sb3_swap.py`` as their
``conftest.py``). Every test the control passes must pass with shmbuf, or be in ``EXCEPTIONS``
with its reason (the same list as docs/integrations.md).

    python -m tests.conformance.sb3_suite            # the whole set (make conformance)
    python -m tests.conformance.sb3_suite --ci       # CI's selection (tests/test_sb3_conformance)

Nothing of SB3's is kept in this repository: the sdist is fetched with ``pip download`` into
``build/conformance/`` (ignored; ``$SHMBUF_CONFORMANCE_CACHE`` elsewhere) and reused there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SWAP = Path(__file__).with_name("sb3_swap.py")
DOWNLOAD_TIMEOUT = 120.0

# The whole set: the buffer tests and the files of SB3's suite that train DQN, SAC, TD3 or DDPG
# or build their replay buffers, less the on-policy models' tests (their rollout buffers are
# not replaced: both runs would run the same code). HER aside: test_her.py is not run, since
# HerReplayBuffer is SB3's own class, not replaced. test_n_step_replay.py is (cheap), although
# most of its tests use SB3's NStepReplayBuffer, which is not replaced either.
FULL = ["tests/test_buffers.py", "tests/test_run.py", "tests/test_cnn.py",
        "tests/test_dict_env.py", "tests/test_save_load.py", "tests/test_n_step_replay.py",
        "-k", "not A2C and not PPO"]

# CI's selection (40 s to 130 s on the 2-core VM for both runs, idle to loaded; the whole set
# 300 s to 610 s): test_buffers.py whole, and each off-policy algorithm and buffer option once:
CI = [
    "tests/test_buffers.py",
    # DQN, SAC, TD3, DDPG with n_envs=2 (one lane per env), train_freq in steps and episodes
    "tests/test_run.py::test_offpolicy_multi_env",
    "tests/test_run.py::test_train_freq",
    # image observations through VecTransposeImage (non-contiguous arrays), DQN/SAC/TD3
    "tests/test_cnn.py::test_cnn",
    # Dict observations (DictReplayBuffer), every off-policy algorithm, VecNormalize
    "tests/test_dict_env.py::test_consistency",
    "tests/test_dict_env.py::test_vec_normalize",
    # save/load_replay_buffer, optimize_memory_usage with handle_timeout_termination
    "tests/test_save_load.py::test_save_load_replay_buffer",
    "tests/test_save_load.py::test_warn_buffer",
    # a custom replay_buffer_class beside n_steps; _get_samples
    "tests/test_n_step_replay.py::test_n_steps_warns_with_custom_replay_buffer_class",
    "tests/test_n_step_replay.py::test_match_normal_buffer",
    "-k", "not A2C and not PPO",
]

# Tests the control passes that shmbuf's buffers fail by design: test id -> reason. The same
# list, with the same reasons, is in docs/integrations.md (SB3 section).
EXCEPTIONS: dict[str, str] = {}


class SdistUnavailable(RuntimeError):
    """SB3's sdist could not be downloaded or unpacked (no registry, no pip...)."""


@dataclass
class Report:
    """The two runs side by side: ``regressions`` (control passed, shmbuf did not, not an
    exception) must be empty; ``stale_exceptions`` lists exceptions that pass now."""

    version: str
    counts: dict[str, dict[str, int]]
    regressions: dict[str, str] = field(default_factory=dict)
    excepted: list[str] = field(default_factory=list)
    stale_exceptions: list[str] = field(default_factory=list)
    control_failures: list[str] = field(default_factory=list)
    swapped: int = 0  # tests of the shmbuf run that made shmbuf buffers

    @property
    def ok(self) -> bool:
        return not self.regressions and not self.stale_exceptions

    def summary(self) -> str:
        lines = [f"stable-baselines3 {self.version}: "
                 + "; ".join(f"{impl}: " + ", ".join(f"{n} {k}" for k, n in sorted(c.items()))
                             for impl, c in sorted(self.counts.items()))
                 + f"; {self.swapped} tests made shmbuf buffers"]
        lines += [f"  control failed (not judged): {t}" for t in self.control_failures]
        lines += [f"  excepted: {t}: {EXCEPTIONS[t]}" for t in self.excepted]
        lines += [f"  STALE EXCEPTION (passes now, remove it): {t}" for t in self.stale_exceptions]
        lines += [f"  REGRESSION: {t}\n{msg}" for t, msg in self.regressions.items()]
        lines.append("conformance: " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


def installed_version() -> str:
    from importlib.metadata import version

    return version("stable-baselines3")


def cache_dir() -> Path:
    return Path(os.environ.get("SHMBUF_CONFORMANCE_CACHE", ROOT / "build" / "conformance"))


def fetch(version: str | None = None, cache: Path | None = None) -> Path:
    """The unpacked sdist of ``stable-baselines3==version`` (the installed one by default):
    downloaded once with ``pip download --no-binary :all: --no-deps`` into ``cache``.

    Raises:
        SdistUnavailable: pip could not download it (the message says why) or it is malformed.
    """
    version = version or installed_version()
    cache = cache or cache_dir()
    root = cache / f"stable_baselines3-{version}"
    if (root / "tests" / "test_buffers.py").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"stable_baselines3-{version}.tar.gz"
    if not archive.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "-q", f"stable-baselines3=={version}", "-d", str(cache)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SdistUnavailable(f"pip download stable-baselines3=={version}: {e}") from e
        if done.returncode != 0 or not archive.exists():
            raise SdistUnavailable(f"pip download stable-baselines3=={version} failed "
                                   f"(exit {done.returncode}): {done.stderr.strip()[-500:]}")
    partial = cache / f".unpacking-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(partial, filter="data")
        unpacked = partial / root.name
        if not (unpacked / "tests" / "test_buffers.py").exists():
            raise SdistUnavailable(f"{archive} holds no tests/test_buffers.py")
        unpacked.rename(root)  # whole or not at all (another run may have won: fine)
    except OSError as e:
        if not (root / "tests" / "test_buffers.py").exists():
            raise SdistUnavailable(f"unpacking {archive}: {e}") from e
    except tarfile.TarError as e:
        raise SdistUnavailable(f"unpacking {archive}: {e}") from e
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return root


def run(root: Path, selection: list[str], timeout: float, per_test_timeout: float = 600.0,
        log: Path | None = None) -> dict:
    """Run ``selection`` of SB3's tests under both buffers in one session (``sb3_swap.py``
    as their conftest, SB3's pytest configuration), within ``timeout`` seconds; the results
    JSON. The session runs in its own process group, killed whole on timeout."""
    shutil.copyfile(SWAP, root / "tests" / "conftest.py")
    results = root / f"results-{os.getpid()}.json"
    results.unlink(missing_ok=True)
    env = dict(os.environ, SHMBUF_CONFORMANCE_RESULTS=str(results),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header",
           "-rN", "-o", f"timeout={per_test_timeout:g}", *selection]
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout)
        finally:
            _kill_group(proc)
    finally:
        if log is not None:
            out.close()
    if not results.exists():
        raise RuntimeError(f"SB3's test session left no results (exit {proc.returncode}): "
                           f"{' '.join(cmd)}" + (f"; see {log}" if log else ""))
    try:
        return json.loads(results.read_text())
    finally:
        results.unlink(missing_ok=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """End the session and anything it started (SubprocVecEnv workers), in its own group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # children left behind after the session exited
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.1)


def compare(results: dict) -> Report:
    """Judge shmbuf's run against the control's."""
    by_impl: dict[str, dict[str, dict]] = {"sb3": {}, "shmbuf": {}}
    for r in results["results"]:
        by_impl[r["impl"]][r["test"]] = r
    counts = {impl: {} for impl in by_impl}
    for impl, tests in by_impl.items():
        for r in tests.values():
            counts[impl][r["outcome"]] = counts[impl].get(r["outcome"], 0) + 1
    report = Report(results["version"], counts)
    report.swapped = sum(1 for r in by_impl["shmbuf"].values() if r.get("buffers"))
    if any(r.get("buffers") for r in by_impl["sb3"].values()):
        raise AssertionError("the control run made shmbuf buffers: the swap leaked into it")
    for test, control in sorted(by_impl["sb3"].items()):
        ours = by_impl["shmbuf"].get(test, {"outcome": "missing", "message": ""})
        if control["outcome"] != "passed":
            if control["outcome"] == "failed":
                report.control_failures.append(test)
            continue
        if test in EXCEPTIONS:
            (report.excepted if ours["outcome"] != "passed" else report.stale_exceptions
             ).append(test)
        elif ours["outcome"] != "passed":
            report.regressions[test] = f"    {ours['outcome']}: {ours['message'][-1500:]}"
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci", action="store_true", help="CI's selection, not the whole set")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the session")
    parser.add_argument("--log", type=Path, help="write the session's output here")
    args = parser.parse_args(argv)
    root = fetch()
    started = time.monotonic()
    report = compare(run(root, CI if args.ci else FULL, args.timeout, log=args.log))
    print(report.summary())
    print(f"({time.monotonic() - started:.0f} s, SB3's tests in {root / 'tests'})")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
