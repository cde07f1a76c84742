"""Resource report of every Triton kernel configuration, compiled ahead of time (no GPU needed).

Each spec of each ``kernels/*.py`` module's ``aot_specs()`` is compiled for the given compute
capabilities with Triton's bundled ``ptxas`` (``tools/aot.py``); the table lists registers per
thread, spill stores / loads (bytes per thread), shared memory per block against the target's limit
(163 KiB sm_80, 227 KiB sm_90) and the compile time. ``status`` is ``ok``, ``SPILLS`` (a default
config spills), ``SMEM`` (over the limit) or ``ERROR`` (did not compile; the message follows the
table). Exit status 1 if any row is not ``ok``.

    ./run.sh bench kernel_resources                       # sm_80 and sm_90
    ./run.sh bench kernel_resources --capability 90 --json resources.json
    ./run.sh bench kernel_resources --filter '_d64_' --jobs 8
"""
import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from tools import aot  # noqa: E402  (development tooling in the repository, not installed)


def status(item: Any) -> str:
    """'ok', 'SPILLS', 'SMEM', 'SPILLS+SMEM' or 'ERROR' for a report (or the exception raised instead)."""
    if isinstance(item, Exception):
        return 'ERROR'
    flags = []
    if item.default and (item.spill_store_bytes or item.spill_load_bytes):
        flags.append('SPILLS')
    if item.shared_bytes > item.shared_limit:
        flags.append('SMEM')
    return '+'.join(flags) or 'ok'


def table(rows: List[Dict[str, Any]]) -> str:
    """Markdown table of report rows (dicts from :func:`row`)."""
    cols = ['kernel', 'config', 'sm', 'warps', 'stages', 'registers', 'spill st/ld B', 'shared KiB',
            'limit KiB', 'compile s', 'status']
    lines = ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)]
    for r in rows:
        lines.append('| ' + ' | '.join(str(r[c]) for c in cols) + ' |')
    return '\n'.join(lines)


def row(spec: Dict[str, Any], capability: int, item: Any) -> Dict[str, Any]:
    """One table row for a spec compiled (or failed) at a capability."""
    kernel = spec.get('kernel') or spec['fn'].__name__
    base = {'kernel': f'{spec["module"]}.{kernel}', 'config': spec['name'], 'sm': capability,
            'warps': spec['num_warps'], 'stages': spec['num_stages'], 'status': status(item),
            'limit KiB': aot.shared_limit(capability) // 1024}
    if isinstance(item, Exception):
        return dict(base, **{'registers': '-', 'spill st/ld B': '-', 'shared KiB': '-', 'compile s': '-',
                             'error': str(item)})
    return dict(base, **{'registers': item.registers,
                         'spill st/ld B': f'{item.spill_store_bytes}/{item.spill_load_bytes}',
                         'shared KiB': f'{item.shared_bytes / 1024:.1f}',
                         'compile s': f'{item.compile_seconds:.1f}',
                         'default': item.default, 'report': {k: getattr(item, k) for k in (
                             'registers', 'spill_store_bytes', 'spill_load_bytes', 'shared_bytes',
                             'stack_bytes', 'ptx_size', 'cubin_size', 'compile_seconds')}})


def build_parser() -> argparse.ArgumentParser:
    """The command line (checked by tests/test_readme.py against the README's commands)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--capability', type=int, nargs='+', default=list(aot.DEFAULT_CAPABILITIES),
                        help='compute capabilities to compile for (default: 80 90)')
    parser.add_argument('--module', nargs='*', default=None, help='only these kernel modules (e.g. flash_prior)')
    parser.add_argument('--filter', default='', help='only spec names matching this regex (e.g. _d64_)')
    parser.add_argument('--dir', type=Path, default=None, help='directory of kernel modules (default: kernels/)')
    parser.add_argument('--jobs', type=int, default=aot.default_jobs(),
                        help='parallel compile processes (default: usable CPUs, or VISION_PRIORS_AOT_JOBS)')
    parser.add_argument('--json', type=Path, default=None, help='also write the rows here')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for cap in args.capability:
        aot.shared_limit(cap)  # fail early on an unknown target

    errors: Dict[str, str] = {}
    specs = aot.discover_specs_isolated(args.dir, errors=errors)  # compiled in --jobs worker processes
    if args.module:
        specs = [s for s in specs if s['module'] in args.module]
    specs = [s for s in specs if re.search(args.filter, s['name'])]
    for mod, msg in errors.items():
        print(f'ERROR: kernel module {mod!r} could not be loaded: {msg}', file=sys.stderr)
    if not specs:
        print('no kernel module defines aot_specs() (or none matched --module / --filter); nothing to compile')
        return 1 if errors else 0

    tasks = [(spec, cap) for spec in specs for cap in args.capability if cap in spec['capabilities']]
    start = time.perf_counter()
    results = aot.compile_all(specs, args.capability, jobs=args.jobs)
    rows = [row(spec, cap, item) for (spec, cap), item in zip(tasks, results)]
    total = time.perf_counter() - start
    print(table(rows))
    print(f'\n{len(rows)} compilations in {total:.1f} s with {args.jobs} process(es) '
          f'(Triton {__import__("triton").__version__}, ptxas {aot.ptxas_path(90)})')
    for r in rows:
        if 'error' in r:
            print(f'\nERROR {r["config"]} sm_{r["sm"]}: {r["error"]}')
    if args.json:
        args.json.write_text(json.dumps({'rows': rows, 'module_errors': errors, 'seconds': total}, indent=1))
    return 1 if errors or any(r['status'] != 'ok' for r in rows) else 0


if __name__ == '__main__':
    sys.exit(main())
