"""The ``vision-priors`` command: one sub-command per recipe, each the recipe module's own command line.

    vision-priors resolution compare ...   = python -m vision_priors.recipes.resolution_extrapolation compare ...
    vision-priors vqa train ...            = python -m vision_priors.recipes.spatial_vqa train ...
    vision-priors pcn compare ...          = python -m vision_priors.recipes.pcn compare ...
    vision-priors scenes --out grid.png    = python -m vision_priors.recipes.data.builtin_scenes ...

Recipe modules are imported only when their sub-command runs.
"""
import importlib
import sys
from typing import Dict, List, Optional, Tuple

# sub-command -> (module, one-line description)
RECIPES: Dict[str, Tuple[str, str]] = {
    'resolution': ('vision_priors.recipes.resolution_extrapolation',
                   'resolution extrapolation: train at one resolution, evaluate at unseen ones (GOAT Fig. 5)'),
    'vqa': ('vision_priors.recipes.spatial_vqa', 'CIFAR scan-order spatial VQA (GOAT Sec. 6, Tables 9-10)'),
    'pcn': ('vision_priors.recipes.pcn', 'PCN point-cloud completion, vanilla vs LAVO cross-attention (LAVO Table 7)'),
    'forecast': ('vision_priors.recipes.forecast',
                 'Informer forecasting, full vs LAVO cross-attention vs linear (LAVO Table 8)'),
    'lm': ('vision_priors.recipes.language', 'byte-level causal LMs: length extrapolation, passkey, indirect indexing'),
    'scenes': ('vision_priors.recipes.data.builtin_scenes', 'save a grid of the built-in spatial scenes'),
}
PROG = 'vision-priors'


def usage() -> str:
    width = max(map(len, RECIPES))
    lines = [f'usage: {PROG} COMMAND [ARGS ...]   ({PROG} COMMAND --help for its options)', '', 'commands:']
    lines += [f'  {name:<{width}}  {text}' for name, (_, text) in RECIPES.items()]
    return '\n'.join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in RECIPES:
        print(f'{PROG}: unknown command {name!r}\n\n{usage()}', file=sys.stderr)
        return 2
    module = importlib.import_module(RECIPES[name][0])
    from .engine import close_distributed

    try:
        module.main(rest)
    finally:
        close_distributed()
    return 0


if __name__ == '__main__':
    sys.exit(main())
