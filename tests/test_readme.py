"""The README is executable documentation: its Python examples run, and every recipe command it shows (the ones that
produced its tables included) is accepted by today's command line and passes its recipe's argument checks, so a
renamed or removed flag, or a changed check, cannot leave a table whose command no longer runs."""
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ('README.md', 'recipes/README.md')

# what starts a recipe command: optional VAR=value assignments and a timer, then the command itself
COMMAND = re.compile(r'^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:time\s+|/usr/bin/time\s+-f\s+"[^"]*"\s+)?'
                     r'(?P<cmd>vision-priors\s+[a-z]+\b|python -m (?:vision_priors\.)?recipes\.[\w.]+\b|\./run\.sh demo'
                     r'|\./run\.sh bench\s+[a-z_]+\b|python benchmarks/\w+\.py)'
                     r'(?P<rest>.*)$')
SUBCOMMAND_MODULES = {  # `vision-priors NAME` -> module; the console's own table is the source of truth
    name: module for name, (module, _) in importlib.import_module('vision_priors.recipes.console').RECIPES.items()}


def fenced_blocks(text: str) -> List[Tuple[int, str, str]]:
    """(first line number, language, body) of every ``` block."""
    return [(text.count('\n', 0, m.start()) + 2, m.group(1), m.group(2))
            for m in re.finditer(r'^```(\w*)\n(.*?)^```', text, flags=re.S | re.M)]


def logical_lines(body: str, first: int) -> List[Tuple[int, str]]:
    """Lines of a code block with backslash continuations joined and ``#`` comments dropped."""
    out, current, start = [], '', first
    for number, line in enumerate(body.split('\n'), first):
        piece = line.strip()
        if not current:
            start = number
        current = f'{current} {piece[:-1] if piece.endswith(chr(92)) else piece}'.strip()
        if not piece.endswith('\\'):
            if current and not current.startswith('#'):
                out.append((start, current.split(' # ')[0].strip()))
            current = ''
    return out


def documented_commands(path: str) -> List[Tuple[str, str]]:
    """(where, command) for every recipe command in ``path``: in code blocks (fenced or indented) and in inline code."""
    text = (ROOT / path).read_text()
    found = []
    for first, _, body in fenced_blocks(text):
        found += logical_lines(body, first)
    prose = re.sub(r'^```\w*\n.*?^```', lambda m: '\n' * m.group(0).count('\n'), text, flags=re.S | re.M)
    block, first = [], 0
    for n, line in enumerate(prose.split('\n') + [''], 1):  # indented code blocks (and indented list text)
        if line.startswith('    '):
            block, first = block + [line], first or n
        elif block:
            found += logical_lines('\n'.join(block), first)
            block, first = [], 0
    for m in re.finditer(r'`([^`]+)`', prose):
        found.append((prose.count('\n', 0, m.start()) + 1, ' '.join(m.group(1).split())))
    commands = {(f'{path}:{n}', s) for n, s in found if COMMAND.match(s)}
    return sorted(commands, key=lambda c: int(c[0].rsplit(':', 1)[1]))


def recipe_argv(command: str) -> Tuple[str, List[str]]:
    """The module a documented command runs (a recipe's import name, or a ``benchmarks/`` script's path) and its
    arguments: ``...`` (more arguments) dropped, a seed placeholder (``--seed S``) read as 0."""
    m = COMMAND.match(command)
    head, rest = m.group('cmd'), shlex.split(m.group('rest'))
    if head.startswith('./run.sh bench') or head.startswith('python benchmarks/'):
        name = head.split()[-1].removeprefix('benchmarks/').removesuffix('.py')
        module, argv = f'benchmarks/{name}.py', rest
    elif head == './run.sh demo':
        module, argv = 'vision_priors.recipes.resolution_extrapolation', ['compare'] + rest
    elif head.startswith('vision-priors'):
        module, argv = SUBCOMMAND_MODULES[head.split()[1]], rest
    else:
        module, argv = 'vision_priors.' + head.split()[-1].removeprefix('vision_priors.'), rest
    argv = [a for a in argv if a != '...']
    return module, ['0' if a == 'S' and i and argv[i - 1] in ('--seed', '--seeds') else a for i, a in enumerate(argv)]


