"""Run loading cases in a separate process with a memory limit (:mod:`tests.security.worker`) and judge them.

A case is a dict: ``id``, ``entry`` (an entry point of the worker), ``path`` and the arguments the entry point
takes, ``marker`` (the file a planted payload would create) and ``names`` (what the error message must name: the
file or folder). :func:`assert_safe` holds every result to the promises of the Security page: no code ran, the
process survived, memory stayed bounded, and the error is one of aitoolbox's documented loading errors naming the
file.
"""
import json
import os
import subprocess
import sys
from typing import Dict, Iterable, List, Optional

# What a hostile file may cost beyond the process's memory before it is refused: the address-space limit of the
# worker and the growth of its peak resident memory that a case may cause.
MEMORY_LIMIT_MIB = 1024
PEAK_GROWTH_MIB = 200
# The loading errors of the Security page. A bucket adds the errors of its downloads (a refused folder marker is
# a ValueError, a missing object a CloudNotFoundError).
DOCUMENTED = {"CheckpointLoadError"}
DOCUMENTED_BUCKET = DOCUMENTED | {"CloudStorageError", "ValueError"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cases(cases: List[dict], work: str, memory_limit_mib: int = MEMORY_LIMIT_MIB, timeout: float = 600,
              warm_up: Iterable[dict] = (), per_process: int = 250) -> Dict[str, dict]:
    """Results by case id, ``per_process`` cases to a process. Raises AssertionError naming the case that killed
    its process (or hung it)."""
    results: Dict[str, dict] = {}
    for start in range(0, len(cases), per_process):
        results.update(_run_batch(cases[start:start + per_process], os.path.join(work, f"batch{start}"),
                                  memory_limit_mib, timeout, list(warm_up)))
    return results


def _run_batch(cases: List[dict], work: str, memory_limit_mib: int, timeout: float,
               warm_up: List[dict]) -> Dict[str, dict]:
    os.makedirs(work, exist_ok=True)
    spec_path, results_path = os.path.join(work, "spec.json"), os.path.join(work, "results.jsonl")
    with open(spec_path, "w") as handle:
        json.dump({"memory_limit_mib": memory_limit_mib, "results": results_path, "cases": cases,
                   "warm_up": warm_up}, handle)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    try:
        process = subprocess.run([sys.executable, "-m", "tests.security.worker", spec_path], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=timeout)
        returncode, stderr = process.returncode, process.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, stderr = "timeout", str(expired.stderr)
    lines = [json.loads(line) for line in open(results_path)] if os.path.exists(results_path) else []
    results = {line["id"]: line for line in lines if "id" in line}
    started = [line["start"] for line in lines if "start" in line]
    if returncode != 0 or len(results) != len(cases):
        last = started[-1] if started else None
        raise AssertionError(f"the loading process ended with {returncode} during case {last!r} "
                             f"({next((c for c in cases if c['id'] == last), None)}); stderr: {stderr[-3000:]}")
    return results


def passed_over(case: dict, result: dict) -> bool:
    """auto_resume passed the hostile checkpoint over (a corrupt newest checkpoint is skipped with a warning, issue 33
    item 5): it continued from an earlier checkpoint of the run, or started a new run (``resumed_from`` None)."""
    resumed_from = result.get("resumed_from")
    return case["entry"].endswith("auto_resume") and result["outcome"] == "loaded" \
        and (resumed_from is None or resumed_from != case.get("path"))


def assert_safe(case: dict, result: dict, documented: Optional[set] = None) -> None:
    """The promises of the Security page for one case."""
    documented = documented or (DOCUMENTED_BUCKET if case["entry"].startswith("bucket") else DOCUMENTED)
    where = f"case {case['id']} ({case['entry']}): {result}"
    assert not result["marker"], f"code from the file ran: {where}"
    assert result["peak_growth_mib"] <= PEAK_GROWTH_MIB, f"memory grew by {result['peak_growth_mib']} MiB: {where}"
    if result["outcome"] == "loaded":
        assert case.get("may_load") or passed_over(case, result), f"a hostile file loaded: {where}"
        return
    assert documented & set(result["bases"]), f"not a documented error: {where}"
    assert "MemoryError" not in result["chain"] and "allocate" not in result["message"], \
        f"refused only when memory ran out: {where}"
    assert any(name in result["message"] for name in case["names"]), f"the error does not name the file: {where}"
    if "CorruptCheckpointError" in result["bases"]:
        assert "weights_only=False" not in result["message"], f"a corrupt file gets trust advice: {where}"
