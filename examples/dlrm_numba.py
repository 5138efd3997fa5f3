"""Train a DLRM on jitkern's kernels, with dlrm_s_pytorch.py's flags.

    python examples/dlrm_numba.py                      # small synthetic run: loss, AUC, samples/s
    python examples/dlrm_numba.py --help               # every flag
    python examples/dlrm_numba.py --arch-embedding-size 1460-583-10131227 --arch-mlp-bot 13-512-256-64-16 \
        --arch-mlp-top 512-256-1 --data-generation random --mini-batch-size 2048 --num-batches 100 --print-time
"""
import sys

from jitkern.dlrm.cli import main

if __name__ == "__main__":
    sys.exit(main())
