"""SFT entry script: ``python recipes/sft.py --config recipes/sft_smollm2.yaml [--nproc-per-node N] [key=value ...]``.

The same as the installed ``automodel sft`` command; the runnable code lives in ``automodel.training``.
"""

import sys

from automodel.training.cli import main

if __name__ == "__main__":
    sys.exit(main(["sft", *sys.argv[1:]]))
