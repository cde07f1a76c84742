"""Data for the recipes: each module reads or makes one kind of data and is tested on its own.

- ``image_pools``: labelled 32x32 image pools (CIFAR-10 python batches, an ``.npz``, built-in images).
- ``vqa_scenes``: spatial-VQA scenes of four pool images, scan orders, questions, ``build_sets``.
- ``image_folders``: ImageNet-style class folders (``StrictImages``) and webdataset folder checks.
- ``pcn``: PCN's point-cloud layout (PCD / PLY reading and writing via pypcd4 / trimesh), ``PCNDataset``
  and the built-in procedural PCN-layout generator (``write_builtin_pcn``).
- ``builtin_scenes``: spatial-relation scenes rendered at any resolution (``python -m
  vision_priors.recipes.data.builtin_scenes`` saves a grid of them).

Import from the modules (``from vision_priors.recipes.data.image_pools import load_pools``); this package imports none
of them by itself.
"""
