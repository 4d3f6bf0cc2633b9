"""Pretraining entry script: ``python recipes/pretrain.py --config recipes/pretrain_smollm2.yaml [...]``.

The same as the installed ``automodel pretrain`` command; the runnable code lives in ``automodel.training``.
"""

import sys

from automodel.training.cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