def load_module(name: str) -> ModuleType:
    """A recipe by import name, or a benchmark script by its path in the repository (its folder first on sys.path,
    as when it runs: the scripts import their siblings)."""
    if not name.endswith('.py'):
        return importlib.import_module(name)
    path = ROOT / name
    spec = importlib.util.spec_from_file_location(f'readme_{path.stem}', path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def is_command_line(command: str) -> bool:
    """A command to run, not a mention of a recipe (no arguments: ``vision-priors lm``, ``vision-priors pcn ...``)
    nor a help request (``{train,eval,compare} --help``)."""
    argv = recipe_argv(command)[1]
    return '--help' not in argv and '-h' not in argv and (len(argv) > 1 or argv == ['compare'])  # demo = compare


def command_problem(command: str) -> Optional[str]:
    """Why a documented command would not run today (rejected by its parser or by its module's argument checks), or
    None."""
    module_name, argv = recipe_argv(command)
    module = load_module(module_name)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = module.build_parser().parse_args(argv)
    except SystemExit:
        return f'rejected by {module_name}: {errors.getvalue().strip().splitlines()[-1]}'
    try:  # the recipe's own checks, which run before anything is written
        getattr(module, 'validate', lambda _: None)(args)
    except FileNotFoundError:
        pass  # the data file it names (../shared/data/..., a run's folder) is the user's to supply
    except Exception as error:
        return f"fails {module_name}'s checks: {type(error).__name__}: {error}"
    return None


COMMANDS = [c for path in DOCS for c in documented_commands(path) if is_command_line(c[1])]


def test_the_readme_shows_the_commands_of_every_recipe():
    modules = {recipe_argv(command)[0] for _, command in COMMANDS}
    for name in ('resolution_extrapolation', 'spatial_vqa', 'pcn', 'forecast', 'language'):
        assert f'vision_priors.recipes.{name}' in modules, name
    assert {'benchmarks/vit_throughput.py', 'benchmarks/train_step.py'} <= modules, modules
    assert not is_command_line('vision-priors lm ...') and not is_command_line('vision-priors pcn train --help')
    assert is_command_line('./run.sh demo') and is_command_line('vision-priors lm compare --seeds 0')
    assert len(COMMANDS) >= 30, len(COMMANDS)


@pytest.mark.parametrize('where,command', COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_is_accepted_by_its_recipe(where, command):
    problem = command_problem(command)
    assert problem is None, f'{where}: `{command}` {problem}'


@pytest.mark.parametrize('command,problem', [
    ('vision-priors forecast compare --pred-lens 24 --no-such-flag 3', 'unrecognized arguments: --no-such-flag 3'),
    ('vision-priors lm compare --methods goat --methods-typo rope', 'unrecognized arguments: --methods-typo'),
    ('./run.sh demo --models vit_tiny_patch16_goat_224 --epochs two', "--epochs: must be an integer >= 1, got 'two'"),
    ('vision-priors forecast compare --pred-lens 24 48 --seq-lens 96', 'gives 1 length(s) for 2 --pred-lens'),
    ('python -m vision_priors.recipes.spatial_vqa compare --archs fusion --methods nope', 'needs --method(s)'),
    ('./run.sh bench train_step --repeats 0', '--repeats must be >= 1, got 0'),
    ('vision-priors scenes --per-class 0', '--per-class must be a positive int, got 0'),
    ('python benchmarks/bench_fusion_cross_attention.py --tokens 64 --num-heads 4', 'unrecognized arguments'),
])
def test_the_command_check_catches_a_stale_command(command, problem):
    found = command_problem(command)
    assert found is not None and problem in found, found


def test_the_readme_python_examples_run():
    """Every ```python block runs, in order, in one namespace (a later block may use an earlier block's names)."""
    blocks = [(n, body) for n, lang, body in fenced_blocks((ROOT / 'README.md').read_text()) if lang == 'python']
    assert blocks
    namespace = {}
    for first_line, body in blocks:
        exec(compile(body, f'README.md:{first_line}', 'exec'), namespace)
