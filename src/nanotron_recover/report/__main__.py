"""``python -m nanotron_recover.report RUN_DIR [--compare OTHER_RUN_DIR] [--out FILE.png|FILE.html]``."""

import sys

from nanotron_recover.report.cli import main

sys.exit(main())
