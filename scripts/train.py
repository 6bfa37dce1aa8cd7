"""Same as the `vrgd-train` command: python scripts/train.py --help."""

import sys

from tf_vrgd.experiments.train import main

if __name__ == "__main__":
    sys.exit(main())
