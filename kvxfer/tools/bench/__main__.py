"""``python -m kvxfer.tools.bench`` runs ``kvxfer bench``."""

from __future__ import annotations

import sys

from kvxfer.tools.bench.cli import main

sys.exit(main())
