"""Timing and peak-memory helpers shared by the CPU benchmark scripts (best-of-N wall time, extra peak RSS
of one call measured in a fresh process)."""
import re
import subprocess
import sys
import time
from typing import Callable, List, Optional


def time_call(fn: Callable[[], None], repeats: int) -> float:
    """Best of ``repeats`` wall-clock seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _status_kb(field: str) -> int:
    with open('/proc/self/status') as f:
        return int(re.search(rf'{field}:\s+(\d+) kB', f.read()).group(1))


def extra_peak_mib(fn: Callable[[], None]) -> float:
    """Extra peak resident MiB of one ``fn()`` in this process (VmHWM reset to VmRSS first, Linux)."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # reset VmHWM to the current RSS
    before = _status_kb('VmRSS')
    fn()
    return (_status_kb('VmHWM') - before) / 1024


def probe_in_subprocess(script: str, args: List[str]) -> Optional[float]:
    """Run ``python script args`` (a script's own probe mode, printing one number last) in a fresh process."""
    res = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    if res.returncode != 0:
        print(f'memory probe failed ({" ".join(args)}): {res.stderr.strip()[-300:]}', file=sys.stderr)
        return None
    return float(res.stdout.strip().splitlines()[-1])


def fmt(value: Optional[float], unit: str = '') -> str:
    """'12.3' for a number (seconds shown as ms with unit 'ms'), '-' for None."""
    if value is None:
        return '-'
    return f'{value * 1000:.1f}' if unit == 'ms' else f'{value:.1f}'
