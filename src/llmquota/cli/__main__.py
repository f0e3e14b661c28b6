"""`python -m llmquota.cli`: the same as the `llmquota` command."""

import sys

from llmquota.cli.main import main

sys.exit(main())
