"""`python -m pipeline` is the `vit-pipeline` command (for a checkout that is not pip-installed)."""
import sys

from pipeline.console import main

sys.exit(main())
