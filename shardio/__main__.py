"""Run the CLI with ``python -m shardio``."""

import sys

from shardio.cli.main import main

sys.exit(main())
