#!/usr/bin/env python
"""Tokenize a corpus offline for nanotron-recover (same as ``nanotron-recover prepare-data``).

Example: ``python scripts/prepare_data.py --output data/kjv`` (embedded King James Bible, 8k BPE).
"""

import sys

from nanotron_recover.data.prepare_cli import main

if __name__ == "__main__":
    sys.exit(main())
